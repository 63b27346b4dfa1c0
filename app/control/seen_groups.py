"""Which rollout groups (and metrics batches) a reader has taken: a second copy is a replay.

A group's id is ``(generator replica, seq)`` (``llamarl.app.rl.contract.GroupId``), inside the frame's
HMAC, so nobody without the app's secret can make a new id: a captured frame pushed again
carries the same id, and the reader refuses it (counted as ``replay``). The id stays
unique when a generator restarts: each generator process draws an *incarnation* and
starts its sequence at ``(incarnation - 1) << INCARNATION_SHIFT`` (``first_seq``), so a
restarted replica never reuses the ids of its earlier process (``llamarl.app.control.incarnations``).

``SeenIds`` is the set, keyed by the source of the ids (a generator replica; for the
metrics batches every role sends, the role and a random stream per process). Memory is
bounded: per source process (source, ``seq >> INCARNATION_SHIFT``), the ids at most
``window`` below the newest one seen are remembered exactly; an older id counts as seen.
Groups of one generator process reach a reader in nearly the order they were made (one
FIFO queue; reordered only by the reward executors' batches of 16, the trainer's
lookahead of 64 and its ranks), so a genuine group ``window`` behind its generator's
newest is no longer trainable anyway (far past any staleness bound). 4096 ids are a few
hundred KiB per generator process.

Not the slot ledger's job and not replaced by it (``llamarl.app.control.slots.SlotLedger``): the
ledger records *slots* (prompts) consumed, and a regenerated lost slot is a new group
with a new id filling a slot another group may already have filled (a duplicate, counted
under ``faults/duplicate_groups``, not a replay). A replay refused here never reaches
the ledger: it takes no place in a batch and frees no slot.

Across a resume the sets start empty and are not in the checkpoint; they need not be.
Without more, a frame captured before the resume *would* be trained: the ledger refuses
it only for a slot consumed before the checkpoint, and the old run's later frames (slots
past the checkpoint, versions the resumed run reaches again) would fill slots of the new
attempt, each once; and one with a high sequence number would lift its process's floor
above the new process's genuine ids, which would then all be refused (the run would
stall). Persisting the sets would not stop either: the old run went on after its last
checkpoint. What stops both is ``Admission``'s ``known_process``
(``llamarl.app.control.incarnations.Incarnations``): a group is only taken from a generator process
registered under the reader's own attempt, and every attempt draws a new token; a frame
from before the resume names a process of another attempt and is refused as a ``replay``
before it is remembered (``tests/test_seen_groups.py``).

``Admission`` is what a reader asks of each valid group: not a replay, and not from a
policy version the trainer has not published yet (a generator only has weights the
trainer sent, so ``version > trainer version`` never comes from the app; trained, it
would have a negative staleness). A group too *old* is not refused here: only the app's
roles can sign a frame, so an old version is usually ordinary staleness (or a replay,
refused above); the trainer's staleness filter drops it, frees its slot and counts it
(``dropped_stale``, and ``TOO_OLD`` under ``security/rejected_frames/``, outside the
flood count).

Pure: no store, no torch.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

__all__ = ["FUTURE_VERSION", "TOO_OLD", "INCARNATION_SHIFT", "REPLAY", "SEEN_WINDOW", "Admission", "SeenIds",
           "all_gather_ids", "first_seq", "incarnation_of", "taken_by_other_ranks"]

# Why a valid group was refused (counted under ``names.REJECTED_PREFIX`` with the others).
REPLAY, FUTURE_VERSION, TOO_OLD = "replay", "future_version", "too_old"

INCARNATION_SHIFT = 32
"""A generator process numbers its groups from ``(incarnation - 1) << 32``: 4 billion
groups per process before two could collide, far beyond any run."""
SEEN_WINDOW = 4096
"""Ids remembered per generator process below its newest (module docstring)."""


def first_seq(incarnation: int) -> int:
    """The first sequence number of a generator process of ``incarnation`` (1-based;
    ``llamarl.app.control.incarnations.draw``): ``incarnation_of`` it gives ``incarnation`` back."""
    if incarnation < 1:
        raise ValueError(f"incarnations count from 1, got {incarnation}")
    return (incarnation - 1) << INCARNATION_SHIFT


class _Window:
    """The seqs seen of one generator process: all below ``floor``, and ``above``."""

    def __init__(self) -> None:
        self.floor = 0
        self.above: set[int] = set()
        self._heap: list[int] = []  # the same seqs as ``above``, for the smallest first
        self.newest = -1

    def add(self, seq: int, window: int) -> bool:
        if seq < self.floor or seq in self.above:
            return False
        self.above.add(seq)
        heapq.heappush(self._heap, seq)
        self.newest = max(self.newest, seq)
        self.floor = max(self.floor, self.newest - window)
        while self._heap and self._heap[0] <= self.floor:
            low = heapq.heappop(self._heap)
            self.above.discard(low)
            if low == self.floor:  # a run of consecutive seqs folds into the floor
                self.floor += 1
        return True


class SeenIds:
    """The ids one reader has taken; ``add`` says whether an id is new."""

    def __init__(self, window: int = SEEN_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"the seen-id window must be >= 1, got {window}")
        self.window = window
        self._by_process: dict[tuple[Hashable, int], _Window] = {}

    def add(self, source: Hashable, seq: int) -> bool:
        """True the first time ``(source, seq)`` is offered; False for a second copy,
        or for an id more than ``window`` below the newest of its source process."""
        key = (source, seq >> INCARNATION_SHIFT)
        window = self._by_process.get(key)
        if window is None:
            window = self._by_process[key] = _Window()
        return window.add(seq, self.window)

    def __contains__(self, source_seq: tuple[Hashable, int]) -> bool:
        """Whether ``(source, seq)`` counts as seen, without adding it."""
        source, seq = source_seq
        window = self._by_process.get((source, seq >> INCARNATION_SHIFT))
        return window is not None and (seq < window.floor or seq in window.above)

    def remembered(self) -> int:
        """How many ids are held above the floors (for tests: memory stays bounded)."""
        return sum(len(w.above) for w in self._by_process.values())


def incarnation_of(seq: int) -> int:
    """The incarnation of the generator process that numbered a group ``seq``."""
    return (seq >> INCARNATION_SHIFT) + 1


class Admission:
    """``admit(group)`` for ``Rejections.decode``: refuses a group whose id this reader
    has taken already (``REPLAY``), one from a generator process ``known_process(generator,
    incarnation)`` does not know (``REPLAY`` too: a frame of another run attempt), and one
    from a version the trainer has not published yet (``FUTURE_VERSION``). ``current_version`` is this process's own count (a trainer
    rank's), asked first; ``published_version`` reads the control store, asked only for
    a version above every one seen published so far (once per new version, not per
    group): a trainer rank other than replica 0 may count its step a moment after
    replica 0 sent it, and a reward executor has no count of its own. Neither given: no
    version check. A refused group is not remembered: only groups taken are."""

    def __init__(self, current_version: Callable[[], int] | None = None,
                 published_version: Callable[[], int] | None = None,
                 seen: SeenIds | None = None,
                 known_process: Callable[[int, int], bool] | None = None) -> None:
        self.current_version, self.published_version = current_version, published_version
        self.known_process = known_process
        self.seen = seen or SeenIds()
        self._published = -1  # the newest version seen published (versions only grow)

    def _from_the_future(self, version: int) -> int | None:
        """The newest version known published when ``version`` is above it, else None."""
        now = self.current_version() if self.current_version is not None else -1
        if version <= max(now, self._published):
            return None
        if self.published_version is not None:
            self._published = max(self._published, self.published_version())
        now = max(now, self._published)
        return now if version > now else None

    def __call__(self, group: Any) -> tuple[str, str] | None:
        gid = group.group_id
        if self.current_version is not None or self.published_version is not None:
            if (now := self._from_the_future(group.version)) is not None:
                return FUTURE_VERSION, (f"group {tuple(gid)} claims policy version {group.version}; "
                                        f"the trainer has published {now}")
        known = self.known_process
        if known is not None and not known(gid.generator, incarnation_of(gid.seq)):
            return REPLAY, (f"group {tuple(gid)} comes from a generator process this run attempt never "
                            "started (a frame captured before a resume)")
        if not self.seen.add(gid.generator, gid.seq):
            return REPLAY, f"group {tuple(gid)} was taken already (a second copy of its frame)"
        return None


def taken_by_other_ranks(batches: list[list[tuple[int, int]]], rank: int,
                         trained_elsewhere: SeenIds) -> set[tuple[int, int]]:
    """Several trainer ranks pop one queue, each refusing the copies it sees twice; a copy
    that reached another rank is found by exchanging every rank's batch ids before each
    step (``batches``, by rank). Of this ``rank``'s batch: the ids another rank trained at
    an earlier step (``trained_elsewhere``) or has in this step's batch too, when that
    rank is lower (it keeps the group). The other ranks' ids are then recorded in
    ``trained_elsewhere``."""
    earlier_ranks = {tuple(i) for r in range(rank) for i in batches[r]}
    refused = {gid for gid in map(tuple, batches[rank]) if gid in trained_elsewhere or gid in earlier_ranks}
    for r, batch in enumerate(batches):
        if r != rank:
            for generator, seq in batch:
                trained_elsewhere.add(generator, seq)
    return refused  # type: ignore[return-value]


def all_gather_ids(ids: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-d int64 ``ids`` (of any length), by rank: a collective over the
    default group. Ids travel as tensors, never pickled."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(ids)]))
    longest = int(max(s.item() for s in sizes))
    parts = [torch.zeros(longest, dtype=torch.int64) for _ in sizes]
    dist.all_gather(parts, torch.cat([ids, torch.zeros(longest - len(ids), dtype=torch.int64)]))
    return [p[:int(n.item())] for p, n in zip(parts, sizes)]
