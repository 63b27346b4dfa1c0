"""The policy: a causal LM and its tokenizer, saved and loaded as a Hugging Face directory.

The embedded default is a small Llama-architecture model built from a config, with a
BPE tokenizer trained locally on the task's text (nothing comes from a model hub). Any
local Hugging Face causal-LM directory works as the policy too: ``load_policy`` only
uses ``AutoModelForCausalLM`` / ``AutoTokenizer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast)
from safetensors import SafetensorError
from transformers.utils import logging as hf_logging

from llamarl.app import errors
from llamarl.app.tasks import arithmetic as tasks

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_VOCAB_SIZE = 512


CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
"""How Hugging Face names the classes of a causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``)."""


def check_causal_lm(path: str | Path) -> None:
    """``errors.ConfigError`` (a ``ValueError``) unless ``path`` is a Hugging Face causal-LM directory: a config that
    ``AutoModelForCausalLM`` can build and whose saved architecture is a causal LM (a
    reward classifier or a masked LM trains nonsense, so it is refused before the run)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = Path(path)
    if not (path / "config.json").is_file():
        raise errors.ConfigError(f"policy {path} is not a Hugging Face model directory (no config.json there)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise errors.ConfigError(f"policy {path}: its config.json does not load: {e}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise errors.ConfigError(f"policy {path} is a {config.model_type!r} model, which has no causal-LM class "
                         "(AutoModelForCausalLM)")
    saved = config.architectures or []
    if saved and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in saved):
        raise errors.ConfigError(f"policy {path} holds a {', '.join(saved)}, not a causal language model "
                         "(a ...ForCausalLM): give the policy's directory, not a reward model's")


def build_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over ``texts`` that splits every digit on its own (arithmetic is
    easier to learn digit by digit) and decodes back to the exact text."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    printable = [chr(c) for c in range(32, 127)] + ["\n", "▁"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=printable, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def default_model_config(vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int) -> LlamaConfig:
    """The embedded default policy: ~0.9M parameters (with the task's ~300-token
    vocabulary), fast enough for RL on two CPU cores."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=pad_id,
        bos_token_id=bos_id, eos_token_id=eos_id, attn_implementation="sdpa",
    )


def create_default_policy(seed: int = 0, *, extra_corpus: list[str] | None = None,
                          vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A freshly initialised default policy and its tokenizer, deterministic from ``seed``;
    ``extra_corpus``: more text the tokenizer learns merges from (a tool format, say)."""
    tokenizer = build_tokenizer(tasks.corpus(seed) + list(extra_corpus or ()), vocab_size)
    config = default_model_config(len(tokenizer), pad_id=tokenizer.pad_token_id,
                                  bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Without transformers' progress bars, which it draws for every load and save: noise
    in every role's log, for local directories that take milliseconds. The caller's
    setting is restored."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def context_length(path: str | Path) -> int | None:
    """The longest sequence the policy at ``path`` was built for (``max_position_embeddings``,
    or what the architecture calls it); None when its config does not say."""
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the policy directory ``path``, padding on the left, with a pad
    token (EOS stands in when it has none)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise errors.ConfigError(f"policy {path}: its tokenizer does not load ({type(e).__name__}: "
                                 f"{_first_line(e)}); a policy directory holds the tokenizer beside the model "
                                 "(save_pretrained of both)") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | Path, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any local Hugging Face causal-LM directory; the tokenizer is made to pad on the left
    and to have a pad token (EOS stands in when it has none)."""
    path = Path(path)
    tokenizer = load_tokenizer(path)
    with no_progress_bars():
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, SafetensorError) as e:  # a missing, truncated or corrupt weights file
            raise errors.ConfigError(f"policy {path}: its weights do not load ({type(e).__name__}: "
                                     f"{_first_line(e)})") from None
        model = model.to(device)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, with the BOS token in front when the tokenizer has one
    and the text does not already start with it (a chat template often writes it)."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    bos, bos_text = tokenizer.bos_token_id, tokenizer.bos_token
    return [([bos] if bos is not None and not (bos_text and text.startswith(bos_text)) else []) + list(x)
            for text, x in zip(prompts, ids)]
