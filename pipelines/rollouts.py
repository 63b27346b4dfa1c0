"""The trainer's rollout stream as a ``torchdata.nodes`` graph.

    QueueSource (polls the control store with a timeout; checks each message against the
                 rollout contract, dropping and counting the ones that break it; the
                 groups it takes are this rank's until settled: ``Settlement.received``)
      -> Mapper: score the group (inline rewards), or keep the scores a reward executor
         attached
      -> Prefetcher (a thread: polling, decoding and scoring overlap the training step)
      -> Mapper: group-relative advantages
      -> StalenessFilter: drop and count groups older than ``max_staleness`` (their slots
         go to the settlement: ``llamarl.app.control.slots.Settlement.on_drop``)
      -> Batcher: ``groups_per_batch`` groups make one training batch
      -> the batch settled (``Settlement.settle``): what ``next_batch`` returns is what
         the step trains, each slot consumed once on every trainer rank

A group is the G completions of one prompt; generators send each group as one message,
so a group never straddles two batches. The staleness filter runs in the consumer's
thread, after the prefetcher, so the lag it checks is the lag at which the batch trains:
``next_batch(version)`` is given the version the batch trains at. The pipeline calls
nothing of the trainer's: it hands drops and batches to the slot settlement, and asks
the runtime (``should_stop``, ``health``) and the admission (``admit``) only.

The prefetcher's thread is a daemon that torchdata gives no public way to stop. A daemon
thread still inside native code (a store call, say) when the
interpreter exits aborts the whole process ("terminate called without an active
exception"), so the stages that run in that thread pass through a ``Gate`` that
``RolloutStream.close`` shuts and waits out before the process exits. The gate also
keeps the first error raised inside it, which ``next_batch`` raises as it is (torchdata
hands it over re-wrapped, its message prefixed with "Caught X in _populate_queue").

Several trainer ranks pop the same queue, each for its share of every batch. A ``Holding``
then caps what one rank holds and has not trained at ``(1 + max_staleness)`` batches, the
most the generators may be ahead; a batch counts as held until the trainer asks for the
next one (by then every rank has its share of the step just trained). Without it one
rank's lookahead and prefetch could take the groups another rank needs for the same step,
and both would wait (the other rank in the gradient all-reduce) until the rollout timeout.

While it waits for rollouts, the source calls ``health()`` every ``HEALTH_CHECK_S``: the
trainer learns that a producer died (a reward executor, the last generator) while it is
blocked here, not after a silent ``timeout_s``.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any, Callable

from torchdata.nodes import BaseNode, Batcher, Mapper, Prefetcher

from llamarl.app.config import StreamConfig
from llamarl.app.rl import step as rl
from llamarl.app.rl.contract import Admit, Rejections, RolloutGroup
from llamarl.app.rewards import CompositeReward
from llamarl.app.control.slots import Settlement
from llamarl.app.control.transport import StoreQueue, Stopped

HEALTH_CHECK_S = 0.5
"""How often the source calls ``health()`` while no rollout arrives."""


class Gate:
    """Every pass of a worker-thread stage holds the gate; once ``close`` returns, no stage
    is inside one and none starts another (they raise ``StopIteration``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.error: Exception | None = None
        """The first exception a stage raised inside the gate (``StopIteration`` aside)."""

    def is_closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._closed.is_set():
            self._lock.release()
            raise StopIteration

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception) and not isinstance(exc, StopIteration) and self.error is None:
            self.error = exc
        self._lock.release()

    def close(self, timeout_s: float) -> None:
        self._closed.set()
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the rollout stream's worker thread was still busy {timeout_s:g} s "
                               "after it was asked to stop (a reward that ignores its timeout?)")
        self._lock.release()


class Holding:
    """Groups one rank took from the queue and has not yet trained or dropped, at most
    ``cap``. The source takes (in its worker thread); the consumer releases."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"a rank must be able to hold at least one group, got cap={cap}")
        self.cap, self.held = cap, 0
        self._changed = threading.Condition()

    def room(self) -> int:
        with self._changed:
            return self.cap - self.held

    def take(self, n: int) -> None:
        with self._changed:
            self.held += n

    def release(self, n: int = 1) -> None:
        with self._changed:
            self.held -= n
            self._changed.notify_all()

    def resize(self, cap: int) -> None:
        """A new cap (the staleness bound changed); a smaller one lets what is held drain."""
        with self._changed:
            self.cap = max(1, cap)
            self._changed.notify_all()

    def wait_for_room(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.held < self.cap, timeout_s)


class QueueSource(BaseNode[RolloutGroup]):
    """Rollout groups from a store queue, forever, oldest policy version first among those
    waiting (groups from several generators arrive out of order; taking the oldest
    first keeps them inside the staleness bound). A frame that does not decode, a
    message that breaks the rollout contract, or a group ``admit`` refuses (a replay, a
    version from the future: ``llamarl.app.control.seen_groups.Admission``) is dropped and counted in
    ``rejections``: it takes no place in a batch and frees no slot.
    With a ``holding``, it takes no more than that has room for (a full holding waits for the
    consumer, not for the producers: the silence deadline starts again after it).
    A silent queue is an error after ``timeout_s``; ``health()`` (which raises when the
    producers are gone) is called every ``HEALTH_CHECK_S`` of waiting. ``checks``:
    ``from_message``'s bounds (``vocab_size``, ``group_size``). ``on_receive``: told of
    the groups it takes, as they leave the queue."""

    def __init__(self, queue: StoreQueue, *, timeout_s: float, should_stop: Callable[[], bool],
                 rejections: Rejections, what: str = "rollouts", lookahead: int = 64,
                 gate: Gate | None = None, health: Callable[[], None] | None = None,
                 holding: Holding | None = None, admit: Admit | None = None,
                 on_receive: Callable[[list[RolloutGroup]], None] | None = None, **checks: Any) -> None:
        super().__init__()
        self.holding, self.admit, self.on_receive = holding, admit, on_receive
        self.queue, self.timeout_s, self.what, self.health = queue, timeout_s, what, health
        self.rejections, self.checks = rejections, checks
        self.gate = gate or Gate()
        self.should_stop = lambda: self.gate.is_closed() or should_stop()
        self.lookahead = lookahead
        self._waiting: list[tuple[int, int, RolloutGroup]] = []  # heap of (version, arrival, group)
        self._arrivals = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)

    def next(self) -> RolloutGroup:
        deadline = time.monotonic() + self.timeout_s
        while True:
            # Wait only when nothing is waiting; rejected messages are not traffic, so the
            # deadline stands through them.
            room = self.holding.room() if self.holding is not None else self.lookahead
            if room <= 0 and not self._waiting:
                with self.gate:
                    if self.should_stop():
                        raise Stopped("the run is stopping")
                    if not self.holding.wait_for_room(HEALTH_CHECK_S):
                        continue
                deadline = time.monotonic() + self.timeout_s
                continue
            wait_s = 0.0 if self._waiting else min(HEALTH_CHECK_S, max(0.0, deadline - time.monotonic()))
            with self.gate:
                msgs = self.queue.pop_many(min(self.lookahead, room), wait_s, should_stop=self.should_stop,
                                           on_reject=self.rejections) if room > 0 else []
                if not msgs and not self._waiting and self.health is not None:
                    self.health()
            taken = self.rejections.decode(msgs, self.admit, **self.checks)
            if taken and self.on_receive is not None:
                with self.gate:
                    self.on_receive(taken)
            for group in taken:
                if self.holding is not None:
                    self.holding.take(1)
                heapq.heappush(self._waiting, (group.oldest_version, self._arrivals, group))
                self._arrivals += 1
            if self._waiting:
                return heapq.heappop(self._waiting)[2]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {self.what} arrived on queue {self.queue.name!r} for "
                                   f"{self.timeout_s:g} s: are the producers alive?")

    def get_state(self) -> dict[str, Any]:
        return {}  # a live stream: nothing to resume from


class Scored:
    """Score a group inline with ``reward``; or, with ``reward=None``, pass on the scores
    a reward executor attached (a group that arrives without them is dropped and counted)."""

    def __init__(self, reward: CompositeReward | None, rejections: Rejections,
                 timeout_s: float | None = None, gate: Gate | None = None) -> None:
        self.reward, self.rejections = reward, rejections
        self.timeout_s, self.gate = timeout_s, gate or Gate()

    def __call__(self, group: RolloutGroup) -> RolloutGroup | None:
        if self.reward is None:
            if not group.scored:
                self.rejections("missing_field", f"group {group.group_id} came without reward "
                                "results from the reward executor", "results")
                return None
            return group
        with self.gate:
            rl.score_groups([group], self.reward, self.timeout_s)
        return group


def with_advantages(normalize_std: bool) -> Callable[[RolloutGroup | None], RolloutGroup | None]:
    def apply(group: RolloutGroup | None) -> RolloutGroup | None:
        kept = [r for r in group.rollouts if r.reward is not None] if group is not None else []
        if kept:
            rl.set_group_advantages(kept, normalize_std=normalize_std)
        return group
    return apply


class StalenessFilter(BaseNode[RolloutGroup]):
    """Passes groups whose lag (trainer version now - the group's oldest version) is within bound;
    hands the others to ``on_drop`` (for counting and metrics) and moves on. Skips the
    ``None`` that an upstream stage leaves for a group it dropped."""

    def __init__(self, source: BaseNode[RolloutGroup | None], *, max_staleness: int,
                 current_version: Callable[[], int],
                 on_drop: Callable[[RolloutGroup, int], None]) -> None:
        super().__init__()
        self.source, self.max_staleness = source, max_staleness
        self.current_version, self.on_drop = current_version, on_drop

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None)

    def next(self) -> RolloutGroup:
        while True:
            group = next(self.source)
            if group is None:
                continue
            lag = self.current_version() - group.oldest_version
            if lag <= self.max_staleness:
                return group
            self.on_drop(group, lag)

    def get_state(self) -> dict[str, Any]:
        return {}


class RolloutStream:
    """The graph above over ``queue``, shaped by ``config``; ``next_batch(version)`` gives
    a settled batch: the groups of ``config.groups_per_batch`` that ``settlement`` keeps.
    Each of ``config.ranks`` trainer ranks popping the same queue has a stream of its own.
    Call ``close()`` before the process exits (see the module docstring).

    The runtime objects it uses: ``rejections`` counts the messages dropped on receipt;
    ``reward`` scores inline (None: a reward executor attached the scores); ``admit``
    refuses replays and versions from the future (``QueueSource``); ``should_stop`` and
    ``health`` are the runtime's (the run is stopping; a producer died)."""

    def __init__(self, queue: StoreQueue, config: StreamConfig, *, settlement: Settlement, rejections: Rejections,
                 should_stop: Callable[[], bool], reward: CompositeReward | None = None, admit: Admit | None = None,
                 health: Callable[[], None] | None = None) -> None:
        self.gate, self.settlement = Gate(), settlement
        self._version = 0  # the version the batch being taken trains at (``next_batch``)
        self.close_timeout_s = (config.reward_timeout_s or 0.0) + 30.0
        # One rank alone takes all it can see: the more it sees, the better its oldest-first
        # order. Several share the queue, so each holds at most its share (module docstring).
        self.holding = (Holding(cap=(1 + config.max_staleness) * config.groups_per_batch)
                        if config.ranks > 1 else None)
        self._last_batch = 0
        node: BaseNode = QueueSource(queue, timeout_s=config.timeout_s, should_stop=should_stop,
                                     rejections=rejections, gate=self.gate, health=health,
                                     holding=self.holding, admit=admit, on_receive=settlement.received,
                                     vocab_size=config.vocab_size, group_size=config.group_size)
        scored = Scored(reward, rejections, config.reward_timeout_s, gate=self.gate)
        node = Mapper(node, lambda group: self._released_if_dropped(group, scored(group)))
        node = Prefetcher(node, prefetch_factor=config.prefetch)
        node = Mapper(node, with_advantages(config.normalize_std))

        def dropped_stale(group: RolloutGroup, lag: int) -> None:
            if self.holding is not None:
                self.holding.release()
            settlement.on_drop(group, lag)

        self.groups_per_batch = config.groups_per_batch
        self.filter = StalenessFilter(node, max_staleness=config.max_staleness, current_version=lambda: self._version,
                                      on_drop=dropped_stale)
        self.root = Batcher(self.filter, batch_size=config.groups_per_batch, drop_last=False)

    def set_bound(self, max_staleness: int) -> None:
        """A new staleness bound (``--max-staleness auto``), from the next batch on; every
        trainer rank sets the same one between the same two steps."""
        self.filter.max_staleness = self.settlement.max_staleness = max_staleness
        if self.holding is not None:
            self.holding.resize((1 + max_staleness) * self.groups_per_batch)

    def _released_if_dropped(self, group: RolloutGroup, scored: RolloutGroup | None) -> RolloutGroup | None:
        if scored is None:  # dropped unscored by ``Scored``
            with self.gate:
                self.settlement.refused(group)
            if self.holding is not None:
                self.holding.release()
        return scored

    def next_batch(self, version: int) -> list[RolloutGroup]:
        """The next batch, to train at policy ``version``, settled (with several trainer
        ranks, a collective: ``Settlement.settle``); the pipeline's stop becomes
        ``Stopped`` for the caller, and an error in the worker thread is raised as it was
        raised there."""
        self._version = version
        if self.gate.is_closed():
            raise Stopped("the rollout stream is closed")
        if self.holding is not None:
            # The trainer asks for a batch once it trained the last one, so every rank had its
            # share of that step (the all-reduce waited for them): only now may this rank
            # take the next step's groups.
            self.holding.release(self._last_batch)
            self._last_batch = 0
        try:
            batch = next(self.root)
        except StopIteration:
            raise Stopped("the rollout stream ended") from None
        except Exception:
            if self.gate.error is not None:
                raise self.gate.error from None
            raise
        self._last_batch = len(batch)
        return self.settlement.settle(batch, version)

    def close(self) -> None:
        """Stop the worker thread's stages and wait until none is inside a store call or a
        reward. Safe to call twice."""
        self.gate.close(self.close_timeout_s)


__all__ = ["Gate", "Holding", "QueueSource", "RolloutStream", "Scored", "StalenessFilter", "with_advantages"]
