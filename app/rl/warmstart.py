"""Warm start: supervised fine-tuning of the default policy on worked solutions.

The analogue of starting RL from an instruct model: after it, the policy writes the
GSM8K answer format and gets some problems right, so RL has a signal to amplify.
Deterministic from the seed. ``python -m llamarl.app.roles.warmstart --out checkpoints/warmstart``.
"""

from __future__ import annotations

import ast
import fcntl
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llamarl.app import cli
from llamarl.app.errors import check_at_least
from llamarl.app.rl import step as rl
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.model.policy import DEFAULT_VOCAB_SIZE, create_default_policy, encode_prompts, save_policy


@dataclass(frozen=True)
class ExtraDemonstrations:
    """Demonstrations of another format, mixed in beside the worked solutions (the tool
    warm start's tool calls, ``llamarl.app.envs.tool_warmstart``)."""

    corpus: list[str]
    """Texts the tokenizer also learns its merges from, so the format costs few tokens."""
    make: Callable[[Any], list[rl.Rollout]]
    """The demonstrations, given the tokenizer; their ``policy_mask`` says which tokens
    carry loss (an environment's answer inside one does not)."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """The tokenizer's vocabulary: room for the format's merges beside the task's."""


@dataclass(kw_only=True)
class WarmStartConfig:
    """Supervised warm start of the embedded default policy."""

    out: str = "checkpoints/warmstart"
    """Directory the warm-started policy is saved to (a Hugging Face model directory)."""
    steps: int = 600
    """Optimizer steps."""
    batch_size: int = 64
    """Worked solutions per step."""
    lr: float = 4e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    train_size: int = 20000
    """Distinct training problems drawn from the train split."""
    eval_size: int = 200
    """Held-out problems for the accuracy printed at the end."""
    shortcut_rate: float = 0.5
    """Share of multi-step demonstrations that stop after their first step and give its
    result as the answer. Real instruct models start RL with bad habits that a verifier
    reward can remove; this is ours, so RL has something general to fix (an arithmetic
    fact learnt for one problem does not carry over to the next, a habit does)."""
    seed: int = 0
    """Seed for the model's initialisation, the data and the order."""
    threads: int = 0
    """torch threads (0 keeps torch's default)."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "steps", "batch_size", "train_size", "eval_size")
        if not 0 <= self.shortcut_rate <= 1:
            raise ValueError(f"shortcut_rate must be in [0, 1], got {self.shortcut_rate}")
        check_at_least(self, 0, "lr", strict=True)


def _lr_at(step: int, cfg: WarmStartConfig) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


def warm_start(cfg: WarmStartConfig, *, log=print, extra: ExtraDemonstrations | None = None) -> dict[str, float]:
    """Train, evaluate and save; returns the held-out metrics. With ``extra``, its
    demonstrations join the worked solutions in the shuffled order. ``cfg.threads`` holds
    for the warm start only: the caller's torch thread count is restored after."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, log, extra)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: WarmStartConfig, log, extra: ExtraDemonstrations | None) -> dict[str, float]:
    t0 = time.time()
    extra_kw = {} if extra is None else {"extra_corpus": extra.corpus, "vocab_size": extra.vocab_size}
    model, tokenizer = create_default_policy(cfg.seed, **extra_kw)
    problems = tasks.make_split("train", cfg.train_size, seed=cfg.seed)
    prompts = encode_prompts(tokenizer, [tasks.format_prompt(p.question) for p in problems])
    rng = random.Random(cfg.seed)
    texts = [tasks.format_shortcut_completion(p) if p.level > 1 and rng.random() < cfg.shortcut_rate
             else tasks.format_completion(p) for p in problems]
    completions = [ids + [tokenizer.eos_token_id]
                   for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    data = [rl.Rollout(prompt_ids=p, completion_ids=c, behaviour_logprobs=[], version=0)
            for p, c in zip(prompts, completions)]
    if extra is not None:
        data += extra.make(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    order: list[int] = []
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(data)), len(data))
        batch, order = [data[i] for i in order[: cfg.batch_size]], order[cfg.batch_size:]
        for g in optimizer.param_groups:
            g["lr"] = _lr_at(step, cfg)
        logp_BT, mask_BT = rl.completion_logprobs(model, batch, pad_id=tokenizer.pad_token_id)
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"warmstart step {step:4d}/{cfg.steps}  loss {loss.item():.4f}  {time.time() - t0:.0f}s")
    metrics = rl.evaluate(model, tokenizer, tasks.make_split("eval", cfg.eval_size, seed=cfg.seed),
                          max_new_tokens=48)
    save_policy(model, tokenizer, cfg.out)
    (Path(cfg.out) / "warmstart.txt").write_text(f"{cli.to_dict(cfg)}\n{metrics}\n")
    log(f"warmstart done in {time.time() - t0:.0f}s: held-out {metrics}; saved to {cfg.out}")
    return metrics


def trained_steps(path: str | Path) -> int | None:
    """The optimizer steps a warm start at ``path`` was trained with (its ``warmstart.txt``),
    None when it does not say."""
    try:
        first = (Path(path) / "warmstart.txt").read_text().splitlines()[0]
        steps = ast.literal_eval(first).get("steps")  # a dict's repr, written by warm_start
    except (OSError, IndexError, ValueError, SyntaxError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def ensure_warmstart(path: str | Path = "checkpoints/warmstart", *, log=print,
                     train: Callable[[str], Any] | None = None, steps: int | None = None) -> Path:
    """The warm-started default policy at ``path``, trained there first if it is missing
    (by ``train(path)``; the plain warm start when None), or, with ``steps``, if it was
    trained with another number of steps (a cache an earlier llamarl trained shorter).

    A file lock makes concurrent callers (several roles of one app) train it only once.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if steps is not None and (path / "config.json").is_file() and trained_steps(path) != steps:
            log(f"the warm start at {path} was trained with {trained_steps(path)} steps, not {steps}: "
                "training it again")
            shutil.rmtree(path)
        if not (path / "config.json").is_file():
            log(f"no warm-started policy at {path}: training it now "
                "(once; 3 to 6 minutes on 2 CPU cores)")
            if train is None:
                warm_start(WarmStartConfig(out=str(path)), log=log)
            else:
                train(str(path))
    return path
