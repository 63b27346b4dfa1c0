"""One RL step's bookkeeping, the same for the single-process loop and the trainer.

``llamarl.app.roles.local`` and ``llamarl.app.roles.trainer`` differ in where rollout groups come from; what a step
does with a batch of them, what it logs and when it gives up are decided here once:

- ``usable`` rollouts are those with a reward (quarantined ones are never trained on);
- a batch without a single usable rollout is *skipped*: no optimizer update, counted in
  ``train/skipped_steps``, its quarantine reasons logged. The step still counts (the
  policy version still advances, so the staleness budget's arithmetic holds).
  ``MAX_SKIPPED_IN_A_ROW`` such batches in a row end the run: the reward setup is broken;
- ``step_values`` / ``step_events``: every scalar of a step under its ``llamarl.app.names`` name,
  the staleness row of every trained rollout and the reward events of every rollout;
- why a step may train little (``completion_shares``, ``frac_zero_var``; in the log line)
  and ``no_answer_warning``, for a first step in which no completion has an answer;
- ``evaluate``: held-out accuracy, greedy and sampled, under ``eval/...`` names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llamarl.app import devices
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.tasks import answers
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.config import GeneratorConfig
from llamarl.app.rl.contract import Rollout, RolloutGroup
from llamarl.app.rewards import reward_events

MAX_SKIPPED_IN_A_ROW = 3


def usable(groups: list[RolloutGroup]) -> list[Rollout]:
    """The rollouts of ``groups`` that have a reward."""
    return [r for g in groups for r in g.rollouts if r.reward is not None]


@dataclass
class SkipGuard:
    """Counts skipped batches (no usable rollout) and raises after too many in a row."""

    skipped: int = 0
    in_a_row: int = 0
    reasons: Counter = field(default_factory=Counter)

    def should_skip(self, groups: list[RolloutGroup], step: int) -> bool:
        if usable(groups):
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        self.reasons.update(str(r.result.quarantined if r.result else "unscored")
                            for g in groups for r in g.rollouts)
        if self.in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise RuntimeError(
                f"step {step}: every rollout of the last {self.in_a_row} batches was quarantined "
                f"by the rewards ({', '.join(f'{k}: {n}' for k, n in self.reasons.most_common())}); "
                "check --rewards")
        return True


def staleness(trained: list[Rollout], consumed_version: int, step: int) -> tuple[list[dict], dict]:
    """One staleness row per trained rollout, and the step's mean and max lag; a rollout's
    lag counts its oldest policy segment (``Rollout.oldest_version``)."""
    lags = [consumed_version - r.oldest_version for r in trained]
    rows = [metrics.staleness(step, r.oldest_version, lag, True) for r, lag in zip(trained, lags)]
    if not lags:
        return rows, {}
    return rows, {names.STALENESS_MEAN: sum(lags) / len(lags), names.STALENESS_MAX: max(lags)}


def frac_zero_var(groups: list[RolloutGroup]) -> float:
    """Share of groups whose usable rollouts all got the same reward: their advantages are
    all 0, so they add nothing to the step (no signal)."""
    flat = [len({r.reward for r in g.rollouts if r.reward is not None}) <= 1 for g in groups]
    return sum(flat) / max(1, len(flat))


def cut_off(rollout: Rollout, eos_id: int) -> bool:
    """Whether the policy's last token is not EOS: the sampler stops a completion only at
    EOS or at ``--max-new-tokens``, so this one was cut off there."""
    policy_ids = rollout.completion_ids[rollout.policy_mask]
    return len(policy_ids) > 0 and int(policy_ids[-1]) != eos_id


def completion_shares(groups: list[RolloutGroup], *, eos_id: int) -> dict[str, float]:
    """Of every completion of the batch (quarantined ones too): the share with no final
    answer a verifier can read (neither a ``####`` nor a ``\\boxed{}``, the same reading as
    ``eval/format``) and the share cut off at ``--max-new-tokens``."""
    rollouts = [r for g in groups for r in g.rollouts]
    n = max(1, len(rollouts))
    return {names.FRAC_NO_ANSWER: sum(answers.final_answer(r.completion) is None for r in rollouts) / n,
            names.FRAC_CUT_OFF: sum(cut_off(r, eos_id) for r in rollouts) / n}


def no_answer_warning(step: int, values: dict[str, float], *, max_new_tokens: int) -> str | None:
    """The warning for a step (the run's first) in which no completion has a final answer a
    verifier can read: every reward is 0 and nothing is learned. None when some has one."""
    if values.get(names.FRAC_NO_ANSWER, 0.0) < 1.0:
        return None
    cut = values.get(names.FRAC_CUT_OFF, 0.0)
    return (f"step {step}: no completion has a final answer the verifiers can read (a '#### <answer>' or "
            "'\\boxed{<answer>}'), so the answer verifiers (math_verifier, the default reward) score every one 0 "
            "and nothing is learned. It is usually the prompt: "
            "say the answer format with an example in --system-prompt, use an instruct model's "
            f"--chat-template, or raise --max-new-tokens ({cut:.0%} of the completions were cut off at "
            f"{max_new_tokens} tokens)")


def step_values(*, groups: list[RolloutGroup], train: dict[str, float] | None, t_train: float,
                step_s: float, consumed_version: int, skipped: int, dropped: int,
                idle_fraction: float, eos_id: int) -> dict[str, float]:
    """Every scalar of one step; ``train`` is ``rl.train_step``'s metrics (None: skipped);
    ``eos_id`` the policy's (what ``completion_shares`` needs)."""
    trained = usable(groups)
    values: dict[str, float] = {}
    if train is not None:
        values.update({names.AIPO_STATS.get(k, k): v for k, v in train.items()})
        tokens = sum(len(r.completion_ids) for r in trained)
        values.update({names.TRAIN_TOKENS_PER_S: tokens / t_train,
                       names.TRAIN_SAMPLES_PER_S: len(trained) / t_train})
    values.update({names.TRAIN_STEP_S: step_s, names.TRAIN_STEPS_PER_MIN: 60.0 / step_s,
                   names.TRAIN_VERSION: consumed_version + 1, names.TRAIN_SKIPPED_STEPS: skipped,
                   names.DROPPED_STALE: dropped, names.IDLE_FRACTION: idle_fraction,
                   names.FRAC_ZERO_VAR: frac_zero_var(groups),
                   **completion_shares(groups, eos_id=eos_id)})
    return values


def step_events(step: int, groups: list[RolloutGroup], values: dict[str, float], *,
                consumed_version: int, reward_names: list[str], role: str,
                replica: int = 0) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The step's metric events (``values`` gets the staleness mean and max added)."""
    rows, lag_values = staleness(usable(groups), consumed_version, step)
    values.update(lag_values)
    events = rows + metrics.scalars(values, role=role, replica=replica, step=step)
    events += reward_events([r.result for g in groups for r in g.rollouts if r.result is not None],
                            reward_names, step, role=role, replica=replica)
    return events, values


def summary(step: int, steps: int, groups: list[RolloutGroup], values: dict[str, float]) -> str:
    """The step's log line: what it trained and why it may have trained little (the
    shares of groups with zero advantage, of completions without an answer and of
    completions cut off at --max-new-tokens)."""
    trained = usable(groups)
    if not trained:
        return f"step {step}/{steps} skipped: no rollout of the batch has a usable reward"
    reward = sum(r.reward for r in trained) / len(trained)  # type: ignore[misc]
    return (f"step {step}/{steps} reward {reward:.3f} loss {values[names.LOSS]:+.4f} "
            f"len {values[names.RESPONSE_LEN]:.1f} zero-adv groups {values[names.FRAC_ZERO_VAR]:.2f} "
            f"no answer {values[names.FRAC_NO_ANSWER]:.2f} cut off {values[names.FRAC_CUT_OFF]:.2f} staleness mean "
            f"{values.get(names.STALENESS_MEAN, 0.0):.2f} max {values.get(names.STALENESS_MAX, 0)} "
            f"dropped {values[names.DROPPED_STALE]:g} {values[names.TRAIN_STEP_S]:.2f}s")


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
             problems: Sequence[tasks.Problem], gen: GeneratorConfig, step: int,
             format_prompt: Callable[[str], str] = tasks.format_prompt, *, samples: int = 1) -> dict[str, float]:
    """Held-out accuracy, greedy and sampled (``samples`` per problem at the generators'
    temperature, seeded by ``step``: the mean over all of them), per level and the share
    of well-formed answers (greedy)."""
    m = rl.evaluate(model, tokenizer, problems, max_new_tokens=gen.max_new_tokens, format_prompt=format_prompt)
    # A problem's samples side by side: one ``sample`` call prefills each prompt once.
    repeated = [p for p in problems for _ in range(samples)]
    sampled = rl.evaluate(model, tokenizer, repeated, max_new_tokens=gen.max_new_tokens,
                          temperature=gen.temperature, generator=devices.seeded_generator(next(model.parameters()).device, step),
                          format_prompt=format_prompt)
    return {**m, "sampled_accuracy": sampled["accuracy"]}


def eval_events(values: dict[str, float], *, step: int, role: str) -> list[dict[str, Any]]:
    return metrics.scalars({names.eval_metric(k): v for k, v in values.items()}, role=role, step=step)
