"""The trainer's full state, saved beside the policy in each checkpoint, and the resume
of a run from it.

``<run_dir>/checkpoints/step-<N>/train_state/`` (inside the step directory that
``llamarl.app.state.checkpoint`` writes atomically) holds:

- the model and the optimizer, written by ``torch.distributed.checkpoint`` (DCP) from
  ``get_state_dict``: a collective over the trainer ranks, each writing its own shard, so
  the same code holds for a sharded (FSDP2) trainer. The number of trainer ranks may
  change at a resume (``RESUMABLE``: ``trainer_ranks``): DCP reshards as it loads, so a
  state saved by 1 rank loads on 2 and one saved by 2 loads on 1, model and optimizer
  alike (``tests/test_train_state.py``);
- ``state.json``: the step, the policy version, the slot ledger (which slots were
  trained or dropped: ``llamarl.app.control.slots.SlotLedger``), the prompt order's position, the model's fingerprint and
  parameter shapes, the RNG states of trainer rank 0, the counters (dropped, skipped
  batches) and the run's config.

Not saved: the generators' sampling RNG (a resumed run samples other completions for the
same prompts), rollouts in flight (regenerated: the ledger), and the queues' contents.

On resume the generators fill the slots the ledger lacks first, then fresh ones
(``llamarl.app.control.slots``): what was in flight at the crash is generated again, what
was trained is never trained twice.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import random
import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llamarl.app.state import checkpoint
from llamarl.app.metrics.events import DB_NAME

DIR_NAME = "train_state"
"""The training state's directory inside a checkpoint's step directory."""
STATE_FILE = "state.json"
FORMAT = 1
RESUMABLE = frozenset({
    "steps", "save_every", "keep_last", "eval_every", "tensorboard", "threads", "gen_threads", "gen_decoder",
    "micro_batch", "trainer_pass", "gen_batch_prompts", "device", "reward_timeout_s", "weight_sync_timeout_s",
    "slot_deadline_s", "weight_digest", "runs_dir", "run_id", "resume",
    "num_generators", "num_reward", "trainer_ranks"})
"""Config fields a resumed run may change: lengths, schedules, resources. Any other
change (learning rate, data, rewards, sampling...) would make a different run."""
_SAFE_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


class ResumeError(RuntimeError):
    """A run cannot be resumed as asked; the message says why and what to do."""


LOCK_NAME = ".trainer.lock"
"""In a run directory: held (``flock``) by the trainer that writes it, and naming it."""


def hold_run_dir(run_dir: Path, holder: str) -> IO[str]:
    """An exclusive lock on ``run_dir`` for as long as the returned file stays open (the
    process's end lets go of it too): one run directory, one live trainer. A second trainer
    (two ``--resume`` of one run) is refused at once, naming ``holder`` of the first,
    before it writes anything."""
    lock = open(Path(run_dir) / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        first = lock.read().strip() or "another process"
        lock.close()
        raise ResumeError(f"run {Path(run_dir).name} is being trained now by {first}: one run directory has one "
                          "live trainer (stop that app, or resume this run once it has ended)") from None
    lock.seek(0)
    lock.truncate()
    lock.write(holder)
    lock.flush()
    return lock


# --------------------------------------------------------------------------- model identity

def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the architecture: model type, parameter names, shapes and dtypes."""
    digest = hashlib.sha256(str(getattr(getattr(model, "config", None), "model_type", "")).encode())
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- RNG

def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA) and Python RNG states, as JSON."""
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()
    version, state, gauss = random.getstate()
    out = {"torch": b64(torch.get_rng_state()), "python": [version, list(state), gauss]}
    if torch.cuda.is_available():
        out["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    torch.set_rng_state(tensor(state["torch"]))
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


# --------------------------------------------------------------------------- save and load

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns at every save and load without a process group; one trainer process
    (no torchrun group) is this project's plain case, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict[str, Any] | None) -> None:
    """Every trainer rank: model and optimizer into ``path`` with DCP (a collective);
    ``state`` (rank 0 passes it, the others None) into ``path/state.json`` after it."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path), no_dist=not _distributed())
    if state is not None:
        (path / STATE_FILE).write_text(json.dumps({"format": FORMAT, "saved_at": time.time(), **state}))


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every trainer rank: model and optimizer from ``path`` (a collective), in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optimizer": optim_sd}
    with _quiet_single_process():
        dcp.load(sd, checkpoint_id=str(path), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


# --------------------------------------------------------------------------- resume

def check_run_id(run_id: str, what: str = "run id") -> None:
    """A run id must name one directory inside the runs directory."""
    if not _SAFE_RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise ResumeError(f"{what} {run_id!r} is not a single safe directory name "
                          "(letters, digits, '.', '_', '-'; no '/' and not '..')")


@dataclass
class Resume:
    """Where a resumed run continues: its run directory and the step it restarts after;
    ``path`` and ``state`` are None for a run resumed at step 0 (no checkpoint yet)."""

    run_dir: Path
    step: int
    path: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def train_state(self) -> Path | None:
        return None if self.path is None else self.path / DIR_NAME

    def check(self, config: dict[str, Any], *, steps: int) -> None:
        """Refuse a config that differs outside ``RESUMABLE``, or nothing left to train."""
        if self.step >= steps:
            raise ResumeError(f"run {self.run_dir.name}: its checkpoint is at step {self.step} and "
                              f"--steps is {steps}: nothing left to train (raise --steps to go on)")
        # No checkpoint yet (resumed at step 0): the config the run directory was made with.
        saved = self.state.get("config") or _json(self.run_dir / "config.json")
        changed = sorted(k for k in set(saved) | set(config) if k not in RESUMABLE
                         and k != "last_checkpoint" and saved.get(k) != config.get(k))
        if changed:
            detail = "; ".join(f"{k}: {saved.get(k)!r} then, {config.get(k)!r} now" for k in changed)
            raise ResumeError(f"run {self.run_dir.name} was started with another config ({detail}); "
                              f"a resume may change only {', '.join(sorted(RESUMABLE))}")

    def check_model(self, model: torch.nn.Module) -> None:
        if self.path is None:
            return
        if self.state.get("fingerprint") != fingerprint(model):
            theirs, mine = self.state.get("parameter_shapes", {}), parameter_shapes(model)
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))[:3]
            raise ResumeError(f"checkpoint {self.path} holds another model than --policy: "
                              + ("; ".join(f"{k}: {theirs.get(k)} saved, {mine.get(k)} now" for k in diff)
                                 or "same shapes, other model type or dtypes"))


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def find_resume(runs_dir: str | Path, run_id: str, resume: str) -> Resume | None:
    """What ``--resume`` asks for: None for a fresh run. ``auto``: the run named by
    ``run_id`` from its newest complete checkpoint, from step 0 when it has a metrics
    database but no checkpoint yet, and a fresh run when it does not exist. Any other
    value names a run that must exist and have a complete checkpoint."""
    if not resume:
        return None
    auto = resume == "auto"
    target = run_id if auto else resume
    if auto and not run_id:
        raise ResumeError("--resume auto continues the run named by --run-id; give one")
    check_run_id(target, "--run-id" if auto else "--resume")
    run_dir = Path(runs_dir) / target
    if not (run_dir / DB_NAME).is_file():
        if auto:
            return None
        present = sorted(p.name for p in Path(runs_dir).iterdir() if (p / DB_NAME).is_file()) \
            if Path(runs_dir).is_dir() else []
        raise ResumeError(f"no run {target!r} under {runs_dir} to resume (runs there: "
                          f"{', '.join(present[-5:]) or 'none'})")
    saved = checkpoint.complete(run_dir / checkpoint.DIR_NAME)
    if not saved:
        if auto:
            return Resume(run_dir=run_dir, step=0)
        raise ResumeError(f"run {target!r} has no complete checkpoint under {run_dir / checkpoint.DIR_NAME} "
                          "(a partial save does not count); save some with --save-every N")
    step, path = saved[-1]
    state = _json(path / DIR_NAME / STATE_FILE)
    if not state:
        raise ResumeError(f"checkpoint {path} has no readable training state ({DIR_NAME}/{STATE_FILE}): it holds "
                          "the policy only and cannot be resumed; start a new run with --policy "
                          f"{path}")
    if state.get("format") != FORMAT or state.get("step") != step:
        raise ResumeError(f"checkpoint {path}: {DIR_NAME}/{STATE_FILE} is not a format-{FORMAT} state of "
                          f"step {step}")
    return Resume(run_dir=run_dir, step=step, path=path, state=state)
