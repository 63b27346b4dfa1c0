"""The weight plane: the trainer broadcasts new policy weights straight to every generator.

This is the DDMA idea of LlamaRL (docs/architecture.md, "Planes"): no files and no parameter
server, just collectives in a process group of its own:

- rank 0 is the trainer rank that holds the full weights, ranks 1..G the generators;
- it rendezvouses over ``PrefixStore("weights", control_store)`` and is built from the
  backend class directly, so it lives beside the trainer's torchrun default group
  without touching it: NCCL when every member is on a GPU of its own, gloo otherwise
  (``app.devices.weight_plane_backend``); on gloo, weights that live on a GPU are staged
  through host memory (a trainer and a generator sharing one GPU, a CPU generator).

The parameter layout (``app.weight_layout``: names, shapes, dtypes, runs, buckets) is
fixed when the sender and receivers are built, and checked once across all ranks then,
so a sync carries no per-tensor metadata: one small int64 header (version, layout
fingerprint, which runs go whole) followed by the runs' bytes. A run that is one slice
of a ``flatten_parameters_`` buffer goes out as one broadcast with no copy (what the
trainer does); any other run goes bucket by bucket, packing those that are not one
contiguous tensor into two reused buffers, so parameters that are not one flat buffer
(a trainer rank's shards) sync too.

Each sync is announced by setting a per-sync key in the store before the first
collective, so a receiver waits for the next sync by polling that key (woken within
milliseconds, interruptible, idle otherwise) instead of sitting inside a collective it
cannot leave. A generator receives on a background thread into one staging buffer per
run; ``swap_if_newer`` copies a complete version into the live model between decode
batches, so a generator busy decoding never holds up the trainer.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from app import devices, names
from app.transport import Backoff, Stopped
from app.weight_layout import (  # flatten_parameters_: part of this plane's API
    DEFAULT_BUCKET_MB,
    Layout,
    first_difference,
    flatten_parameters_,
    pack,
    span_view,
)

__all__ = ["DEFAULT_BUCKET_MB", "SyncStats", "WeightGroup", "WeightLayoutError", "WeightReceiver",
           "WeightSender", "WeightSyncError", "flatten_parameters_", "init_weight_group"]


_HEADER_LEN = 3  # version, layout fingerprint, bitmask of the runs sent whole
_RING = 2  # packing buffers: one bucket is packed while the one before it is on the wire
# A receiver waiting for the next announcement polls the store at most this far apart:
# the most a sync can start late. (A blocking ``store.wait`` with a short timeout would
# react sooner but c10d logs two warnings for every wait that times out: 40 lines a
# second per idle generator.)
_POLL_MAX_S = 0.005


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out: a peer is gone or too slow."""


class WeightLayoutError(WeightSyncError):
    """Trainer and generator disagree on the parameters (names, shapes, dtypes, buckets)."""


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
    """The group's own prefix store (announcements and the layout handshake live here)."""
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

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.backend.broadcast([tensor], opts)

    abandoned: threading.Event | None = None
    """Set by the owner to give up on this group (``app.weight_plane``: a newer epoch):
    a wait then fails within milliseconds instead of at the timeout. The collective
    itself runs on until the timeout, so whoever sets it keeps the group and the
    tensors it writes alive until then."""

    def wait(self, work: dist.Work) -> None:
        if self.abandoned is None:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff(first_s=0.0001, max_s=0.005)
        while not work.is_completed():
            if self.abandoned.is_set():
                raise WeightSyncError("this weight group was given up for a newer one")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"a collective of the weight group timed out after {self.timeout_s:g} s")
            time.sleep(backoff.next())
        work.wait()  # raises the collective's own error, if it failed

    def synchronize(self) -> None:
        """Wait for the device: NCCL's ``wait`` only orders the current stream after it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _host_or_device(group: WeightGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer for the group's collectives, on the group's device; in page-locked host
    memory when GPU weights are staged through the host (their copies to and from the
    GPU then run at the bus's speed)."""
    pin = group.path.staged and torch.cuda.is_available()
    return torch.empty(numel, dtype=dtype, device=group.device, pin_memory=pin)


def init_weight_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
                      timeout_s: float = 300.0, prefix: str = names.WEIGHT_PLANE_PREFIX,
                      should_stop: Callable[[], bool] | None = None,
                      device_key: str | None = None) -> WeightGroup:
    """Join the weight group (collective over all ``world_size`` ranks).

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
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if isinstance(store, dist.TCPStore):
        # Its own connection: announcement polling never queues behind other threads'
        # store calls, and the rendezvous waits run under this group's timeout.
        store = store.clone()
        store.set_timeout(timeout)
    prefix_store = dist.PrefixStore(prefix, store)
    keys = _wait_for_ranks(prefix_store, rank, world_size, timeout_s, should_stop,
                           device_key or devices.device_key(device))
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
                       device=device, timeout_s=timeout_s, path=path)


def _wait_for_ranks(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                    should_stop: Callable[[], bool] | None, device_key: str) -> list[str]:
    """Every rank says it is here, with its device key, then waits until all are:
    ``WeightSyncError`` naming the missing ranks after ``timeout_s``, ``Stopped`` as soon
    as ``should_stop()``. Returns every rank's device key, in rank order."""
    store.set(names.weight_rank_present_key(rank), device_key)
    keys = [names.weight_rank_present_key(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=0.005, max_s=0.1)
    while not store.check(keys):
        if should_stop is not None and should_stop():
            raise Stopped("stopped while waiting for the weight group's ranks")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise WeightSyncError(f"weight group: rank {rank} of {world_size} waited {timeout_s:g} s "
                                  f"for ranks {missing} (rank 0 is the trainer, rank i + 1 generator i)")
        time.sleep(backoff.next())
    return [v.decode() for v in store.multi_get(keys)]


def _handshake(group: WeightGroup, layout: Layout) -> None:
    """Every rank publishes its layout; mismatches fail on every rank with the same story."""
    g = group
    g.handshakes += 1  # every rank builds its senders/receivers in the same order
    g.store.set(names.weight_layout_key(g.handshakes, g.rank), layout.describe())
    peers = range(1, g.world_size) if g.rank == 0 else [0]
    keys = [names.weight_layout_key(g.handshakes, r) for r in peers]
    deadline = time.monotonic() + g.timeout_s
    while not g.store.check(keys):
        if time.monotonic() > deadline:
            raise WeightSyncError(f"weight sync layout handshake: rank {g.rank} waited "
                                  f"{g.timeout_s:g} s for ranks {list(peers)} to publish theirs")
        time.sleep(0.005)
    mine = json.loads(layout.describe())
    for r, raw in zip(peers, g.store.multi_get(keys)):
        theirs = json.loads(raw)
        if theirs["fingerprint"] != mine["fingerprint"]:
            who = "trainer (rank 0)" if r == 0 else f"generator rank {r}"
            raise WeightLayoutError(
                f"weight layout mismatch between this rank ({g.rank}) and the {who}: "
                f"{first_difference(mine, theirs)}; both sides must build the same model "
                f"(names, shapes, dtypes) and the same bucket_mb")


# --------------------------------------------------------------------------- sender


class WeightSender:
    """Rank 0 of the weight group: broadcasts ``params`` (the live tensors) on ``send``.

    ``params`` are kept as given (not detached copies), so a sync always reads the tensors'
    current storage: a run is sent from its flat buffer while it is one, packed otherwise.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight sender must be rank 0 of the weight group, not {group.rank}")
        self.group = group
        self.params = list(params)
        self.layout = Layout(self.params, int(bucket_mb * 2**20))
        _handshake(group, self.layout)
        # Packing buffers, grown to the largest bucket packed so far (a flattened model
        # never packs, so they stay empty).
        self._ring = [_host_or_device(group, 0, torch.uint8) for _ in range(_RING)]
        self.zero_copy_buckets = 0
        """Buckets of the last sync that went out without packing (for tests and benchmarks)."""

    def send(self, version: int) -> SyncStats:
        """Broadcast the current values of the params as ``version``; returns its stats."""
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        try:
            g.store.set(names.weight_sync_announce_key(g.syncs + 1), str(version))
            views = [span_view(run, self.params, g.device) for run in layout.runs]
            whole = sum(1 << r for r, view in enumerate(views) if view is not None)
            header = torch.tensor([version, layout.fingerprint, whole], dtype=torch.int64,
                                  device=g.device)
            works = [g.broadcast(header)]
            ring_works: list[dist.Work | None] = [None] * _RING  # last broadcast from each buffer
            packed = zero_copy = 0
            for run, view in zip(layout.runs, views):
                if view is not None:
                    works.append(g.broadcast(view))
                    zero_copy += len(run.buckets)
                    continue
                for bucket in run.buckets:
                    # One tensor of its own (a parameter larger than a bucket) needs no packing.
                    if (flat := span_view(bucket, self.params, g.device)) is not None:
                        works.append(g.broadcast(flat))
                        zero_copy += 1
                        continue
                    k = packed % _RING
                    if ring_works[k] is not None:
                        g.wait(ring_works[k])  # that buffer is still being sent
                    ring_works[k] = g.broadcast(pack(bucket, self.params, self._buffer(k, bucket.nbytes)))
                    packed += 1
            for work in works + [w for w in ring_works if w is not None]:
                g.wait(work)
            g.synchronize()
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


class WeightReceiver:
    """A generator rank: receives each version on a background thread, applies it between
    decode batches.

    ``start_background()`` once, then ``swap_if_newer()`` between decode batches. There is
    one staging buffer per run, so a ``swap_if_newer`` that finds a receive in progress
    returns ``None`` at once and the next call picks the version up.

    ``params`` must be laid out by ``flatten_parameters_`` (as the generator's model is),
    so applying a version is one copy per run.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of the weight group is the sender, not a receiver")
        self.group = group
        self.params = list(params)  # as given: a later .data rebinding is caught at a swap
        self.layout = Layout(self.params, int(bucket_mb * 2**20))
        # The model's device; staging is on the group's (the host when weights are staged).
        self.device = self.params[0][1].device if self.params else group.device
        self._live_views()  # fail here, not at the first swap
        _handshake(group, self.layout)
        self._staging = [_host_or_device(group, run.numel, run.dtype) for run in self.layout.runs]
        self._staged_version: int | None = None
        self._applied_version: int | None = None
        self._lock = threading.Lock()  # guards _staging, _staged_version and the copy into params
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stats: list[SyncStats] = []
        self._stats_lock = threading.Lock()  # not _lock: that one is held for a whole receive

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
        """True once the next sync is announced, False when told to stop first."""
        key = names.weight_sync_announce_key(self.group.syncs + 1)
        backoff = Backoff(max_s=_POLL_MAX_S)
        while not self.group.store.check([key]):
            if self._stop.is_set() or (should_stop is not None and should_stop()):
                return False
            time.sleep(backoff.next())
        return True

    def _receive(self) -> SyncStats:
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        version: int | str = "?"
        try:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=g.device)
            g.wait(g.broadcast(header))
            version, fingerprint, whole = header.tolist()
            if fingerprint != layout.fingerprint:
                raise WeightLayoutError(
                    f"weight sync of version {version}: the trainer's layout (fingerprint "
                    f"{fingerprint}) differs from this generator's ({layout.fingerprint})")
            works = []
            for r, (run, flat) in enumerate(zip(layout.runs, self._staging)):
                if whole >> r & 1:
                    works.append(g.broadcast(flat))
                else:  # bucket by bucket; the bytes land where they would have whole
                    works += [g.broadcast(flat[b.offset:b.offset + b.numel]) for b in run.buckets]
            for work in works:
                g.wait(work)
            g.synchronize()
        except WeightLayoutError:
            raise
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(
                f"weight sync of version {version}: receiving on generator rank {g.rank} failed "
                f"after {time.perf_counter() - t0:.1f} s (group timeout {g.timeout_s:g} s): the "
                f"trainer or another generator of the weight group is gone. Cause: {e}") from None
        g.syncs += 1
        return SyncStats(version=int(version), bytes=layout.nbytes, seconds=time.perf_counter() - t0)

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
                    stats = self._receive()
                    self._staged_version = stats.version
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
        """Stats of background receives since the last call (for ``app.metrics.weight_sync``)."""
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
