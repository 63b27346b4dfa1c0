"""A generator's outbox: where each rollout group goes the moment it is built.

``llamarl.app.rl.step.generate_groups(..., send=outbox.send)`` hands every group on as
the sampler's finished batch is cut into groups (the batch goes on by calls, not back up
through returns to the generator's loop). The outbox stamps a group with the staleness
slot it fills and its send time, frames it into the ``rollouts`` queue (``to_message``,
``StoreQueue.push``, which waits while the queue is full) and tells the executor's
``HeldSlots`` that the slot has passed on. Its time is split as the loop's always was:
building groups is the ``generate`` busy interval, each push a ``queue_full`` idle one.
"""

from __future__ import annotations

import time
from typing import Callable

from llamarl.app.control.slots import HeldSlots
from llamarl.app.control.transport import StoreQueue
from llamarl.app.metrics.events import Timeline
from llamarl.app.rl.contract import RolloutGroup, to_message

__all__ = ["Outbox"]

PUSH_TIMEOUT_S = 600.0
"""How long one group may wait for room in the queue before the generator fails."""


class Outbox:
    """One generator's sends: ``open(slots, first_seq)`` before a batch, ``send(group)`` for
    each group as it is built, ``close()`` after; then ``sent``, ``rollouts``, ``tokens``
    and ``push_s`` say what the batch sent and how long its pushes took. A streaming
    generator ``add``s slots as it takes them, ``close``s before an idle wait and
    ``resume``s after, and ``reset_counts`` after each report."""

    def __init__(self, queue: StoreQueue, held: HeldSlots, timeline: Timeline, *,
                 should_stop: Callable[[], bool]) -> None:
        self.queue, self.held, self.timeline, self.should_stop = queue, held, timeline, should_stop
        self._slots: dict[int, int] = {}  # sequence number -> the slot its group fills
        self._since = 0.0  # start of the current ``generate`` interval
        self.sent = self.rollouts = self.tokens = 0
        self.push_s = 0.0

    def open(self, slots: list[int], first_seq: int) -> None:
        """A batch begins: group ``first_seq + k`` fills ``slots[k]``; its ``generate`` interval starts now."""
        self._slots = {}
        self.add(slots, first_seq)
        self.reset_counts()
        self.resume()

    def add(self, slots: list[int], first_seq: int) -> None:
        """More groups to come (a streaming generator's): group ``first_seq + k`` fills ``slots[k]``."""
        self._slots.update({first_seq + k: slot for k, slot in enumerate(slots)})

    def reset_counts(self) -> None:
        self.sent = self.rollouts = self.tokens = 0
        self.push_s = 0.0

    def resume(self) -> None:
        """Generating again after an idle wait: a ``generate`` interval starts now."""
        self._since = time.time()

    def send(self, group: RolloutGroup) -> None:
        """Frame ``group`` into the queue (waiting while it is full) and pass its slot on."""
        slot = self._slots.pop(group.group_id.seq, None)
        if slot is None:
            raise ValueError(f"outbox: group {group.group_id} fills none of the slots it was given "
                             f"(sequence numbers {sorted(self._slots)})")
        t0 = self._generated()
        with self.timeline.idle("queue_full"):
            group.sent_at, group.slot = time.time(), slot
            self.queue.push(to_message(group), timeout_s=PUSH_TIMEOUT_S, should_stop=self.should_stop)
            self.held.passed(group.slot)
        self._since = time.time()
        self.push_s += self._since - t0
        self.sent += 1
        self.rollouts += len(group.rollouts)
        self.tokens += sum(len(r.completion_ids) for r in group.rollouts)

    def close(self) -> None:
        """The batch is done: its last ``generate`` interval ends."""
        self._generated()

    def _generated(self) -> float:
        """End the current ``generate`` interval (on a GPU, once its kernels are done); its end."""
        if self.timeline.busy_ends is not None:
            self.timeline.busy_ends()
        now = time.time()
        self.timeline.record("busy", "generate", self._since, now)
        return now
