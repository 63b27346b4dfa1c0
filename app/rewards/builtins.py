"""Rule-based built-in rewards: a format reward and a length penalty (the answer
verifiers are in ``llamarl.app.rewards.verifiers``).

Each is a plain reward function ``fn(prompt, completion, meta) -> float``. The model-based
built-ins live in ``llamarl.app.rewards.models``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamarl.app.tasks.arithmetic import extract_answer, has_format


def format_reward(prompt: str, completion: str, meta: dict) -> float:
    """1.0 when the completion ends with a ``#### <number>`` line; 0.5 when such a marker
    appears but not as the last line (the model kept writing after its answer); else 0.0."""
    if has_format(completion):
        return 1.0
    return 0.5 if extract_answer(completion) is not None else 0.0


def env_reward(prompt: str, completion: str, meta: dict) -> float:
    """An episode's reward from its environment (``meta["env_reward"]``, which the
    generator's episode runner sets, ``llamarl.app.envs.episodes``)."""
    if "env_reward" not in meta:
        raise ValueError("env_reward scores episodes: this rollout has no env_reward (is --env set?)")
    return float(meta["env_reward"])


@dataclass(kw_only=True, frozen=True)
class LengthPenalty:
    """``-min(max_penalty, scale * max(0, words - target))`` with ``words`` the number of
    whitespace-separated tokens of the completion: 0 up to ``target`` words, then linearly
    more negative, floored at ``-max_penalty``. Whitespace words, not policy tokens, so the
    score does not depend on the policy's tokenizer."""

    target: int = 64
    """Words allowed before the penalty starts."""
    scale: float = 0.01
    """Penalty per word over ``target``."""
    max_penalty: float = 1.0
    """The penalty never goes below ``-max_penalty``."""

    def __post_init__(self) -> None:
        if self.target < 0:
            raise ValueError(f"length_penalty target must be >= 0, got {self.target}")
        if self.scale < 0 or self.max_penalty < 0:
            raise ValueError(f"length_penalty scale and max_penalty must be >= 0, "
                             f"got scale={self.scale}, max_penalty={self.max_penalty}")

    def __call__(self, prompt: str, completion: str, meta: dict) -> float:
        over = max(0, len(completion.split()) - self.target)
        return -min(self.max_penalty, self.scale * over)
