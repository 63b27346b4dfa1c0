"""The weight plane: the trainer broadcasts new policy weights straight to every generator.

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

The parameter layout (``llamarl.app.weights.layout``: names, shapes, dtypes, runs, buckets, and
each trainer rank's part of every parameter) is fixed when the sender and receivers are
built, and checked once across all ranks then (the layout handshake: JSON documents in
the store, each a signed record of its rank's member; a generator rebuilds each sender's
buckets from its document), so a sync carries no per-tensor metadata: one small int64
header (version, layout fingerprint, which runs go whole) followed by the runs' bytes.
A run that is one slice of a ``flatten_parameters_`` buffer goes out whole, with no copy
(what the trainer does), in slices of one bucket's bytes (``_whole_cuts``: a generator
hashes each as it lands, ``llamarl.app.weights.digest``, instead of the whole run after it); any
other run goes bucket by bucket, packing those that are not one contiguous tensor into
two reused buffers, so parameters that are not one flat buffer (a trainer rank's
shards) sync too. A generator takes each trainer rank's broadcasts in order, whichever
rank's next is in first (``_wait_first``), and works on each as it lands.

Each sync is announced by setting a per-sync key in the store before the first
collective, so a receiver waits for the next sync by polling that key (woken within
milliseconds, interruptible, idle otherwise) instead of sitting inside a collective it
cannot leave. The announcement, the layout documents and each rank's presence are signed
records (``llamarl.app.control.signed``) of the member at that rank (``init_weight_group``'s
``members``): a value someone else wrote there is ignored and counted, never a reason to
start a sync, to fail a layout check or to choose a backend. The backend's own rendezvous
keys in the same prefix store cannot be signed (``llamarl.app.weights.plane``).

A generator receives on a background thread into one staging buffer per run;
``swap_if_newer`` copies a complete version into the live model between decode
batches, so a generator busy decoding never holds up the trainer.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from llamarl.app import devices
from llamarl.app import names
from llamarl.app.control.signed import SignedStore, Writers
from llamarl.app.control.transport import Backoff, Stopped
from llamarl.app.weights.layout import (  # flatten_parameters_: part of this plane's API
    DEFAULT_BUCKET_MB,
    Layout,
    Span,
    first_difference,
    flatten_parameters_,
    pack,
    span_view,
)
from llamarl.app.weights.shards import SHARD_ALONE_BYTES, Landing, Shards, check_tiling, local_parts, meta_params

__all__ = ["DEFAULT_BUCKET_MB", "SyncStats", "Verification", "Verifier", "WeightGroup", "WeightLayoutError",
           "WeightReceiver", "WeightSender", "WeightSyncError", "flatten_parameters_", "init_weight_group"]


_HEADER_LEN = 3  # version, layout fingerprint, bitmask of the runs sent whole
_RING = 2  # packing buffers: one bucket is packed while the one before it is on the wire
# A receiver waiting for the next announcement polls the store at most this far apart:
# the most a sync can start late. (A blocking ``store.wait`` with a short timeout would
# react sooner but c10d logs two warnings for every wait that times out: 40 lines a
# second per idle generator.)
_POLL_MAX_S = 0.005
# Sync announcements the sender keeps re-publishing if overwritten (``_announce``).
_KEEP_ANNOUNCED = 4


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out: a peer is gone or too slow."""


class WeightLayoutError(WeightSyncError):
    """Trainer and generator disagree on the parameters (names, shapes, dtypes, buckets)."""


class Verification(Protocol):
    """One version being checked as it lands on a generator (``Verifier.start``)."""

    def feed(self, sender: int, run: int, pieces: list[torch.Tensor]) -> None:
        """Trainer rank ``sender``'s next bytes of run ``run``, landed in staging (views,
        in the sender's order; they stay as they are until ``taken``)."""

    def taken(self) -> bool:
        """Once every byte is fed: whether to take the version."""


class Verifier(Protocol):
    """What a generator asks about each version it receives (``llamarl.app.weights.digest.DigestCheck``)."""

    def start(self, version: int, dtypes: list[list[torch.dtype]]) -> Verification:
        """Check ``version``, whose runs from trainer rank ``r`` have ``dtypes[r]``."""


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float


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
        recent = range(max(1, self.syncs - _KEEP_ANNOUNCED), self.syncs + 2)  # those still kept or read
        keys += [names.weight_sync_announce_key(n) for n in recent]
        for key in keys:
            self.signed.forget(key)

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.backend.broadcast([tensor], opts)

    abandoned: threading.Event | None = None
    """Set by the owner to give up on this group (``llamarl.app.weights.plane``: a newer epoch):
    a wait then fails within milliseconds instead of at the timeout. The collective
    itself runs on until the timeout, so whoever sets it keeps the group and the
    tensors it writes alive until then."""

    def wait(self, work: dist.Work) -> None:
        if self.abandoned is None:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        _first_done([(self, work)])
        work.wait()  # raises the collective's own error, if it failed

    def synchronize(self) -> None:
        """Wait for the device: NCCL's ``wait`` only orders the current stream after it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _first_done(works: Sequence[tuple[WeightGroup, dist.Work]]) -> int:
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


def _wait_first(works: Sequence[tuple[WeightGroup, dist.Work]]) -> int:
    """Wait for one of ``works`` (each with its group): the index of the first that is
    done, its error raised if it failed (``WeightGroup.wait``'s deadline and abandonment)."""
    i = 0 if len(works) == 1 else _first_done(works)
    works[i][0].wait(works[i][1])
    return i


def _whole_cuts(run: Span, bucket_bytes: int) -> list[tuple[int, int]]:
    """The element ranges ``[start, stop)`` of a run sent whole, one broadcast each: one
    bucket's bytes at most, so a receiver has bytes to work on (hash) while the rest of
    the run is on the wire; still no copy, and a handful of broadcasts for a large model."""
    step = max(1, bucket_bytes // run.dtype.itemsize)
    return [(at, min(at + step, run.numel)) for at in range(0, run.numel, step)]


def _host_or_device(group: WeightGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
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


def _handshake(group: WeightGroup, doc: dict) -> list[dict]:
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


def _announce(g: WeightGroup, version: int) -> None:
    """Sync ``g.syncs + 1`` starts: its announcement, a record the sender re-publishes if
    someone overwrites it while a receiver may still wait for it (``_KEEP_ANNOUNCED``
    syncs back at most: a receiver takes part in every sync, so it read those long ago)."""
    g.signed.put(names.weight_sync_announce_key(g.syncs + 1), version, keep=True)
    if g.syncs + 1 > _KEEP_ANNOUNCED:
        g.signed.forget(names.weight_sync_announce_key(g.syncs + 1 - _KEEP_ANNOUNCED))


def _check_same_model(group: WeightGroup, mine: list, theirs: list, peer: int) -> None:
    """Both sides hold the same parameters (names, full shapes, dtypes, in order)."""
    if mine != theirs:
        who = "trainer (rank 0)" if peer == 0 else f"generator rank {peer}"
        raise WeightLayoutError(
            f"weight layout mismatch between this rank ({group.rank}) and the {who}: "
            f"{first_difference(mine, theirs)}; both sides must build the same model "
            f"(names, shapes, dtypes)")


def _full_entries(layout: Layout, shards: Shards) -> list:
    """``layout.entries`` with each parameter's full shape (a sender's layout holds its parts)."""
    return [[name, list(shape), dtype] for (name, _, dtype), shape in zip(layout.entries, shards.full_shapes)]


# --------------------------------------------------------------------------- sender


class WeightSender:
    """Rank 0 of a weight group: broadcasts this trainer rank's part of ``params`` on ``send``.

    ``params`` are kept as given (not detached copies), so a sync always reads the tensors'
    current storage: a run is sent from its flat buffer while it is one, packed otherwise.
    With ``ranks`` > 1 trainer ranks, each rank has a group of its own to every generator
    and sends only its shard (``llamarl.app.weights.shards``: FSDP2's DTensors, sharded on dim 0);
    the generators assemble the full weights. One rank sends the full tensors.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB, *, rank: int = 0, ranks: int = 1) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight sender must be rank 0 of the weight group, not {group.rank}")
        self.group = group
        self.params = list(params)
        self.rank, self.ranks = rank, ranks
        local, self.shards = local_parts(self.params, rank, ranks)
        bucket_bytes = int(bucket_mb * 2**20)
        self.layout = Layout(local, bucket_bytes,
                             alone_bytes=bucket_bytes if ranks == 1 else min(bucket_bytes, SHARD_ALONE_BYTES))
        full_entries = _full_entries(self.layout, self.shards)
        landing = Landing(self.layout, self.shards, Layout(meta_params(full_entries), bucket_bytes))
        # A run goes whole only where the generators can take it as it is (one trainer rank).
        self._whole_ok = [landing.direct(run) is not None for run in self.layout.runs]
        doc = {"fingerprint": self.layout.fingerprint, "bucket_bytes": self.layout.bucket_bytes,
               "alone_bytes": self.layout.alone_bytes, "params": self.layout.entries,
               "shards": self.shards.describe()}
        for r, theirs in enumerate(_handshake(group, doc), start=1):
            _check_same_model(group, full_entries, theirs["params"], r)
        # Packing buffers, grown to the largest bucket packed so far (a flattened model
        # never packs, so they stay empty).
        self._ring = [_host_or_device(group, 0, torch.uint8) for _ in range(_RING)]
        self.zero_copy_buckets = 0
        """Buckets of the last sync that went out without packing (for tests and benchmarks)."""

    def _local(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's current part of each parameter (DTensors' local tensors move)."""
        local, shards = local_parts(self.params, self.rank, self.ranks)
        if shards != self.shards or [list(t.shape) for _, t in local] != [e[1] for e in self.layout.entries]:
            raise WeightLayoutError("weight sync: the trainer's parameters changed shape or sharding "
                                    "since the sender was built")
        return local

    def send(self, version: int) -> SyncStats:
        """Broadcast the current values of this rank's part as ``version``; returns its stats."""
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        try:
            params = self._local()
            _announce(g, version)
            views = [span_view(run, params, g.device) if ok else None
                     for run, ok in zip(layout.runs, self._whole_ok)]
            whole = sum(1 << r for r, view in enumerate(views) if view is not None)
            header = torch.tensor([version, layout.fingerprint, whole], dtype=torch.int64,
                                  device=g.device)
            works = [g.broadcast(header)]
            ring_works: list[dist.Work | None] = [None] * _RING  # last broadcast from each buffer
            packed = zero_copy = 0
            for run, view in zip(layout.runs, views):
                if view is not None:
                    works += [g.broadcast(view[a:b]) for a, b in _whole_cuts(run, layout.bucket_bytes)]
                    zero_copy += len(run.buckets)
                    continue
                for bucket in run.buckets:
                    if bucket.numel == 0:  # this rank holds none of these parameters
                        continue
                    # One tensor of its own (a parameter larger than a bucket) needs no packing.
                    if (flat := span_view(bucket, params, g.device)) is not None:
                        works.append(g.broadcast(flat))
                        zero_copy += 1
                        continue
                    k = packed % _RING
                    if ring_works[k] is not None:
                        g.wait(ring_works[k])  # that buffer is still being sent
                    ring_works[k] = g.broadcast(pack(bucket, params, self._buffer(k, bucket.nbytes)))
                    packed += 1
            for work in works + [w for w in ring_works if w is not None]:
                g.wait(work)
            g.synchronize()
        except WeightLayoutError:
            raise
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(
                f"weight sync of version {version} to {g.world_size - 1} generator(s) failed "
                f"after {time.perf_counter() - t0:.1f} s (group timeout {g.timeout_s:g} s): a "
                f"generator is gone or stopped receiving. The weight group is unusable now. "
                f"Cause: {e}") from None
        self.zero_copy_buckets = zero_copy
        g.syncs += 1
        return SyncStats(version=int(version), bytes=layout.nbytes,
                         seconds=time.perf_counter() - t0)

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        if self._ring[k].numel() < nbytes:
            self._ring[k] = _host_or_device(self.group, nbytes, torch.uint8)
        return self._ring[k]


# --------------------------------------------------------------------------- receiver


@dataclass
class _Landed:
    """One broadcast of a sync on a generator, and what follows once it is in."""

    group: WeightGroup
    work: dist.Work
    run: int
    pieces: list[torch.Tensor]
    """Its bytes once in, where they lie in staging (views, in the sender's order)."""
    scatters: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """``(scratch view, staging view)``: its packed parts, copied into place once it is in."""


@dataclass
class _SenderPlan:
    """What a generator receives from one trainer rank, and where it puts it."""

    group: WeightGroup
    layout: Layout
    """The trainer rank's layout (its parts of the parameters), rebuilt from its document."""
    shards: Shards
    landing: Landing

    def __post_init__(self) -> None:
        # Where each run and bucket lands, fixed with the layout: a staging offset, or a
        # place in one scratch buffer per run (the packed small parts, scattered after
        # the receive; none with one trainer rank).
        self._run_at = [self.landing.direct(run) for run in self.layout.runs]
        self._bucket_at: dict[tuple[int, int], int | None] = {}
        self._scratch_at: dict[tuple[int, int], int] = {}
        self._scratch = []
        for k, run in enumerate(self.layout.runs):
            size = 0
            for b, bucket in enumerate(run.buckets):
                self._bucket_at[(k, b)] = at = self.landing.direct(bucket)
                if bucket.numel and at is None:
                    self._scratch_at[(k, b)] = size
                    size += bucket.numel
            self._scratch.append(_host_or_device(self.group, size, run.dtype))

    def post(self, header: list[int], staging: list[torch.Tensor]) -> list[_Landed]:
        """Start receiving one sync whose header is ``header``; its broadcasts, in order."""
        g, layout = self.group, self.layout
        version, fingerprint, whole = header
        if fingerprint != layout.fingerprint:
            raise WeightLayoutError(
                f"weight sync of version {version}: trainer rank {self.shards.rank}'s layout "
                f"(fingerprint {fingerprint}) differs from the one it announced ({layout.fingerprint})")
        landed: list[_Landed] = []
        for k, (run, flat) in enumerate(zip(layout.runs, staging)):
            if whole >> k & 1:
                if (at := self._run_at[k]) is None:
                    raise WeightLayoutError(f"weight sync of version {version}: trainer rank "
                                            f"{self.shards.rank} sent a run whole that does not land whole")
                for a, b in _whole_cuts(run, layout.bucket_bytes):
                    piece = flat[at + a:at + b]
                    landed.append(_Landed(g, g.broadcast(piece), k, [piece]))
                continue
            for b, bucket in enumerate(run.buckets):
                if bucket.numel == 0:
                    continue
                if (at := self._bucket_at[(k, b)]) is not None:  # lands where it belongs as it comes
                    piece = flat[at:at + bucket.numel]
                    landed.append(_Landed(g, g.broadcast(piece), k, [piece]))
                    continue
                start = self._scratch_at[(k, b)]
                scratch = self._scratch[k][start:start + bucket.numel]
                landed.append(_Landed(g, g.broadcast(scratch), k, self.landing.received(bucket, flat), [
                    (scratch[src:src + n], flat[dst:dst + n]) for src, dst, n in self.landing.pieces(bucket)]))
        return landed


class WeightReceiver:
    """A generator rank: receives each version on a background thread, applies it between
    decode batches.

    ``groups``: one weight group per trainer rank, in trainer-rank order (a single group
    for one trainer rank). Each trainer rank's part of a version lands in the one staging
    buffer per run (``llamarl.app.weights.shards.Landing``), all ranks' parts at once.

    ``start_background()`` once, then ``swap_if_newer()`` between decode batches. There is
    one staging buffer per run, so a ``swap_if_newer`` that finds a receive in progress
    returns ``None`` at once and the next call picks the version up.

    ``params`` must be laid out by ``flatten_parameters_`` (as the generator's model is),
    so applying a version is one copy per run. The buckets are the senders' (read in the
    layout handshake); ``bucket_mb`` only cuts this side's own layout document.
    ``verify`` (``llamarl.app.weights.digest.DigestCheck``), when given, is told of each version as
    its header lands, fed each broadcast's bytes (views of staging) as it lands, sender
    by sender in order, and asked at the end whether to take it; a version it refuses is
    never applied: the model keeps the version it has.
    """

    def __init__(self, groups: WeightGroup | Iterable[WeightGroup], params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 verify: Verifier | None = None) -> None:
        self.params = list(params)  # as given: a later .data rebinding is caught at a swap
        self.layout = Layout(self.params, int(bucket_mb * 2**20))
        self.groups: list[WeightGroup] = []
        self._senders: list[_SenderPlan] = []
        # Group by group, each through its handshake before the next is asked for: a lazy
        # iterable may build the next one only then (``llamarl.app.weights.plane``).
        for rank, group in enumerate([groups] if isinstance(groups, WeightGroup) else groups):
            if group.rank == 0:
                raise ValueError("rank 0 of a weight group is its sender, not a receiver")
            self.groups.append(group)
            if rank == 0:
                self.group = group
                # The model's device; staging is on the group's (the host when weights are staged).
                self.device = self.params[0][1].device
                self._live_views()  # fail here, not at the first swap
            self._senders.append(self._sender_plan(group, rank))
        if not self.groups:
            raise ValueError("a weight receiver needs one weight group per trainer rank")
        if any(p.shards.ranks != len(self.groups) for p in self._senders):
            raise WeightLayoutError(f"weight sync: the trainer ranks say they are "
                                    f"{sorted({p.shards.ranks for p in self._senders})} ranks; "
                                    f"this generator has a weight group for each of {len(self.groups)}")
        try:
            check_tiling([(p.shards, p.layout) for p in self._senders], self.params)
        except ValueError as e:
            raise WeightLayoutError(str(e)) from None
        self._staging = [_host_or_device(self.group, run.numel, run.dtype) for run in self.layout.runs]
        self.verify = verify
        self._staged_version: int | None = None
        self._applied_version: int | None = None
        self._lock = threading.Lock()  # guards _staging, _staged_version and the copy into params
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stats: list[SyncStats] = []
        self._stats_lock = threading.Lock()  # not _lock: that one is held for a whole receive

    def _sender_plan(self, group: WeightGroup, rank: int) -> _SenderPlan:
        """Handshake with trainer rank ``rank`` over ``group``: its layout rebuilt from its
        document, checked against this model, and where each of its spans lands."""
        mine = json.loads(self.layout.describe())
        doc = _handshake(group, mine)[0]
        try:
            sent = Layout(meta_params(doc["params"]), int(doc["bucket_bytes"]), int(doc["alone_bytes"]))
            sh = doc["shards"]
            shards = Shards(rank=int(sh["rank"]), ranks=int(sh["ranks"]),
                            full_shapes=tuple(tuple(int(d) for d in s) for s in sh["full_shapes"]),
                            starts=tuple(int(x) for x in sh["starts"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLayoutError(f"weight sync: trainer rank {rank}'s layout document is not one this "
                                    f"generator reads ({type(e).__name__}: {e})") from None
        _check_same_model(group, mine["params"], _full_entries(sent, shards), 0)
        if sent.fingerprint != doc["fingerprint"] or shards.rank != rank:
            raise WeightLayoutError(f"weight sync: weight group {rank} is trainer rank {shards.rank}'s "
                                    f"(fingerprint {doc['fingerprint']}, rebuilt {sent.fingerprint}); "
                                    f"this generator expected trainer rank {rank}'s")
        return _SenderPlan(group, sent, shards, Landing(sent, shards, self.layout))

    def _live_views(self) -> list[torch.Tensor]:
        views = [span_view(run, self.params, self.device) for run in self.layout.runs]
        for run, view in zip(self.layout.runs, views):
            if view is None:
                raise ValueError(f"weight receiver: the {run.dtype} parameters are not one flat "
                                 f"buffer on {self.device}: call flatten_parameters_ on the "
                                 "model before building the receiver, and do not rebind their .data")
        return views

    # -- receiving -----------------------------------------------------------------------
    def _wait_announced(self, should_stop: Callable[[], bool] | None) -> bool:
        """True once every trainer rank announced the next sync, False when told to stop first."""
        pending = list(self.groups)
        backoff = Backoff(max_s=_POLL_MAX_S)
        while pending:
            pending = [g for g in pending if g.signed.settled([names.weight_sync_announce_key(g.syncs + 1)],
                                                              [g.writers(0)]) is None]
            if not pending:
                break
            if self._stop.is_set() or (should_stop is not None and should_stop()):
                return False
            time.sleep(backoff.next())
        return True

    def _receive(self) -> tuple[SyncStats, Verification | None]:
        t0 = time.perf_counter()
        version: int | str = "?"
        g = self.group
        try:
            headers = [torch.zeros(_HEADER_LEN, dtype=torch.int64, device=g.device) for _ in self.groups]
            for group, work in [(group, group.broadcast(h)) for group, h in zip(self.groups, headers)]:
                group.wait(work)
            versions = {h[0].item() for h in headers}
            version = headers[0][0].item()
            if len(versions) > 1:
                raise WeightSyncError(f"weight sync: the trainer ranks sent versions {sorted(versions)} "
                                      "in one sync")
            verification = None if self.verify is None else self.verify.start(
                int(version), [[run.dtype for run in plan.layout.runs] for plan in self._senders])
            self._land([plan.post(header.tolist(), self._staging) for plan, header in zip(self._senders, headers)],
                       verification)
            for group in self.groups:
                group.synchronize()
        except WeightLayoutError:
            raise
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(
                f"weight sync of version {version}: receiving on generator rank {g.rank} failed "
                f"after {time.perf_counter() - t0:.1f} s (group timeout {g.timeout_s:g} s): a "
                f"trainer rank or another generator of the weight group is gone. Cause: {e}") from None
        for group in self.groups:
            group.syncs += 1
            group.signed.forget(names.weight_sync_announce_key(group.syncs))  # read once
        return SyncStats(version=int(version), bytes=self.layout.nbytes,
                         seconds=time.perf_counter() - t0), verification

    def _land(self, broadcasts: list[list[_Landed]], verification: Verification | None) -> None:
        """Wait for every sender's ``broadcasts``, each sender's in order, taking whichever
        sender's next is in first: its packed parts are copied into place and, with a
        ``verification``, its bytes fed to it, so they are hashed while the rest arrives."""
        queues = [deque(b) for b in broadcasts]
        while live := [s for s, q in enumerate(queues) if q]:
            s = live[_wait_first([(queues[s][0].group, queues[s][0].work) for s in live])]
            item = queues[s].popleft()
            with torch.no_grad():
                for src, dst in item.scatters:
                    dst.copy_(src)
            if verification is not None:
                item.group.synchronize()  # on a GPU: landed before another thread reads them
                verification.feed(s, item.run, item.pieces)

    def start_background(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Receive every new version into staging on a daemon thread, as soon as it is sent."""
        if self._thread is not None:
            raise RuntimeError("the background weight receiver is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(should_stop,),
                                        name=f"weight-receiver-{self.group.rank}", daemon=True)
        self._thread.start()

    def _loop(self, should_stop: Callable[[], bool] | None) -> None:
        self.receive_until(should_stop)

    def receive_until(self, should_stop: Callable[[], bool] | None) -> BaseException | None:
        """Receive every announced version into staging in this thread until
        ``should_stop()`` (between syncs) or a receive fails; returns that failure (also
        raised by the next ``swap_if_newer``), ``None`` when told to stop."""
        try:
            while self._wait_announced(should_stop):
                with self._lock:
                    stats, verification = self._receive()
                    # Refused: staging holds bytes not to apply, whatever it held before.
                    taken = verification is None or verification.taken()
                    self._staged_version = stats.version if taken else self._applied_version
                with self._stats_lock:
                    self._stats.append(stats)
        except BaseException as e:  # surfaced to the generator by swap_if_newer()
            self._error = e
        return self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WeightSyncError(f"background weight receiver failed: {self._error}") from self._error

    # -- between decode batches ----------------------------------------------------------
    def latest_version(self) -> int | None:
        """The newest completely received (staged) version, None before the first."""
        self._raise_if_failed()
        return self._staged_version

    def swap_if_newer(self) -> int | None:
        """Apply the staged version if it is newer than the model's.

        Returns the version now in the model, or None when nothing changed (nothing new, or
        a receive is in progress).
        """
        self._raise_if_failed()
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._staged_version is None or self._staged_version == self._applied_version:
                return None
            with torch.no_grad():
                for live, flat in zip(self._live_views(), self._staging):
                    live.copy_(flat)
            self._applied_version = self._staged_version
            return self._applied_version
        finally:
            self._lock.release()

    def pop_stats(self) -> list[SyncStats]:
        """Stats of background receives since the last call (for ``llamarl.app.metrics.events.weight_sync``)."""
        with self._stats_lock:
            out, self._stats = self._stats, []
        return out

    def stop_background(self, timeout_s: float = 10.0) -> None:
        """Stop the thread between syncs; a receive in progress is allowed to finish."""
        self._thread = stop_thread(self._thread, self._stop, timeout_s, "background weight receiver")
        self._raise_if_failed()


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
