"""Slots: the places of rollout groups in a run, from reservation to consumption.

Slot n is the n-th group the generators fill, and it is always sampled for prompt
``order.problem(n)``. Every slot goes through these states, each kept in the control
store (signed records, ``llamarl.app.control.signed``) or in the trainer's ledger::

                 reserve                              pass
    (free) ----------------------> held ----------------------------> passed (in a queue)
      ^     SlotBudget.reserve:     |  HeldSlots.take / .passed         |             |
      |     the signed counter,     |  (a generator, a reward executor, |  overdue:   | the trainer
      |     within the staleness    |  the trainer rank that received   |  overdue.py | settles it
      |     bound                   |  it; names.held_key)              |             v
      |                             | lose: its executor gone   <-------+    consume (Settlement.settle)
      |                             v  (membership: return_held)             /        |         \\
      |  regenerate               lost                                   trained   dropped    duplicate
      +---------------------- LOST_SLOTS queue                            (ledger)  as stale   (a second
         take_lost_slots: before new ones                                           (ledger,   copy:
         (outside the counter: it counted them)                                     +1 place)  -1 place)

- **reserve**: a generator takes counter values from the signed counter
  ``names.RESERVED_KEY`` (compare-and-set, so atomic across generators) up to
  ``(version + 1 + max_staleness) * B`` plus the places the trainer gave back
  (``SlotBudget``); the counter values map to slot ids through the ledger
  (``SlotLedger.slot_ids``: after a resume, the slots the checkpoint had not consumed come
  first).
- **hold**: an executor lists the slots it works on under ``names.held_key(member)``, a
  record it signs (``HeldSlots``); **pass**: the group is in the next queue, the slot
  leaves the list.
- **lose**: the membership watcher (``llamarl.app.control.membership``) finds an executor
  gone and pushes what it held to the ``LOST_SLOTS`` queue, each id signed by the
  controller (``return_held``); **regenerate**: generators take those first
  (``take_lost_slots``), outside the counter.
- **overdue**: a group passed on and never received (its message lost): the watcher
  returns its slot the same way after a deadline (``llamarl.app.control.overdue``).
- **consume**: the trainer settles every group it took in the ``SlotLedger``, the same on
  every trainer rank (``Settlement.settle``): **trained**, **dropped** as too stale (its
  place given back to the budget at once: ``names.dropped_key``), or a **duplicate**, the
  second copy of a consumed slot (a lost executor's group that got out, and its
  regeneration): dropped, counted (``faults/duplicate_groups``) and its place taken back
  (``slots_taken_back``). Nothing is trained twice.

The ledger (``SlotLedger.state_dict``) is saved in every checkpoint
(``llamarl.app.state.train_state``) and published at the run's start under
``names.SLOTS_DONE_KEY``; a resumed run's counter restarts at ``SlotLedger.count``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from llamarl.app import names
from llamarl.app.control.bound import published_bound
from llamarl.app.control.seen_groups import REPLAY, TOO_OLD, SeenIds, all_gather_ids, taken_by_other_ranks
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.transport import Control
from llamarl.app.metrics import events as metrics
from llamarl.app.rl.contract import Rejections, RolloutGroup

log = logging.getLogger("llamarl")


# --------------------------------------------------------------------------- consumed: the ledger

@dataclass
class SlotLedger:
    """The slots the trainer has consumed (trained or dropped as stale): everything below
    ``frontier`` and the ``done`` ids above it (groups from several generators arrive
    out of order)."""

    frontier: int = 0
    done: set[int] = field(default_factory=set)
    # Held while it changes: the overdue watcher reads it from its thread (``state_dict``).
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def consume(self, slot: int) -> None:
        if self.consumed(slot):
            raise ValueError(f"slot {slot} consumed twice")
        with self._lock:
            self.done.add(slot)
            while self.frontier in self.done:
                self.done.remove(self.frontier)
                self.frontier += 1

    def consumed(self, slot: int) -> bool:
        return slot < self.frontier or slot in self.done

    @property
    def missing(self) -> int:
        """Slots below the highest consumed one that were not consumed (lost in flight)."""
        return max(self.done) + 1 - self.count if self.done else 0

    @property
    def count(self) -> int:
        """How many slots were consumed: where the generators' counter restarts."""
        return self.frontier + len(self.done)

    def slot_ids(self, counts: range) -> list[int]:
        """The slot ids of counter values ``counts`` (each >= ``count``): the ids the
        ledger lacks, lowest first; for a fresh ledger the counter values themselves."""
        holes = [s for s in range(self.frontier, max(self.done, default=-1)) if s not in self.done]
        fresh = max(self.done, default=self.frontier - 1) + 1
        out = []
        for c in counts:
            k = c - self.count
            if k < 0:
                raise ValueError(f"counter value {c} is below the ledger's count {self.count}")
            out.append(holes[k] if k < len(holes) else fresh + k - len(holes))
        return out

    def consume_across_ranks(self, slots: list[int | None]) -> list[bool]:
        """Consume this trainer rank's ``slots`` (its groups of one step) and every other
        rank's, in rank order, the same on every rank: a collective (with several ranks),
        after which every rank holds the same ledger. Whether each of this rank's slots was
        consumed for the first time (``None``, a group that filled no slot: ``True``).
        ``False``: consumed already, at an earlier step on any rank, or in this step by a
        lower rank, which keeps its group. So the two copies of a regenerated slot are
        trained once whichever ranks they reach. Slot ids travel as int64 tensors, never
        pickled."""
        ids = [-1 if s is None else s for s in slots]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts, rank = [p.tolist() for p in all_gather_ids(torch.tensor(ids, dtype=torch.int64))], dist.get_rank()
        else:
            parts, rank = [ids], 0
        mine = []
        for r, part in enumerate(parts):
            for slot in part:
                fresh = slot < 0 or not self.consumed(slot)
                if fresh and slot >= 0:
                    self.consume(slot)
                if r == rank:
                    mine.append(fresh)
        return mine

    def state_dict(self) -> dict[str, Any]:
        with self._lock:  # safe from another thread than the one that consumes
            return {"frontier": self.frontier, "done": sorted(self.done)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "SlotLedger":
        frontier, done = state.get("frontier"), state.get("done")
        if not isinstance(frontier, int) or frontier < 0 or not isinstance(done, list) or not all(
                isinstance(s, int) and s > frontier for s in done):
            raise ValueError(f"bad slot ledger {state!r}")
        return cls(frontier, set(done))


def slots_taken_back(stale_first: list[bool], batch_first: list[bool]) -> int:
    """How many places the generators' staleness budget loses at one step's settling
    (``SlotLedger.consume_across_ranks`` flags: whether each group was its slot's first).
    Every group the trainer drops as stale gave its place back at once (the generators
    may need it to fill the batch the trainer waits for), but only a slot's first copy
    holds a place in the counter. A second copy (a lost executor's group that got out,
    and its regeneration) holds none: dropped as stale, the place it gave back is taken
    back; in a batch, it used a place there, and the step trains one counted slot fewer.
    Either way one place is taken back, or one group too many stays in flight, turns
    stale again and again and is regenerated for the rest of the run. (Groups that
    filled no slot are not passed in.)"""
    return sum(not first for first in stale_first) + sum(not first for first in batch_first)


def publish_start(signed: SignedStore, ledger: SlotLedger, given_back: int, *, rank: int = 0) -> None:
    """Trainer replica 0 at a (re)start: the counter at the ledger's count, the places the
    run had given back (``given_back``: every rank's net count at the checkpoint; their
    slots were refilled) under its own dropped counter, and the ledger the generators map
    counter values with (re-published if anyone overwrites it)."""
    signed.put(names.RESERVED_KEY, {"count": ledger.count})
    if given_back:
        signed.put(names.dropped_key(names.member("trainer", rank)), given_back)
    signed.put(names.SLOTS_DONE_KEY, ledger.state_dict(), keep=True)


def given_back(signed: SignedStore, members: list[str]) -> int:
    """The places ``members`` (trainer ranks) gave back so far, net: their signed counters
    (``names.dropped_key``) added up; a counter that is not an int counts 0. Can be negative."""
    total = 0
    for m in members:
        n = signed.get(names.dropped_key(m), writers=(m,), default=0)
        total += n if isinstance(n, int) and not isinstance(n, bool) else 0
    return total


# --------------------------------------------------------------------------- reserve

def may_reserve(writer: str) -> bool:
    """The slot counter is written by the controller (its start) and by generators."""
    return writer == CONTROLLER or writer.startswith("generator/")


class SlotBudget:
    """A generator's reservations: group slots such that no rollout can be more than
    ``max_staleness`` stale.

    The counter is a signed record ``{"count": n}`` (``names.RESERVED_KEY``), replaced by
    compare-and-set of its exact bytes, so reservations stay atomic across generators. A
    value that is not authentic is ignored (the last authentic count stands) and replaced
    by the next reservation; a count below one this generator saw is a replay, and the
    highest seen stands. The trainer's dropped groups are one signed counter per trainer
    rank (``names.dropped_key``), added up here.

    ``auto`` (``--max-staleness auto``): the bound is the controller's signed record,
    read at every reservation (``llamarl.app.control.bound.published_bound``). A raised
    bound lets generators reserve further ahead at once; after a lowered one they wait,
    and a group that reaches the trainer too old is dropped and its place given back.
    """

    def __init__(self, signed: SignedStore, *, groups_per_step: int, max_staleness: int,
                 ledger: SlotLedger | None = None, auto: bool = False) -> None:
        self.signed, self.B, self.K, self.auto = signed, groups_per_step, max_staleness, auto
        self.ledger = ledger or SlotLedger()
        self.control = Control(signed)
        self._highest = 0  # the highest count seen or reserved here

    def dropped(self) -> int:
        """Slots every trainer rank gave back so far, net: stale groups dropped (+1 each:
        their places may be filled again) less batch places taken by second copies of
        trained slots (-1 each: those places were used). Can be negative."""
        return given_back(self.signed, [m for m in self.control.members() if m.startswith("trainer/")])

    def slot_ids(self, reserved: range) -> list[int]:
        """The slots of counter values ``reserved`` (after a resume, the ledger's missing first)."""
        return self.ledger.slot_ids(reserved)

    def reserve(self, want: int, version: int) -> range:
        """Slots (0-based) this generator may fill with weights of ``version``; empty when
        it must wait for newer weights. Atomic across generators (compare-and-set)."""
        key = names.RESERVED_KEY
        if self.auto:
            self.K = published_bound(self.signed, self.K)
        while True:
            cap = (version + 1 + self.K) * self.B + self.dropped()
            seen = self.signed.store.get(key) if self.signed.store.check([key]) else b""
            rec = self.signed.open(key, seen, writers=may_reserve) if seen else None
            rec = rec or self.signed.last(key)
            count = rec.value.get("count") if rec is not None and isinstance(rec.value, dict) else None
            start = self._highest = max(self._highest, count if isinstance(count, int) else 0)
            take = min(want, cap - start)
            if take <= 0:
                return range(0)
            # Each record is unique (its counter), so winning the compare-and-set is ours.
            won, _ = self.signed.compare_set(key, seen, {"count": start + take})
            if won:
                self._highest = start + take
                return range(start, start + take)


# --------------------------------------------------------------------------- hold, pass, lose, regenerate

class HeldSlots:
    """What one executor holds, mirrored in the store for the watcher (``names.held_key``),
    signed by that executor (``signed.writer``). A trainer rank's is taken by its
    pipeline's thread and released by its loop: changes are serialised."""

    def __init__(self, signed: SignedStore) -> None:
        self.signed, self.key = signed, names.held_key(signed.writer)
        self.slots: list[int] = []
        self._lock = threading.Lock()

    def take(self, slots: list[int | None]) -> None:
        with self._lock:
            self.slots = self.slots + [s for s in slots if s is not None]
            self.signed.put(self.key, self.slots)

    def passed(self, slot: int | None) -> None:
        """Called after the group of ``slot`` is in the next queue."""
        self.release([slot])

    def release(self, slots: list[int | None]) -> None:
        """The groups of ``slots`` left this holder (passed on, consumed, dropped): one entry each."""
        with self._lock:
            left = list(self.slots)
            for slot in slots:
                if slot is not None and slot in left:
                    left.remove(slot)
            if len(left) == len(self.slots):
                return
            self.slots = left
            self.signed.put(self.key, self.slots)


def _slot_id(value: object) -> bool:  # a well-formed slot id from a record
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def return_held(signed: SignedStore, member: str) -> int:
    """The controller: the slots ``member`` (lost) held to the lost-slots queue; how many."""
    slots = held_by(signed, member)
    return_slots(signed, slots)
    signed.store.delete_key(names.held_key(member))
    return len(slots)


def held_by(signed: SignedStore, member: str) -> list[int]:
    """The slots ``member`` lists as held (its own signed record; none if there is none)."""
    held = signed.get(names.held_key(member), writers=(member,), default=[])
    return [s for s in held if _slot_id(s)] if isinstance(held, list) else []


def return_slots(signed: SignedStore, slots: list[int]) -> None:
    """The controller: ``slots`` to the lost-slots queue, each a record it signs."""
    queue = names.queue_key(names.LOST_SLOTS)
    for slot in slots:
        signed.store.queue_push(queue, signed.seal(queue, slot))


def take_lost_slots(signed: SignedStore, max_n: int) -> list[int]:
    """Up to ``max_n`` slot ids lost with a dead executor, to regenerate before new ones:
    only the controller's records, each taken once (a replayed one is ignored, counted)."""
    out: list[int] = []
    key = names.queue_key(names.LOST_SLOTS)
    while len(out) < max_n:
        try:
            raw = signed.store.queue_pop(key, block=False)
        except dist.QueueEmptyError:
            break
        rec = signed.open(key, raw, writers=(CONTROLLER,), once=True)
        if rec is None:
            continue
        if _slot_id(rec.value):
            out.append(rec.value)
        else:
            log.error("dropped a malformed lost slot id %r", str(rec.value)[:40])
    return out


def lost_slots_waiting(store: dist.Store) -> int:
    """How many lost slots wait to be regenerated (a generator at its bound takes them)."""
    return int(store.queue_len(names.queue_key(names.LOST_SLOTS)))


# --------------------------------------------------------------------------- consume: the trainer's side

class Settlement:
    """One trainer rank's side of consumption: groups dropped as stale (from the pipeline's
    thread) and its batches, settled in the ``ledger`` at each step alike on every rank;
    its net places given back to the budget, a signed record (``names.dropped_key``).
    ``dropped``: stale groups (replica 0 continues the checkpoint's); ``duplicates``: second
    copies dropped; ``freed``: places given back, net (from the run's total: ``publish_start``)."""

    def __init__(self, signed: SignedStore, *, rank: int, world: int, ledger: SlotLedger, max_staleness: int,
                 rejections: Rejections, emit: Callable[[list[dict]], None], dropped: int = 0,
                 freed: int = 0) -> None:
        self.signed, self.rank, self.world, self.ledger = signed, rank, world, ledger
        self.max_staleness, self.rejections, self.emit = max_staleness, rejections, emit
        self.dropped = dropped
        self.duplicates = 0
        self.freed = freed
        self._freed_lock = threading.Lock()
        self._stale: list[tuple[RolloutGroup, int]] = []  # dropped as stale, not yet settled
        self._trained_elsewhere = SeenIds()  # groups the other trainer ranks trained
        self.held = HeldSlots(signed)  # received, not yet settled: not overdue (``received``)

    def received(self, groups: list[RolloutGroup]) -> None:
        """Groups the pipeline took from its queue: held by this rank until settled or
        refused, never overdue (a batch may wait long for its last group). Pipeline thread."""
        if got := [g.slot for g in groups if g.slot is not None]:
            self.held.take(got)

    def refused(self, group: RolloutGroup) -> None:
        """A received group dropped unscored: unaccounted for again, regenerated once overdue."""
        self.held.release([group.slot])

    def on_drop(self, group: RolloutGroup, lag: int) -> None:
        """A group too stale to train: settled with the next batch (``settle``), where
        every rank learns of its slot; its place in the generators' budget is given back
        now (with max_staleness 0 they may need it to fill the batch the trainer waits
        for; taken back at the settling if it was a second copy). Counted under
        ``security/rejected_frames/too_old`` too (the Security tab shows every version
        outside the trainable window), though with asynchronous generators it is usually
        ordinary staleness, not an attack. Called from the pipeline's thread."""
        self.rejections.counted(TOO_OLD, f"group {tuple(group.group_id)} of policy version {group.oldest_version} "
                                         f"is {lag} versions behind, over max_staleness {self.max_staleness}")
        self._stale.append((group, lag))
        if group.slot is not None:  # a group that filled no slot holds no place
            self.free(1)

    def settle(self, groups: list[RolloutGroup], version: int) -> list[RolloutGroup]:
        """Every rank (a collective with several): this step's batch, ``groups``, less
        replays another rank took; then the step's slots in the ledger, the groups dropped
        as stale since the last step first, decided alike on every rank
        (``SlotLedger.consume_across_ranks``). The groups to train at ``version``. A group
        for a slot already consumed, on any rank, is dropped and counted: it held no place
        in the generators' budget, so the one it used is taken back (``slots_taken_back``)."""
        arrived = [g.slot for g in groups]
        if self.world > 1:
            groups = self._without_replays_across_ranks(groups)
        stale, self._stale = self._stale, []
        fresh = self.ledger.consume_across_ranks([g.slot for g, _ in stale] + [g.slot for g in groups])
        stale_fresh, batch_fresh = fresh[:len(stale)], fresh[len(stale):]
        for (group, lag), first in zip(stale, stale_fresh):
            if not first:
                self._duplicate(group)
                continue
            self.dropped += 1
            self.emit([metrics.staleness(version + 1, r.oldest_version, lag, False) for r in group.rollouts])
        kept = []
        for group, first in zip(groups, batch_fresh):
            if first:
                kept.append(group)
            else:
                self._duplicate(group)
        # A group that filled no slot holds no place in the budget.
        self.free(-slots_taken_back([f for (g, _), f in zip(stale, stale_fresh) if g.slot is not None],
                                    [f for g, f in zip(groups, batch_fresh) if g.slot is not None]))
        self.held.release([g.slot for g, _ in stale] + arrived)  # consumed: after the ledger has them
        return kept

    def _duplicate(self, group: RolloutGroup) -> None:
        log.warning("group %s fills slot %d, already consumed: dropped (a lost executor's group and its "
                    "regenerated twin)", group.group_id, group.slot)
        self.duplicates += 1

    def _without_replays_across_ranks(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        """Several trainer ranks: a group another rank trained, or has in this step's batch
        too, is a replay here (``seen_groups.taken_by_other_ranks``; every rank's batch
        ids are exchanged before each step): dropped, counted, and its place in the batch
        given back like a duplicate's."""
        mine = torch.tensor([[g.group_id.generator, g.group_id.seq] for g in groups], dtype=torch.int64)
        batches = [ids.view(-1, 2).tolist() for ids in all_gather_ids(mine.view(-1))]
        refused = taken_by_other_ranks(batches, self.rank, self._trained_elsewhere)
        for gid in refused:
            self.rejections(REPLAY, f"group {gid} was also taken by another trainer rank")
            self.free(-1)  # a place in this rank's batch, and no counted slot: as a duplicate's
        return [g for g in groups if (g.group_id.generator, g.group_id.seq) not in refused]

    def free(self, n: int) -> None:
        """This rank's net count of places given back, a signed record the generators add
        to their bound (``SlotBudget.dropped``): +1 for a counted group dropped untrained
        (stale), -1 for each second copy of a slot (a duplicate, a replay another rank
        trained). May go below zero. Called from the pipeline's thread and the loop."""
        if not n:
            return
        with self._freed_lock:
            self.freed += n
            self.signed.put(names.dropped_key(names.member("trainer", self.rank)), self.freed)
