"""Where a run's prompts and policy come from: the built-in task's splits and the policy
directory. Every role calls these with the trainer's published config, so every role
reads the same problems in the same order."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from app import tasks
from app.config import TrainerConfig, parse_levels
from app.warmstart import ensure_warmstart


def resolve_policy(spec: str, *, log: Callable[[str], None] = print) -> Path:
    """``warmstart`` (the embedded policy, warm-started once and cached) or a directory."""
    return ensure_warmstart(log=log) if spec == "warmstart" else Path(spec)


def train_problems(cfg: TrainerConfig) -> list[tasks.Problem]:
    """The run's training prompts, in the order they are used (slot n is problem n)."""
    n = cfg.steps * cfg.prompts_per_step
    return tasks.make_split("train", n, seed=cfg.seed + 1, levels=parse_levels(cfg.levels))


def eval_problems(cfg: TrainerConfig) -> list[tasks.Problem]:
    """The held-out problems, disjoint from every training split."""
    return tasks.make_split("eval", cfg.eval_size, seed=cfg.seed, levels=parse_levels(cfg.levels))
