"""Overdue slots: a reserved group that nobody delivers is regenerated after a deadline.

A reserved slot (``llamarl.app.control.slots``) is accounted for while an executor holds
it (``names.held_key``: the generator that fills it, a reward executor scoring it, the
trainer rank whose pipeline received its group and has not settled it yet), while it may
wait in the ``LOST_SLOTS`` queue, and once the trainer's ledger consumed it. In between,
its group travels in a queue (``rollouts``, ``scored``) for as long as the reader takes
to pop it. A message that never arrives (popped by another client of the store, which
loopback allows any local user; or lost any other way) leaves its slot reserved and
unaccounted for for good: an asynchronous run leaves a hole in its ledger, and a
synchronous one (``max_staleness 0``), which needs every slot of a step, waits for ever.

Trainer replica 0's membership watcher (``llamarl.app.control.membership``) calls
``Deadlines.poll`` every ``WATCH_EVERY_S``, also while the trainer is blocked in its
pipeline's wait. A slot unaccounted for longer than ``--slot-deadline-s`` is *overdue*:
returned to ``LOST_SLOTS`` (signed by the controller, as a lost executor's slots are:
``slots.return_slots``), counted (``faults/overdue_groups``) and logged once per slot;
generators regenerate it first. The deadline counts only the seconds the trainer spends
waiting for rollouts (``WaitClock``): a slow step, evaluation or checkpoint, behind which
groups legitimately queue, never makes them overdue. If the original arrives late after
all, the second of the two copies is a duplicate, dropped and counted by the ledger
(``faults/duplicate_groups``): nothing is trained twice.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from llamarl.app import names
from llamarl.app.control import slots
from llamarl.app.control.signed import SignedStore

log = logging.getLogger("llamarl")


class WaitClock:
    """The seconds the trainer has waited for rollouts: a clock that runs only inside
    ``with clock:`` (around the trainer's ``next_batch``). Read from the watcher's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None

    def __enter__(self) -> "WaitClock":
        with self._lock:
            self._since = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._total += time.monotonic() - self._since
            self._since = None

    def read(self) -> float:
        with self._lock:
            return self._total + (time.monotonic() - self._since if self._since is not None else 0.0)


class Deadlines:
    """Trainer replica 0: the reserved slots not yet consumed, and how long each has been
    unaccounted for (``poll``). ``ledger``: the trainer's, as the run starts (counter
    values map to slot ids through it, as the generators map them) and as it consumes;
    ``holders``: the members whose held slots count (the live generators and reward
    executors, every trainer rank); ``signed``: the controller's."""

    def __init__(self, signed: SignedStore, ledger: slots.SlotLedger, clock: WaitClock, *, deadline_s: float,
                 holders: Callable[[], list[str]]) -> None:
        self.signed, self.ledger, self.clock = signed, ledger, clock
        self.deadline_s, self.holders = deadline_s, holders
        self.start = slots.SlotLedger.from_state(ledger.state_dict())
        self._counted = self.start.count  # the next counter value to map to a slot
        self._open: dict[int, float | None] = {}
        """Reserved slots not consumed: the wait clock's reading when each was first seen
        unaccounted for since it last was (``None``: accounted for at the last poll)."""
        self.overdue = 0
        """Slots returned as overdue, a slot once per return (``faults/overdue_groups``)."""
        self._told: set[int] = set()

    def poll(self) -> list[int]:
        """Look once; the slots found overdue now, returned to be regenerated."""
        now = self.clock.read()
        held = {s for m in self.holders() for s in slots.held_by(self.signed, m)}
        # Read after the holders: a group settled since (it leaves its holder once its slot
        # is in the ledger) is consumed here, never unaccounted for.
        consumed = slots.SlotLedger.from_state(self.ledger.state_dict())
        self._take_new_reservations()
        # A slot returned before may wait in the queue: nobody's, yet not lost.
        waiting = slots.lost_slots_waiting(self.signed.store) > 0
        late = []
        for slot, since in list(self._open.items()):
            if consumed.consumed(slot):
                del self._open[slot]
            elif slot in held or waiting:
                self._open[slot] = None
            elif since is None:
                self._open[slot] = now
            elif now - since > self.deadline_s:
                late.append(slot)
                self._open[slot] = None  # its deadline starts again once it is regenerated
        if late:
            slots.return_slots(self.signed, late)
            self.overdue += len(late)
            self._tell(late)
        return late

    def _take_new_reservations(self) -> None:
        rec = self.signed.get(names.RESERVED_KEY, writers=slots.may_reserve)
        count = rec.get("count") if isinstance(rec, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and count > self._counted:
            for slot in self.start.slot_ids(range(self._counted, count)):
                self._open.setdefault(slot, None)
            self._counted = count

    def _tell(self, late: list[int]) -> None:
        new = [s for s in late if s not in self._told]
        self._told.update(new)
        if new:
            log.warning("slot(s) %s overdue: reserved, and neither held by an executor nor received by the "
                        "trainer for %g s of its waiting for rollouts (the group's message was lost on the way): "
                        "they go back to be regenerated", ", ".join(map(str, new)), self.deadline_s)
