"""The weight plane's process group: the trainer broadcasts new policy weights straight to
every generator.

This is the DDMA idea of LlamaRL (docs/architecture.md, "Planes"): no files and no parameter
server, just collectives in a process group of its own:

- rank 0 is a trainer rank, ranks 1..G the generators. With one trainer rank that rank
  sends the full weights; with N (FSDP2) there is one such group per trainer rank, and
  each rank broadcasts its own shard in its own group (no gather on trainer rank 0):
  every generator is in all N groups and receives the N shards at once, each landing
  in place in its staging (``llamarl.app.weights.shards``);
- each group rendezvouses over ``PrefixStore("weights/...", control_store)`` and is built
  from the backend class directly, so it lives beside the trainer's torchrun default
  group without touching it: NCCL when every member is on a GPU of its own, gloo
  otherwise (``llamarl.app.devices.weight_plane_backend``; the trainer ranks count as one member,
  ``devices.joint_key``, so all their groups choose alike); on gloo, weights that live on
  a GPU are staged through host memory (a trainer and a generator sharing one GPU, a CPU
  generator).

This module owns the group (``init_weight_group``, ``WeightGroup``), the layout handshake
and the sync announcements; ``llamarl.app.weights.sender`` and
``llamarl.app.weights.receiver`` are its two ends. The parameter layout
(``llamarl.app.weights.layout``: names, shapes, dtypes, runs, buckets, and each trainer rank's
part of every parameter) is fixed when the sender and receivers are built, and checked once
across all ranks then (``handshake``: JSON documents in the store, each a signed record of
its rank's member; a generator rebuilds each sender's buckets from its document), so a sync
carries no per-tensor metadata: one small int64 header (``HEADER_LEN``: version, layout
fingerprint, which runs go whole) followed by the runs' bytes.

Each sync is announced by setting a per-sync key in the store before the first
collective (``announce``), so a receiver waits for the next sync by polling that key
(woken within milliseconds, interruptible, idle otherwise) instead of sitting inside a
collective it cannot leave. The announcement, the layout documents and each rank's
presence are signed records (``llamarl.app.control.signed``) of the member at that rank
(``init_weight_group``'s ``members``): a value someone else wrote there is ignored and
counted, never a reason to start a sync, to fail a layout check or to choose a backend.
The backend's own rendezvous keys in the same prefix store cannot be signed
(``llamarl.app.weights.epochs``).
"""

from __future__ import annotations

import datetime
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from llamarl.app import devices
from llamarl.app import names
from llamarl.app.control.signed import SignedStore, Writers
from llamarl.app.control.transport import Backoff, Stopped
from llamarl.app.weights.layout import Layout, Span, first_difference
from llamarl.app.weights.shards import Shards

__all__ = ["SyncStats", "WeightGroup", "WeightLayoutError", "WeightSyncError", "init_weight_group", "stop_thread"]


HEADER_LEN = 3  # version, layout fingerprint, bitmask of the runs sent whole
# Sync announcements the sender keeps re-publishing if overwritten (``announce``).
KEEP_ANNOUNCED = 4


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out: a peer is gone or too slow."""


class WeightLayoutError(WeightSyncError):
    """Trainer and generator disagree on the parameters (names, shapes, dtypes, buckets)."""


@dataclass
class SyncStats:
    """One sync as one rank saw it: what its ``weight_sync`` event records (``bytes``: this
    rank's part, ``seconds``: its send or receive) and, on a trainer rank that signs a
    digest (``llamarl.app.weights.publisher``), the seconds its hash took and those it waited
    for the hash after the send."""

    version: int
    bytes: int
    seconds: float
    hashed_s: float | None = None
    digest_wait_s: float | None = None


# --------------------------------------------------------------------------- the group


@dataclass
class WeightGroup:
    """The weight-plane process group: rank 0 sends, ranks 1..world_size-1 receive."""

    backend: dist.Backend
    store: dist.Store
    """The group's own prefix store (the backend's rendezvous, announcements and the
    layout handshake live here)."""
    rank: int
    world_size: int
    device: torch.device
    """Where the collectives run: the members' GPU on NCCL, the CPU on gloo."""
    timeout_s: float
    path: devices.WeightPlanePath = devices.WeightPlanePath("gloo", False, "every member on the CPU")
    """How the members talk, and why (chosen from every member's device at the rendezvous)."""
    syncs: int = 0
    """Syncs this rank has taken part in; the sender's announcement keys run ahead of it."""
    handshakes: int = 0
    """Senders/receivers built on this rank so far: keys each layout handshake apart."""
    signed: SignedStore | None = None
    """Signed records over ``store``: this rank's presence, layout document and sync
    announcements are records of its member id, and it reads its peers' as such."""
    members: tuple[str, ...] | None = None
    """The member id (``role/replica``) of each rank, whose records its keys must be;
    ``None``: any member of the app."""

    def writers(self, rank: int) -> Writers:
        """Who may write rank ``rank``'s keys of this group."""
        return None if self.members is None else (self.members[rank],)

    def forget_keys(self) -> None:
        """Neither re-publish nor remember this group's records any more (a newer group
        replaced it): what the heartbeat checks, and memory, stay bounded across epochs."""
        if self.signed is None:
            return
        ranks = range(self.world_size)
        keys = [names.weight_rank_present_key(r) for r in ranks]
        keys += [names.weight_layout_key(h, r) for h in range(1, self.handshakes + 1) for r in ranks]
        recent = range(max(1, self.syncs - KEEP_ANNOUNCED), self.syncs + 2)  # those still kept or read
        keys += [names.weight_sync_announce_key(n) for n in recent]
        for key in keys:
            self.signed.forget(key)

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.backend.broadcast([tensor], opts)

    abandoned: threading.Event | None = None
    """Set by the owner to give up on this group (``llamarl.app.weights.subscriber``: a newer epoch):
    a wait then fails within milliseconds instead of at the timeout. The collective
    itself runs on until the timeout, so whoever sets it keeps the group and the
    tensors it writes alive until then."""

    def wait(self, work: dist.Work) -> None:
        if self.abandoned is None:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        first_done([(self, work)])
        work.wait()  # raises the collective's own error, if it failed

    def synchronize(self) -> None:
        """Wait for the device: NCCL's ``wait`` only orders the current stream after it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def first_done(works: Sequence[tuple[WeightGroup, dist.Work]]) -> int:
    """The index of the first of ``works`` that is completed (or failed), polled: within
    the longest of their groups' timeouts, ``WeightSyncError`` as soon as one of their
    groups is abandoned."""
    deadline = time.monotonic() + max(g.timeout_s for g, _ in works)
    backoff = Backoff(first_s=0.0001, max_s=0.005)
    while True:
        for i, (g, work) in enumerate(works):
            if work.is_completed():
                return i
            if g.abandoned is not None and g.abandoned.is_set():
                raise WeightSyncError("this weight group was given up for a newer one")
        if time.monotonic() > deadline:
            raise WeightSyncError(f"a collective of the weight group timed out after "
                                  f"{max(g.timeout_s for g, _ in works):g} s")
        time.sleep(backoff.next())


def wait_first(works: Sequence[tuple[WeightGroup, dist.Work]]) -> int:
    """Wait for one of ``works`` (each with its group): the index of the first that is
    done, its error raised if it failed (``WeightGroup.wait``'s deadline and abandonment)."""
    i = 0 if len(works) == 1 else first_done(works)
    works[i][0].wait(works[i][1])
    return i


def whole_cuts(run: Span, bucket_bytes: int) -> list[tuple[int, int]]:
    """The element ranges ``[start, stop)`` of a run sent whole, one broadcast each: one
    bucket's bytes at most, so a receiver has bytes to work on (hash) while the rest of
    the run is on the wire; still no copy, and a handful of broadcasts for a large model."""
    step = max(1, bucket_bytes // run.dtype.itemsize)
    return [(at, min(at + step, run.numel)) for at in range(0, run.numel, step)]


def host_or_device(group: WeightGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer for the group's collectives, on the group's device; in page-locked host
    memory when GPU weights are staged through the host (their copies to and from the
    GPU then run at the bus's speed)."""
    pin = group.path.staged and torch.cuda.is_available()
    return torch.empty(numel, dtype=dtype, device=group.device, pin_memory=pin)


def init_weight_group(signed: SignedStore, rank: int, world_size: int, device: torch.device,
                      timeout_s: float = 300.0, prefix: str = names.WEIGHT_PLANE_PREFIX,
                      should_stop: Callable[[], bool] | None = None,
                      device_key: str | None = None, members: Sequence[str] | None = None) -> WeightGroup:
    """Join the weight group (collective over all ``world_size`` ranks).

    ``signed``: the control store as this process's member (``llamarl.app.control.signed``); the group
    lives under ``prefix`` in it. ``members``: each rank's member id, the only writer of
    its keys (``None``: any member of the app). A value at a rank's key that is not its
    record is ignored, counted and waited past (``llamarl.app.control.signed``); this rank's own records
    are re-published if overwritten (``SignedStore.reassert``, on each heartbeat).

    ``device`` is where this rank's weights live. Every rank publishes its
    ``devices.device_key`` (``device_key`` overrides it: a test on the CPU stands in for
    ranks that share a GPU) and all choose the same backend from the list: NCCL when
    every rank is on a GPU of its own, else gloo (staging GPU weights through host
    memory). ``timeout_s`` bounds the rendezvous and every collective; a peer that
    disappears surfaces as ``WeightSyncError``. The ranks first wait for each other in a
    poll that watches ``should_stop`` (``Stopped`` once it is true): the backend's own
    rendezvous cannot be interrupted.
    """
    if not 0 <= rank < world_size or world_size < 2:
        raise ValueError(f"weight group needs 0 <= rank < world_size and world_size >= 2, "
                         f"got rank {rank} of {world_size}")
    if members is not None and (len(members) != world_size or members[rank] != signed.writer):
        raise ValueError(f"weight group: rank {rank} is {signed.writer}, not "
                         f"{members[rank] if rank < len(members) else '-'} of members {list(members)}")
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # Its own connection: announcement polling never queues behind other threads' store
    # calls, and the rendezvous waits run under this group's timeout.
    group_signed = signed.clone(timeout).prefixed(prefix)
    prefix_store = group_signed.store
    members = tuple(members) if members is not None else None
    keys = _wait_for_ranks(group_signed, rank, world_size, timeout_s, should_stop,
                           device_key or devices.device_key(device), members)
    path = devices.weight_plane_backend(keys)
    if path.backend == "gloo":
        device = devices.HOST
    try:
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            torch.cuda.set_device(device)
            backend = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
        elif device.type == "cpu":
            backend = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        else:
            raise ValueError(f"weight sync supports cpu (gloo) and cuda (NCCL), not {device}")
    except (dist.DistError, RuntimeError) as e:
        raise WeightSyncError(f"weight group: rank {rank} of {world_size} could not connect to "
                              f"its peers within {timeout_s:g} s: {e}") from None
    return WeightGroup(backend=backend, store=prefix_store, rank=rank, world_size=world_size,
                       device=device, timeout_s=timeout_s, path=path, signed=group_signed, members=members)


def _wait_for_ranks(signed: SignedStore, rank: int, world_size: int, timeout_s: float,
                    should_stop: Callable[[], bool] | None, device_key: str,
                    members: tuple[str, ...] | None) -> list[str]:
    """Every rank says it is here, with its device key (a record of its own), then waits
    until every rank's record is there: ``WeightSyncError`` naming the missing ranks after
    ``timeout_s``, ``Stopped`` as soon as ``should_stop()``. Returns every rank's device
    key, in rank order."""
    signed.put(names.weight_rank_present_key(rank), device_key, keep=True)
    keys = [names.weight_rank_present_key(r) for r in range(world_size)]
    writers = [None] * world_size if members is None else [(m,) for m in members]
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=0.005, max_s=0.1)
    while (recs := signed.settled(keys, writers)) is None:
        if should_stop is not None and should_stop():
            raise Stopped("stopped while waiting for the weight group's ranks")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if signed.last(k) is None]
            raise WeightSyncError(f"weight group: rank {rank} of {world_size} waited {timeout_s:g} s "
                                  f"for ranks {missing} (rank 0 is the trainer, rank i + 1 generator i)")
        time.sleep(backoff.next())
    return [str(rec.value) for rec in recs]


def handshake(group: WeightGroup, doc: dict) -> list[dict]:
    """Every rank publishes its layout document, a record of its own; the peers' (every
    generator's on rank 0, the trainer rank's on a generator). Nothing is unpickled: JSON."""
    g = group
    g.handshakes += 1  # every rank builds its senders/receivers in the same order
    g.signed.put(names.weight_layout_key(g.handshakes, g.rank), doc, keep=True)
    peers = range(1, g.world_size) if g.rank == 0 else [0]
    keys = [names.weight_layout_key(g.handshakes, r) for r in peers]
    deadline = time.monotonic() + g.timeout_s
    while (recs := g.signed.settled(keys, [g.writers(r) for r in peers])) is None:
        if time.monotonic() > deadline:
            raise WeightSyncError(f"weight sync layout handshake: rank {g.rank} waited "
                                  f"{g.timeout_s:g} s for ranks {list(peers)} to publish theirs")
        time.sleep(0.005)
    docs = [rec.value for rec in recs]
    if not all(isinstance(doc, dict) for doc in docs):
        raise WeightLayoutError("weight sync layout handshake: a peer's layout document is not a JSON object")
    return docs


def announce(g: WeightGroup, version: int) -> None:
    """Sync ``g.syncs + 1`` starts: its announcement, a record the sender re-publishes if
    someone overwrites it while a receiver may still wait for it (``KEEP_ANNOUNCED``
    syncs back at most: a receiver takes part in every sync, so it read those long ago)."""
    g.signed.put(names.weight_sync_announce_key(g.syncs + 1), version, keep=True)
    if g.syncs + 1 > KEEP_ANNOUNCED:
        g.signed.forget(names.weight_sync_announce_key(g.syncs + 1 - KEEP_ANNOUNCED))


def check_same_model(group: WeightGroup, mine: list, theirs: list, peer: int) -> None:
    """Both sides hold the same parameters (names, full shapes, dtypes, in order)."""
    if mine != theirs:
        who = "trainer (rank 0)" if peer == 0 else f"generator rank {peer}"
        raise WeightLayoutError(
            f"weight layout mismatch between this rank ({group.rank}) and the {who}: "
            f"{first_difference(mine, theirs)}; both sides must build the same model "
            f"(names, shapes, dtypes)")


@contextmanager
def sync_failures(g: WeightGroup, what: Callable[[], str], gone: str) -> Iterator[None]:
    """Turns a collective that fails inside it into a ``WeightSyncError`` saying which sync
    (``what()``, read at the failure: a receiver learns the version inside), how long it ran
    against the group's timeout, and who is likely gone (``gone``): one message for both
    ends of a sync. A layout mismatch passes through as it is, its message being the cause."""
    t0 = time.perf_counter()
    try:
        yield
    except WeightLayoutError:
        raise
    except (dist.DistError, RuntimeError) as e:
        raise WeightSyncError(f"{what()} failed after {time.perf_counter() - t0:.1f} s (group timeout "
                              f"{g.timeout_s:g} s): {gone}. Cause: {e}") from None


def full_entries(layout: Layout, shards: Shards) -> list:
    """``layout.entries`` with each parameter's full shape (a sender's layout holds its parts)."""
    return [[name, list(shape), dtype] for (name, _, dtype), shape in zip(layout.entries, shards.full_shapes)]



def stop_thread(thread: threading.Thread | None, stop: threading.Event, timeout_s: float,
                what: str) -> None:
    """Set ``stop`` and join ``thread`` (a receiver's, which stops between syncs);
    ``WeightSyncError`` if it is still in a sync after ``timeout_s``. Returns ``None``,
    for the caller's thread attribute."""
    if thread is None:
        return None
    stop.set()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"{what} did not stop within {timeout_s:g} s "
                              "(stuck in a sync; it ends at the group timeout)")
    return None
