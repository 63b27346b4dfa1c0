"""A run's episodes, slot by slot: what ``--env`` changes in the generator's loop and in
the trainer's held-out evaluation.

Slot ``i`` (the staleness slots of ``llamarl.app.control.slots``) plays training row
``i mod ROWS`` of the environment, rows drawn from the run's seed: every generator, and a
resumed run, gives a slot the same row, so an episode lost in flight (a generator that
died, a resume) is played again from its start by whoever regenerates the slot.

The held-out evaluation (``evaluate``) plays the environment's own ``test`` rows, one
episode each, and scores them with the environment's rewards, not the built-in task's
verifier: a tool's answer or a game's win counts as the training reward does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llamarl.app import names
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.envs.episodes import EpisodeRunner, InFlight, episode_reward, to_group
from llamarl.app.envs.spec import build_env
from llamarl.app.rl.contract import GroupId, RolloutGroup

ROWS = 1000
"""Training rows drawn from the environment; slots cycle through them."""


MAX_STEP_WORKERS = 256
"""Threads running environment steps at most (``step_workers``)."""


def step_workers(episodes: int) -> int:
    """Environment-step threads for ``episodes`` in flight: one each (up to
    ``MAX_STEP_WORKERS``), so a step never queues behind others' slow tools; a thread
    waiting on a tool costs no CPU, and a tool that computes shares the cores anyway."""
    return max(1, min(episodes, MAX_STEP_WORKERS))


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: TrainerConfig, gen: GeneratorConfig,
             step: int) -> dict[str, float]:
    """Held-out accuracy through ``gen.env`` (see the module): the mean episode reward over
    ``cfg.eval_size`` test rows, greedy and sampled (``cfg.eval_samples`` episodes a row
    at the generators' temperature, seeded by ``step``), an episode that could not start
    counting 0; and the greedy episodes' mean turns and tool calls."""
    make = build_env(gen.env)
    rows = make().rows("test", cfg.eval_size, seed=cfg.seed)
    out: dict[str, float] = {}
    for key, greedy in (("accuracy", True), ("sampled_accuracy", False)):
        played = rows if greedy else rows * cfg.eval_samples
        runner = EpisodeRunner(model, tokenizer, make, gen, greedy=greedy, workers=step_workers(len(played)))
        rng = None if greedy else torch.Generator(next(model.parameters()).device).manual_seed(step)
        try:
            episodes = [ep for g in runner.run(played, group_size=1, version=lambda: step, rng=rng) for ep in g]
        finally:
            runner.close()
        out[key] = sum(episode_reward(ep) for ep in episodes) / max(1, len(played))
        if greedy:
            out["episode_turns"] = runner.stats.turns / max(1, len(episodes))
            out["tool_calls"] = runner.stats.tool_calls / max(1, len(episodes))
    return out


class SlotEpisodes:
    """Runs the episodes of a batch of slots (see the module)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: TrainerConfig,
                 gen: GeneratorConfig) -> None:
        make = build_env(gen.env)
        self.spec, self.group_size, self.per_step = gen.env, cfg.group_size, cfg.prompts_per_step
        self.rows = make().rows("train", ROWS, seed=cfg.seed)
        # Episodes per length bucket (tokens after the prompt, up to a power of two) and per
        # number of weight versions their turns were sampled with: the dashboard's histograms.
        self.lengths: Counter[int] = Counter()
        self.versions: Counter[int] = Counter()
        self.runner = EpisodeRunner(model, tokenizer, make, gen,
                                    workers=step_workers(gen.gen_batch_prompts * cfg.group_size))

    def groups(self, slot_ids: list[int], *, version: int, rng: torch.Generator | None, generator_id: int,
               first_seq: int, stop: Callable[[], bool]) -> list[RolloutGroup]:
        """One group of ``group_size`` episodes per slot, in slot order, played as one batch;
        none once ``stop``."""
        rows = [self.rows[i % len(self.rows)] for i in slot_ids]
        played = self.runner.run(rows, group_size=self.group_size, version=lambda: version, rng=rng, stop=stop)
        if stop():
            return []
        return [self.group(episodes, generator_id=generator_id, seq=first_seq + i) for i, episodes in enumerate(played)]

    def in_flight(self, *, rng: torch.Generator | None, stop: Callable[[], bool]) -> InFlight:
        """An empty set of groups in flight for a streaming generator (``admit``, then
        ``InFlight.advance``; each group it hands back goes through ``group``)."""
        self.runner.model.eval()
        return InFlight(self.runner, rng=rng, stop=stop)

    def admit(self, flight: InFlight, slot: int, *, key: int) -> None:
        """Start the ``group_size`` episodes of ``slot``'s row in ``flight`` as group ``key``,
        at the priority of the step the slot trains at (earlier steps' turns first)."""
        flight.admit(key, self.rows[slot % len(self.rows)], self.group_size, priority=slot // self.per_step)

    def group(self, episodes: list[Any], *, generator_id: int, seq: int) -> RolloutGroup:
        """The played ``episodes`` of one slot as rollout group ``(generator_id, seq)``,
        counted in the length and version histograms."""
        if not episodes:
            raise RuntimeError(f"env {self.spec!r}: no episode of a row could start (reset failed: "
                               f"{dict(self.runner.stats.ends)}); see the warning above")
        group = to_group(episodes, GroupId(generator_id, seq), self.runner.tokenizer)
        for r in group.rollouts:
            self.lengths[1 << max(0, len(r.completion_ids) - 1).bit_length()] += 1
            self.versions[len(set(r.segment_versions.tolist()))] += 1
        return group

    def metrics(self) -> dict[str, Any]:
        out = {names.ENV_PREFIX + k: v for k, v in self.runner.stats.metrics().items()}
        out.update({f"{names.ENV_EPISODE_TOKENS_PREFIX}{k}": float(v) for k, v in self.lengths.items()})
        out.update({f"{names.ENV_EPISODE_VERSIONS_PREFIX}{k}": float(v) for k, v in self.versions.items()})
        return out

    def close(self) -> None:
        self.runner.close()


__all__ = ["MAX_STEP_WORKERS", "ROWS", "SlotEpisodes", "evaluate", "step_workers"]
