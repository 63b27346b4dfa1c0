"""The trainer's rollout stream as a ``torchdata.nodes`` graph.

    QueueSource (polls the control store with a timeout)
      -> Mapper: decode the group message, score it (inline rewards) or read the scores
         a reward executor attached
      -> Prefetcher (a thread: polling, decoding and scoring overlap the training step)
      -> Mapper: group-relative advantages
      -> StalenessFilter: drop and count groups older than ``max_staleness``
      -> Batcher: ``groups_per_batch`` groups make one training batch

A group is the G completions of one prompt; generators send each group as one message,
so a group never straddles two batches. The staleness filter runs in the consumer's
thread, after the prefetcher, so the lag it checks is the lag at which the batch trains.

The prefetcher's thread is a daemon that torchdata gives no public way to stop. A daemon
thread still inside native code (a store call, a reward model's forward) when the
interpreter exits aborts the whole process ("terminate called without an active
exception"), so the stages that run in that thread pass through a ``Gate`` that
``RolloutStream.close`` shuts and waits out before the process exits.
"""

from __future__ import annotations

import heapq
import threading
from typing import Any, Callable

from torchdata.nodes import BaseNode, Batcher, Mapper, Prefetcher

from app.rewards import CompositeReward, RewardResult
from app.rl import Rollout, score_rollouts, set_group_advantages
from app.transport import StoreQueue, Stopped


class Gate:
    """Every pass of a worker-thread stage holds the gate; once ``close`` returns, no stage
    is inside one and none starts another (they raise ``StopIteration``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def is_closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._closed.is_set():
            self._lock.release()
            raise StopIteration

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def close(self, timeout_s: float) -> None:
        self._closed.set()
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the rollout stream's worker thread was still busy {timeout_s:g} s "
                               "after it was asked to stop (a reward that ignores its timeout?)")
        self._lock.release()


class QueueSource(BaseNode[dict]):
    """Messages from a store queue, forever, oldest policy version first among those
    waiting (groups from several generators arrive out of order; taking the oldest
    first keeps them inside the staleness bound). A silent queue is an error after
    ``timeout_s``."""

    def __init__(self, queue: StoreQueue, *, timeout_s: float, should_stop: Callable[[], bool],
                 what: str = "rollouts", lookahead: int = 64, gate: Gate | None = None) -> None:
        super().__init__()
        self.queue, self.timeout_s, self.what = queue, timeout_s, what
        self.gate = gate or Gate()
        self.should_stop = lambda: self.gate.is_closed() or should_stop()
        self.lookahead = lookahead
        self._waiting: list[tuple[int, int, dict]] = []  # heap of (version, arrival, message)
        self._arrivals = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)

    def next(self) -> dict:
        wait_s = 0.0 if self._waiting else self.timeout_s
        with self.gate:
            for msg in self.queue.pop_many(self.lookahead, wait_s, should_stop=self.should_stop):
                heapq.heappush(self._waiting, (msg["version"], self._arrivals, msg))
                self._arrivals += 1
        if not self._waiting:
            raise TimeoutError(f"no {self.what} arrived on queue {self.queue.name!r} for "
                               f"{self.timeout_s:g} s: are the producers alive?")
        return heapq.heappop(self._waiting)[2]

    def get_state(self) -> dict[str, Any]:
        return {}  # a live stream: nothing to resume from


def group_from_message(msg: dict) -> list[Rollout]:
    """The rollouts of one group message (see ``app.generator.group_message``)."""
    return [Rollout(prompt_ids=msg["prompt_ids"], completion_ids=ids, behaviour_logprobs=lp,
                    version=msg["version"], group=msg["group"],
                    meta={**msg["meta"], "completion": text, "generator": msg["generator"]})
            for ids, lp, text in zip(msg["completions"], msg["logprobs"], msg["texts"])]


def attach_results(group: list[Rollout], results: list[RewardResult]) -> list[Rollout]:
    for r, res in zip(group, results):
        r.reward, r.rewards = res.total, dict(res.components)
        r.meta["reward_result"] = res  # in-process only: for the trainer's reward events
    return group


class Scored:
    """Decode a message and score it: inline with ``reward``, or from the results a
    reward executor attached (``reward=None``)."""

    def __init__(self, reward: CompositeReward | None, timeout_s: float | None = None,
                 gate: Gate | None = None) -> None:
        self.reward, self.timeout_s, self.gate = reward, timeout_s, gate or Gate()

    def __call__(self, msg: dict) -> list[Rollout]:
        group = group_from_message(msg)
        if self.reward is None:
            return attach_results(group, [RewardResult.from_dict(d) for d in msg["results"]])
        with self.gate:
            results = score_rollouts(group, self.reward, self.timeout_s)
        return attach_results(group, results)


def with_advantages(normalize_std: bool) -> Callable[[list[Rollout]], list[Rollout]]:
    def apply(group: list[Rollout]) -> list[Rollout]:
        kept = [r for r in group if r.reward is not None]
        if kept:
            set_group_advantages(kept, normalize_std=normalize_std)
        return group
    return apply


class StalenessFilter(BaseNode[list[Rollout]]):
    """Passes groups whose lag (trainer version now - rollout version) is within bound;
    hands the others to ``on_drop`` (for counting and metrics) and moves on."""

    def __init__(self, source: BaseNode[list[Rollout]], *, max_staleness: int,
                 current_version: Callable[[], int],
                 on_drop: Callable[[list[Rollout], int], None]) -> None:
        super().__init__()
        self.source, self.max_staleness = source, max_staleness
        self.current_version, self.on_drop = current_version, on_drop

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None)

    def next(self) -> list[Rollout]:
        while True:
            group = next(self.source)
            lag = self.current_version() - group[0].version
            if lag <= self.max_staleness:
                return group
            self.on_drop(group, lag)

    def get_state(self) -> dict[str, Any]:
        return {}


class RolloutStream:
    """The graph above; ``next_batch()`` gives a batch: a list of ``groups_per_batch``
    groups. Call ``close()`` before the process exits (see the module docstring)."""

    def __init__(self, queue: StoreQueue, *, reward: CompositeReward | None, reward_timeout_s: float | None,
                 groups_per_batch: int, max_staleness: int, current_version: Callable[[], int],
                 on_drop: Callable[[list[Rollout], int], None], normalize_std: bool,
                 should_stop: Callable[[], bool], timeout_s: float, prefetch: int = 2) -> None:
        self.gate = Gate()
        self.close_timeout_s = (reward_timeout_s or 0.0) + 30.0
        node: BaseNode = QueueSource(queue, timeout_s=timeout_s, should_stop=should_stop, gate=self.gate)
        node = Mapper(node, Scored(reward, reward_timeout_s, gate=self.gate))
        node = Prefetcher(node, prefetch_factor=prefetch)
        node = Mapper(node, with_advantages(normalize_std))
        node = StalenessFilter(node, max_staleness=max_staleness, current_version=current_version,
                               on_drop=on_drop)
        self.root = Batcher(node, batch_size=groups_per_batch, drop_last=False)

    def next_batch(self) -> list[list[Rollout]]:
        """The next batch; the pipeline's stop becomes ``Stopped`` for the caller."""
        if self.gate.is_closed():
            raise Stopped("the rollout stream is closed")
        try:
            return next(self.root)
        except StopIteration:
            raise Stopped("the rollout stream ended") from None

    def close(self) -> None:
        """Stop the worker thread's stages and wait until none is inside a store call or a
        reward. Safe to call twice."""
        self.gate.close(self.close_timeout_s)


__all__ = ["Gate", "QueueSource", "RolloutStream", "Scored", "StalenessFilter", "attach_results",
           "group_from_message", "with_advantages"]
