"""The weight plane: the trainer broadcasts new policy weights straight to every generator.

This is the DDMA idea of LlamaRL (DESIGN.md, "Planes"): no files and no parameter
server, just collectives in a process group of its own:

- rank 0 is the trainer rank that holds the full weights, ranks 1..G the generators;
- it rendezvouses over ``PrefixStore("weights", control_store)`` and is built from the
  backend class directly (gloo on CPU, NCCL on CUDA), so it lives beside the trainer's
  torchrun default group without touching it.

The parameter layout (names, shapes, dtypes, bucketing) is fixed when the sender and
receivers are built, and checked once across all ranks then, so a sync carries no
per-tensor metadata: one small int64 header (version, layout fingerprint) followed by
the same-dtype parameters flattened into contiguous buckets of about ``bucket_mb``.

Each sync is announced by bumping a counter in the store before the first collective,
so a receiver waits for the next sync by polling the store (interruptible, cheap)
instead of sitting inside a collective it cannot leave. The receiver writes into
staging buffers; ``apply``/``swap_if_newer`` copy a complete version into the live
model between decode batches, so a generator busy decoding never holds up the trainer
when its receiver runs in the background thread.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from app.transport import Stopped

__all__ = [
    "SyncStats",
    "WeightGroup",
    "WeightLayoutError",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "init_weight_group",
]

_HEADER_LEN = 4  # version, layout fingerprint, number of buckets, bytes


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
    timeout_s: float
    syncs: int = 0
    """Syncs this rank has taken part in; the store's announcement counter runs ahead of it."""
    handshakes: int = 0
    """Senders/receivers built on this rank so far: keys each layout handshake apart."""

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.backend.broadcast([tensor], opts)

    def wait(self, work: dist.Work) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout_s))


def init_weight_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
                      timeout_s: float = 300.0, prefix: str = "weights") -> WeightGroup:
    """Join the weight group (collective over all ``world_size`` ranks).

    gloo for CPU ``device``, NCCL for CUDA. ``timeout_s`` bounds the rendezvous and
    every collective; a peer that disappears surfaces as ``WeightSyncError``.
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
                       device=device, timeout_s=timeout_s)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    """Element offset of this parameter inside its bucket."""
    numel: int


@dataclass(frozen=True)
class _Bucket:
    dtype: torch.dtype
    numel: int
    slots: tuple[tuple[int, _Slot], ...]
    """(index into the params list, slot) pairs."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _Layout:
    """Parameters grouped by dtype, in order, into flat buckets of about ``bucket_bytes``."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
        if not params:
            raise ValueError("weight sync needs at least one parameter")
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("weight sync parameter names must be unique")
        self.entries = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in params]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, p) in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        buckets: list[_Bucket] = []
        for dtype, indices in by_dtype.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            cap = max(1, bucket_bytes // itemsize)
            slots: list[tuple[int, _Slot]] = []
            numel = 0
            for i in indices:
                name, p = params[i]
                if slots and numel + p.numel() > cap:
                    buckets.append(_Bucket(dtype, numel, tuple(slots)))
                    slots, numel = [], 0
                slots.append((i, _Slot(name, tuple(p.shape), numel, p.numel())))
                numel += p.numel()
            if slots:
                buckets.append(_Bucket(dtype, numel, tuple(slots)))
        self.buckets = buckets
        self.nbytes = sum(b.nbytes for b in buckets)
        blob = json.dumps({"params": self.entries, "bucket_bytes": bucket_bytes}).encode()
        # 63 bits so it fits a (signed) int64 header slot.
        self.fingerprint = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1
        self.bucket_bytes = bucket_bytes

    def describe(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "bucket_bytes": self.bucket_bytes,
                           "params": self.entries})


def _first_difference(mine: dict, theirs: dict) -> str:
    if mine["bucket_bytes"] != theirs["bucket_bytes"]:
        return f"bucket_bytes {mine['bucket_bytes']} vs {theirs['bucket_bytes']}"
    a, b = mine["params"], theirs["params"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter #{i}: {x} vs {y}"
    return f"{len(a)} parameters vs {len(b)}"


def _handshake(group: WeightGroup, layout: _Layout) -> None:
    """Every rank publishes its layout; mismatches fail on every rank with the same story."""
    g = group
    g.handshakes += 1  # every rank builds its senders/receivers in the same order
    g.store.set(f"layout/{g.handshakes}/{g.rank}", layout.describe())
    peers = range(1, g.world_size) if g.rank == 0 else [0]
    keys = [f"layout/{g.handshakes}/{r}" for r in peers]
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
                f"{_first_difference(mine, theirs)}; both sides must build the same model "
                f"(names, shapes, dtypes) and the same bucket_mb")


# --------------------------------------------------------------------------- sender

_ANNOUNCE_KEY = "syncs"


class WeightSender:
    """Rank 0 of the weight group: broadcasts ``params`` (the live tensors) on ``send``."""

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = 4.0, max_inflight: int = 2) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight sender must be rank 0 of the weight group, not {group.rank}")
        self.group = group
        self.params = [(n, p.detach()) for n, p in params]
        self.layout = _Layout(self.params, int(bucket_mb * 2**20))
        self.max_inflight = max(1, max_inflight)
        _handshake(group, self.layout)
        # A small ring of bucket buffers: pack bucket i+1 while bucket i is on the wire.
        ring_bytes = max(b.nbytes for b in self.layout.buckets)
        self._ring = [torch.empty(ring_bytes, dtype=torch.uint8, device=group.device)
                      for _ in range(min(self.max_inflight, len(self.layout.buckets)))]

    def _pack(self, bucket: _Bucket, buf: torch.Tensor) -> torch.Tensor:
        if len(bucket.slots) == 1:
            i, _ = bucket.slots[0]
            p = self.params[i][1]
            if p.is_contiguous() and p.device == self.group.device:
                return p.reshape(-1)  # a lone contiguous tensor goes out as is: no copy
        flat = buf[:bucket.nbytes].view(bucket.dtype)
        with torch.no_grad():
            for i, slot in bucket.slots:
                flat[slot.offset:slot.offset + slot.numel].copy_(self.params[i][1].reshape(-1))
        return flat

    def send(self, version: int) -> SyncStats:
        """Broadcast the current values of the params as ``version``; returns its stats."""
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        try:
            g.store.add(_ANNOUNCE_KEY, 1)
            header = torch.tensor([version, layout.fingerprint, len(layout.buckets), layout.nbytes],
                                  dtype=torch.int64, device=g.device)
            g.wait(g.broadcast(header))
            inflight: list[dist.Work] = []
            for k, bucket in enumerate(layout.buckets):
                if len(inflight) == len(self._ring):
                    g.wait(inflight.pop(0))  # its ring buffer is free again
                flat = self._pack(bucket, self._ring[k % len(self._ring)])
                inflight.append(g.broadcast(flat))
            for work in inflight:
                g.wait(work)
            if g.device.type == "cuda":
                torch.cuda.current_stream(g.device).synchronize()
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(
                f"weight sync of version {version} to {g.world_size - 1} generator(s) failed "
                f"after {time.perf_counter() - t0:.1f} s (group timeout {g.timeout_s:g} s): a "
                f"generator is gone or stopped receiving. The weight group is unusable now. "
                f"Cause: {e}") from None
        g.syncs += 1
        return SyncStats(version=int(version), bytes=layout.nbytes,
                         seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------- receiver


class WeightReceiver:
    """A generator rank: receives each version into staging, applies it between batches.

    Foreground use: ``recv()`` then ``apply()``. Background use: ``start_background()``
    once, then ``swap_if_newer()`` between decode batches. With ``double_buffer`` the
    thread receives into a second staging set while the model copies from the first, so
    ``swap_if_newer`` never finds a version in flight; without it (1x less memory) a
    ``swap_if_newer`` that finds a receive in progress returns ``None`` at once and the
    next call picks the version up.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = 4.0, double_buffer: bool = False) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of the weight group is the sender, not a receiver")
        self.group = group
        self.params = [(n, p.detach()) for n, p in params]
        self.layout = _Layout(self.params, int(bucket_mb * 2**20))
        _handshake(group, self.layout)

        def staging() -> list[torch.Tensor]:
            return [torch.empty(b.numel, dtype=b.dtype, device=group.device)
                    for b in self.layout.buckets]

        self._front = staging()  # the newest complete version
        self._back = staging() if double_buffer else self._front
        self._front_version: int | None = None
        self._applied_version: int | None = None
        self._lock = threading.Lock()  # guards _front, _front_version and the copy into params
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stats: list[SyncStats] = []
        self._stats_lock = threading.Lock()  # not _lock: that one is held for a whole receive

    # -- receiving -----------------------------------------------------------------------
    def _wait_announced(self, timeout_s: float | None,
                        should_stop: Callable[[], bool] | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.0005
        while int(self.group.store.add(_ANNOUNCE_KEY, 0)) <= self.group.syncs:
            if self._stop.is_set() or (should_stop is not None and should_stop()):
                raise _StopReceiving()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"weight sync: no new version announced by the trainer within "
                                   f"{timeout_s:g} s (last received: {self._front_version})")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _receive_into(self, buffers: list[torch.Tensor]) -> SyncStats:
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        version: int | str = "?"
        try:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=g.device)
            g.wait(g.broadcast(header))
            version, fingerprint, n_buckets, nbytes = header.tolist()
            if fingerprint != layout.fingerprint or n_buckets != len(layout.buckets):
                raise WeightLayoutError(
                    f"weight sync of version {version}: the trainer's layout (fingerprint "
                    f"{fingerprint}, {n_buckets} buckets) differs from this generator's "
                    f"({layout.fingerprint}, {len(layout.buckets)} buckets)")
            works = [g.broadcast(buf) for buf in buffers]
            for work in works:
                g.wait(work)
            if g.device.type == "cuda":
                torch.cuda.current_stream(g.device).synchronize()
        except WeightLayoutError:
            raise
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(
                f"weight sync of version {version}: receiving on generator rank {g.rank} failed "
                f"after {time.perf_counter() - t0:.1f} s (group timeout {g.timeout_s:g} s): the "
                f"trainer or another generator of the weight group is gone. Cause: {e}") from None
        g.syncs += 1
        return SyncStats(version=int(version), bytes=int(nbytes), seconds=time.perf_counter() - t0)

    def recv(self, timeout_s: float | None = None,
             should_stop: Callable[[], bool] | None = None) -> SyncStats:
        """Receive the next version into staging (not the live params); see ``apply``.

        Waits up to ``timeout_s`` (default: the group timeout) for the trainer to start it.
        """
        if self._thread is not None:
            raise RuntimeError("recv() while the background receiver runs; use swap_if_newer()")
        try:
            self._wait_announced(self.group.timeout_s if timeout_s is None else timeout_s,
                                 should_stop)
        except _StopReceiving:
            raise Stopped("stopped while waiting for a weight sync") from None
        with self._lock:
            stats = self._receive_into(self._front)
            self._front_version = stats.version
        return stats

    def apply(self) -> int | None:
        """Copy the staged version into the live params; returns its version (None if none)."""
        with self._lock:
            return self._apply_locked()

    def _apply_locked(self) -> int | None:
        if self._front_version is None:
            return None
        with torch.no_grad():
            for bucket, flat in zip(self.layout.buckets, self._front):
                for i, slot in bucket.slots:
                    live = self.params[i][1]
                    live.copy_(flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        self._applied_version = self._front_version
        return self._applied_version

    # -- background mode -----------------------------------------------------------------
    def start_background(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Receive every new version into staging on a daemon thread, as soon as it is sent."""
        if self._thread is not None:
            raise RuntimeError("the background weight receiver is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(should_stop,),
                                        name=f"weight-receiver-{self.group.rank}", daemon=True)
        self._thread.start()

    def _loop(self, should_stop: Callable[[], bool] | None) -> None:
        try:
            while True:
                self._wait_announced(None, should_stop)
                if self._back is self._front:
                    with self._lock:
                        stats = self._receive_into(self._front)
                        self._front_version = stats.version
                else:
                    stats = self._receive_into(self._back)
                    with self._lock:
                        self._front, self._back = self._back, self._front
                        self._front_version = stats.version
                with self._stats_lock:
                    self._stats.append(stats)
        except _StopReceiving:
            pass
        except BaseException as e:  # surfaced to the generator by swap_if_newer()
            self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WeightSyncError(f"background weight receiver failed: {self._error}") from self._error

    def latest_version(self) -> int | None:
        """The newest completely received (staged) version, None before the first."""
        self._raise_if_failed()
        return self._front_version

    @property
    def applied_version(self) -> int | None:
        return self._applied_version

    def swap_if_newer(self) -> int | None:
        """Between decode batches: apply the staged version if it is newer than the model's.

        Returns the version now in the model, or None when nothing changed (nothing new, or
        a single-buffered receive is in progress).
        """
        self._raise_if_failed()
        if not self._lock.acquire(blocking=self._back is not self._front):
            return None
        try:
            if self._front_version is None or self._front_version == self._applied_version:
                return None
            return self._apply_locked()
        finally:
            self._lock.release()

    def pop_stats(self) -> list[SyncStats]:
        """Stats of background receives since the last call (for ``app.metrics.weight_sync``)."""
        with self._stats_lock:
            out, self._stats = self._stats, []
        return out

    def stop_background(self, timeout_s: float = 10.0) -> None:
        """Stop the thread between syncs; a receive in progress is allowed to finish."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightSyncError(f"background weight receiver did not stop within {timeout_s:g} s "
                                  "(stuck in a sync; it ends at the group timeout)")
        self._thread = None
        self._raise_if_failed()


class _StopReceiving(Exception):
    pass
