"""Checkpoints of the policy: Hugging Face directories a run leaves behind.

``<run_dir>/checkpoints/step-<N>/`` holds the policy after N optimizer steps as
``save_pretrained`` writes it (safetensors weights, ``config.json``,
``generation_config.json``, the tokenizer), so ``AutoModelForCausalLM.from_pretrained``
and ``--policy`` of a new run take it as it is.

With ``extra`` (the trainer's), the step directory also holds ``train_state/``
(``llamarl.app.state.train_state``): the model, optimizer and run state a resume starts from, written
inside the same temporary directory, so the policy and its training state appear
together or not at all.

A checkpoint is written under a hidden temporary name in the same directory and renamed
once every file is written: a rename within one directory is atomic, so a crash mid-save
leaves a ``.step-<N>.partial`` directory that nothing lists as a checkpoint (the next save
removes it), never a ``step-<N>`` that looks complete and is not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from llamarl.app.metrics.events import LAST_CHECKPOINT
from llamarl.app.model.policy import save_policy

DIR_NAME = "checkpoints"
"""The checkpoints' directory inside a run directory."""
_COMPLETE = re.compile(r"step-(\d+)")
_PARTIAL = re.compile(r"\.step-(\d+)\.partial")


class CheckpointError(OSError):
    """A checkpoint could not be written; the message names the directory and the cause."""


def step_name(step: int) -> str:
    return f"step-{step}"


def partial_path(root: str | Path, step: int) -> Path:
    """The temporary name ``save`` writes step ``step`` under before the rename."""
    return Path(root) / f".{step_name(step)}.partial"


def save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, root: str | Path, step: int, *,
         extra: Callable[[Path], None] | None = None) -> Path:
    """Write the policy to ``root/step-<step>/`` atomically and return that path;
    ``extra(directory)`` writes more into the step's temporary directory before the rename.

    An existing ``step-<step>`` is never overwritten (``FileExistsError``): two saves of
    one step in one directory mean two runs share it, or a bug. Leftovers of interrupted
    saves in ``root`` are removed first.
    """
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    root = Path(root)
    final = root / step_name(step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; it is never overwritten")
    partial = partial_path(root, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial(root)
        save_policy(model, tokenizer, partial)
        if not (partial / "generation_config.json").is_file():
            # A model built from a bare config may carry none; loaders expect the file.
            GenerationConfig.from_model_config(model.config).save_pretrained(partial)
        if extra is not None:
            extra(partial)
        os.rename(partial, final)
    except Exception as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint {final}: {e}") from e
        raise
    return final


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest step first;
    none when ``root`` does not exist."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _COMPLETE.fullmatch(p.name))]
    return sorted(found)


def remove_partial(root: str | Path) -> list[Path]:
    """Remove what interrupted saves left under ``root``; returns the removed paths."""
    root = Path(root)
    removed = [p for p in root.iterdir() if p.is_dir() and _PARTIAL.fullmatch(p.name)] if root.is_dir() else []
    for p in removed:
        shutil.rmtree(p)
    return removed


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete the oldest complete checkpoints beyond the newest ``keep_last`` (0 keeps
    all); returns the deleted paths."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    if keep_last == 0:
        return []
    old = [p for _, p in complete(root)[:-keep_last]]
    for p in old:
        shutil.rmtree(p)
    return old


def record_latest(config_path: str | Path, step: int, path: Path) -> None:
    """Name the newest checkpoint in the run's ``config.json`` (key ``last_checkpoint``),
    rewritten through a temporary file so a reader never sees half of it."""
    config_path = Path(config_path)
    config = json.loads(config_path.read_text())
    config[LAST_CHECKPOINT] = {"step": step, "path": str(path)}
    tmp = config_path.with_name(config_path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, default=str))
    os.replace(tmp, config_path)
