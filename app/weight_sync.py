"""The weight plane: the trainer broadcasts new policy weights straight to every generator.

This is the DDMA idea of LlamaRL (docs/architecture.md, "Planes"): no files and no parameter
server, just collectives in a process group of its own:

- rank 0 is the trainer rank that holds the full weights, ranks 1..G the generators;
- it rendezvouses over ``PrefixStore("weights", control_store)`` and is built from the
  backend class directly (gloo on CPU, NCCL on CUDA), so it lives beside the trainer's
  torchrun default group without touching it.

The parameter layout (names, shapes, dtypes, bucketing) is fixed when the sender and
receivers are built, and checked once across all ranks then, so a sync carries no
per-tensor metadata: one small int64 header (version, layout fingerprint) followed by
the same-dtype parameters flattened into contiguous buckets of about ``bucket_mb``.

Each sync is announced by setting a per-sync key in the store before the first
collective, so a receiver waits for the next sync in a short, repeated ``store.wait``
(woken at once, interruptible, idle otherwise) instead of sitting inside a collective
it cannot leave. The receiver writes into
staging buffers; ``apply``/``swap_if_newer`` copy a complete version into the live
model between decode batches, so a generator busy decoding never holds up the trainer
when its receiver runs in the background thread.

``flatten_parameters_`` (called once, before the optimizer is built) makes every
parameter a view of one flat buffer per dtype. A bucket whose parameters are then
consecutive in that buffer goes out as a slice of it: no packing copy on the sender,
one memcpy per bucket in ``apply`` on a flattened generator. Parameters that are not
(anymore) laid out that way are packed as before, so correctness never depends on it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from app.transport import Backoff, Stopped

__all__ = [
    "SyncStats",
    "WeightGroup",
    "WeightLayoutError",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "flatten_parameters_",
    "init_weight_group",
]

_HEADER_LEN = 5  # version, layout fingerprint, number of buckets, bytes, whole-dtype bitmask
DEFAULT_BUCKET_MB = 16.0
"""Sender and receivers must agree. Only packed buckets depend on it: a dtype whose
parameters are all one flat buffer goes out as one broadcast whatever the bucket size."""


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
    """Syncs this rank has taken part in; the sender's announcement keys run ahead of it."""
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
        # Buckets come dtype by dtype: (dtype, its first bucket, one past its last, numel).
        self.dtype_runs: list[tuple[torch.dtype, int, int, int]] = []
        for k, b in enumerate(buckets):
            if self.dtype_runs and self.dtype_runs[-1][0] == b.dtype:
                dtype, first, _, numel = self.dtype_runs[-1]
                self.dtype_runs[-1] = (dtype, first, k + 1, numel + b.numel)
            else:
                self.dtype_runs.append((b.dtype, k, k + 1, b.numel))
        self.nbytes = sum(b.nbytes for b in buckets)
        blob = json.dumps({"params": self.entries, "bucket_bytes": bucket_bytes}).encode()
        # 63 bits so it fits a (signed) int64 header slot.
        self.fingerprint = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1
        self.bucket_bytes = bucket_bytes

    def describe(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "bucket_bytes": self.bucket_bytes,
                           "params": self.entries})


def flatten_parameters_(params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Rebind every parameter's ``.data`` to a view of one flat buffer per (device, dtype).

    Call it once, before the optimizer (and DDP) take the parameters: in-place updates
    then land in the flat buffers, which the weight sync broadcasts without packing.
    Parameters are laid out in ``named_parameters()`` order, which is also the sync
    layout's order, so each bucket is one slice. A parameter shared by several modules
    (tied embeddings) is one object and is flattened once, so the tie holds; tensors that
    already share storage with another one are left alone (they would lose that sharing).
    Returns the flat buffers (1-d).
    """
    tensors = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    unique: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    storages: dict[tuple[torch.device, int], int] = {}
    for t in unique:
        key = (t.device, t.untyped_storage().data_ptr())
        storages[key] = storages.get(key, 0) + 1
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in unique:
        if storages[(t.device, t.untyped_storage().data_ptr())] == 1 and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    flats = []
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
            offset = 0
            for t in group:
                view = flat[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
                offset += t.numel()
            flats.append(flat)
    return flats


def _span(bucket: _Bucket, params: Sequence[tuple[str, torch.Tensor]],
          device: torch.device) -> torch.Tensor | None:
    """The bucket as one 1-d view when its params are consecutive in one storage, else None."""
    first = params[bucket.slots[0][0]][1]
    if first.dtype != bucket.dtype or first.device != device:
        return None
    ptr, base = first.untyped_storage().data_ptr(), first.storage_offset()
    for i, slot in bucket.slots:
        p = params[i][1]
        if slot.numel == 0:
            continue
        if (p.untyped_storage().data_ptr() != ptr or p.storage_offset() != base + slot.offset
                or not p.is_contiguous() or p.dtype != bucket.dtype):
            return None
    if base + bucket.numel > first.untyped_storage().nbytes() // first.element_size():
        return None
    return torch.as_strided(first.detach(), (bucket.numel,), (1,), base)


def _joined(spans: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Consecutive bucket spans of one storage as one 1-d view, else None."""
    if any(span is None for span in spans):
        return None
    first = spans[0]
    ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for span in spans:
        if span.untyped_storage().data_ptr() != ptr or span.storage_offset() != offset:
            return None
        offset += span.numel()
    return torch.as_strided(first, (offset - first.storage_offset(),), (1,), first.storage_offset())


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
# A receiver waiting for the next announcement polls the store at most this far apart:
# the most a sync can start late. (A blocking ``store.wait`` with a short timeout would
# react sooner but c10d logs two warnings for every wait that times out: 40 lines a
# second per idle generator.)
_POLL_MAX_S = 0.005


def _announce_key(sync: int) -> str:
    """Set by the sender before sync number ``sync`` (1-based) starts; receivers block on it."""
    return f"{_ANNOUNCE_KEY}/{sync}"


class WeightSender:
    """Rank 0 of the weight group: broadcasts ``params`` (the live tensors) on ``send``.

    ``params`` are kept as given (not detached copies), so a sync always reads the tensors'
    current storage; buckets that are a slice of a ``flatten_parameters_`` buffer are sent
    from it directly, the others are packed into a small ring of buffers.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB, max_inflight: int = 2) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight sender must be rank 0 of the weight group, not {group.rank}")
        self.group = group
        self.params = list(params)
        self.layout = _Layout(self.params, int(bucket_mb * 2**20))
        self.max_inflight = max(1, max_inflight)
        _handshake(group, self.layout)
        self._ring: list[torch.Tensor] = []  # packing buffers, made on the first packed bucket
        self.zero_copy_buckets = 0
        """Buckets of the last sync that went out without packing (for tests and benchmarks)."""

    def _packed(self, bucket: _Bucket, k: int) -> torch.Tensor:
        """Bucket packed into ring buffer ``k % ring``; the caller made sure it is free."""
        if not self._ring:
            ring_bytes = max(b.nbytes for b in self.layout.buckets)
            self._ring = [torch.empty(ring_bytes, dtype=torch.uint8, device=self.group.device)
                          for _ in range(min(self.max_inflight, len(self.layout.buckets)))]
        flat = self._ring[k % len(self._ring)][:bucket.nbytes].view(bucket.dtype)
        with torch.no_grad():
            for i, slot in bucket.slots:
                flat[slot.offset:slot.offset + slot.numel].copy_(self.params[i][1].reshape(-1))
        return flat

    def send(self, version: int) -> SyncStats:
        """Broadcast the current values of the params as ``version``; returns its stats."""
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        try:
            g.store.set(_announce_key(g.syncs + 1), str(version))
            spans = [_span(bucket, self.params, g.device) for bucket in layout.buckets]
            whole = [_joined(spans[first:end]) for _, first, end, _ in layout.dtype_runs]
            mask = sum(1 << d for d, span in enumerate(whole) if span is not None)
            header = torch.tensor([version, layout.fingerprint, len(layout.buckets), layout.nbytes,
                                   mask], dtype=torch.int64, device=g.device)
            inflight: list[tuple[dist.Work, bool]] = [(g.broadcast(header), False)]
            packed_inflight = packed = zero_copy = 0
            for (_, first, end, _), span in zip(layout.dtype_runs, whole):
                if span is not None:  # a flattened model: one broadcast, like a raw one
                    zero_copy += end - first
                    inflight.append((g.broadcast(span), False))
                    continue
                for bucket, flat in zip(layout.buckets[first:end], spans[first:end]):
                    if flat is None:
                        # Reusing a ring buffer: wait until the broadcast that used it is done.
                        while packed_inflight >= self.max_inflight:
                            work, was_packed = inflight.pop(0)
                            g.wait(work)
                            packed_inflight -= was_packed
                        flat = self._packed(bucket, packed)
                        packed += 1
                        packed_inflight += 1
                        inflight.append((g.broadcast(flat), True))
                    else:
                        zero_copy += 1
                        inflight.append((g.broadcast(flat), False))
            for work, _ in inflight:
                g.wait(work)
            if g.device.type == "cuda":
                torch.cuda.current_stream(g.device).synchronize()
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
                 bucket_mb: float = DEFAULT_BUCKET_MB, double_buffer: bool = False) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of the weight group is the sender, not a receiver")
        self.group = group
        self.params = list(params)  # as given: apply() follows a later .data rebinding
        self.layout = _Layout(self.params, int(bucket_mb * 2**20))
        _handshake(group, self.layout)

        def staging() -> list[torch.Tensor]:
            """One flat buffer per dtype (received whole from a flattened trainer), as
            bucket views (received bucket by bucket otherwise)."""
            buckets = []
            for dtype, first, end, numel in self.layout.dtype_runs:
                flat = torch.empty(numel, dtype=dtype, device=group.device)
                offset = 0
                for b in self.layout.buckets[first:end]:
                    buckets.append(flat[offset:offset + b.numel])
                    offset += b.numel
            return buckets

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
        key = _announce_key(self.group.syncs + 1)
        backoff = Backoff(max_s=_POLL_MAX_S)
        while not self.group.store.check([key]):
            if self._stop.is_set() or (should_stop is not None and should_stop()):
                raise _StopReceiving()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"weight sync: no new version announced by the trainer within "
                                   f"{timeout_s:g} s (last received: {self._front_version})")
            time.sleep(backoff.next())

    def _receive_into(self, buffers: list[torch.Tensor]) -> SyncStats:
        g, layout = self.group, self.layout
        t0 = time.perf_counter()
        version: int | str = "?"
        try:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=g.device)
            g.wait(g.broadcast(header))
            version, fingerprint, n_buckets, nbytes, whole_mask = header.tolist()
            if fingerprint != layout.fingerprint or n_buckets != len(layout.buckets):
                raise WeightLayoutError(
                    f"weight sync of version {version}: the trainer's layout (fingerprint "
                    f"{fingerprint}, {n_buckets} buckets) differs from this generator's "
                    f"({layout.fingerprint}, {len(layout.buckets)} buckets)")
            works = []
            for d, (dtype, first, end, numel) in enumerate(layout.dtype_runs):
                if whole_mask >> d & 1:
                    first_buf = buffers[first]
                    works.append(g.broadcast(torch.as_strided(
                        first_buf, (numel,), (1,), first_buf.storage_offset())))
                else:
                    works += [g.broadcast(buf) for buf in buffers[first:end]]
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
                span = _span(bucket, self.params, flat.device)
                if span is not None:  # a flattened model: one copy per bucket
                    span.copy_(flat)
                    continue
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
