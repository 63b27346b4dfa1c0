"""The receiving end of the weight groups (``llamarl.app.weights.group``): a generator takes
each version from every trainer rank into staging on a background thread.

A generator takes each trainer rank's broadcasts in order, whichever rank's next is in
first (``wait_first``), each straight into that rank's staging (one buffer per run, in
the rank's own layout: a broadcast is one slice of it, however many parameter parts the
sender packed into it), and feeds it to the version's ``Verification`` (the weight
digest, ``llamarl.app.weights.digest``) so it is hashed while the rest is on the wire.
``Staging`` is the hand-off to the swap: the receive thread writes the ranks' buffers,
``llamarl.app.weights.subscriber`` copies a complete version from them into the live model
between decode batches (``llamarl.app.weights.shards.Landing.moves``: with one trainer
rank one copy per run, with several one per parameter part), so a generator busy
decoding never holds up the trainer, and a sharded sync costs a generator no copy
beyond that one.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from llamarl.app import names
from llamarl.app.control.transport import Backoff
from llamarl.app.weights.group import (
    HEADER_LEN,
    SyncStats,
    WeightGroup,
    WeightLayoutError,
    WeightSyncError,
    check_same_model,
    full_entries,
    handshake,
    host_or_device,
    sync_failures,
    stop_thread,
    wait_first,
    whole_cuts,
)
from llamarl.app.weights.layout import DEFAULT_BUCKET_MB, Layout, span_view
from llamarl.app.weights.shards import Landing, Shards, check_tiling, meta_params

__all__ = ["Staging", "Verification", "Verifier", "WeightReceiver"]

# A receiver waiting for the next announcement polls the store at most this far apart:
# the most a sync can start late. (A blocking ``store.wait`` with a short timeout would
# react sooner but c10d logs two warnings for every wait that times out: 40 lines a
# second per idle generator.)
_POLL_MAX_S = 0.005


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
class Staging:
    """Where a generator's receive thread leaves each version for the swap: each trainer
    rank's bytes as they came (``buffers``) and where they go in the parameters (``moves``),
    the model's live parameters as one view per run, the newest version complete and
    accepted in the buffers and the newest copied into the parameters. ``lock`` is held by
    a whole receive and by a swap, so a swap never copies a version half written."""

    buffers: list[list[torch.Tensor]]
    """Per trainer rank, one flat buffer per run of that rank's layout (its parts of the
    parameters, in its order)."""
    moves: list[list[list[tuple[int, int, int]]]]
    """Per trainer rank and run, ``(offset in its buffer, offset in the live run, numel)``:
    the copies a swap makes (``llamarl.app.weights.shards.Landing.moves``). A rank's run k
    is the live run k (the same dtypes in the same order)."""
    live: list[torch.Tensor]
    """The parameters as one 1-d view per run (``flatten_parameters_``'s buffers). Fixed
    when the receiver is built: the parameters' ``.data`` must not be rebound after that."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int | None = None
    """The version the buffers hold complete and accepted; after a refused one, ``applied``
    (the buffers hold bytes not to copy, and ``applied`` is in the parameters already)."""
    applied: int | None = None
    """The version copied into the parameters last (``None`` before the first)."""


@dataclass
class _Landed:
    """One broadcast of a sync on a generator."""

    group: WeightGroup
    work: dist.Work
    run: int
    piece: torch.Tensor
    """Its bytes once in: a slice of its sender's staging."""


@dataclass
class _SenderPlan:
    """What a generator receives from one trainer rank, and where it puts it.

    The rank's bytes are staged as they come, in its own layout: one flat buffer per run
    (``buffers``), each broadcast a slice of it at its bucket's offset, so nothing is
    unpacked while the sync is on the wire; ``moves`` says where those bytes go in the
    live model, for the copy a swap makes anyway (both handed to the swap in ``Staging``)."""

    group: WeightGroup
    layout: Layout
    """The trainer rank's layout (its parts of the parameters), rebuilt from its document."""
    shards: Shards
    landing: Landing

    def __post_init__(self) -> None:
        self.buffers = [host_or_device(self.group, run.numel, run.dtype) for run in self.layout.runs]
        self.moves = [self.landing.moves(run) for run in self.layout.runs]

    def post(self, header: list[int]) -> list[_Landed]:
        """Start receiving one sync whose header is ``header``; its broadcasts, in order."""
        g, layout = self.group, self.layout
        version, fingerprint, whole = header
        if fingerprint != layout.fingerprint:
            raise WeightLayoutError(
                f"weight sync of version {version}: trainer rank {self.shards.rank}'s layout "
                f"(fingerprint {fingerprint}) differs from the one it announced ({layout.fingerprint})")
        landed: list[_Landed] = []
        for k, (run, flat) in enumerate(zip(layout.runs, self.buffers)):
            cuts = (whole_cuts(run, layout.bucket_bytes) if whole >> k & 1 else
                    [(b.offset, b.offset + b.numel) for b in run.buckets if b.numel])
            for a, b in cuts:
                piece = flat[a:b]
                landed.append(_Landed(g, g.broadcast(piece), k, piece))
        return landed


class WeightReceiver:
    """A generator rank: receives each version on a background thread, applies it between
    decode batches.

    ``groups``: one weight group per trainer rank, in trainer-rank order (a single group
    for one trainer rank). Each trainer rank's part of a version lands in that rank's
    staging, all ranks' parts at once (``_SenderPlan``).

    ``start_background()`` (or ``receive_until`` on a thread of the caller's) once; the
    versions it receives wait in ``staging`` until ``llamarl.app.weights.subscriber.swap_staged``
    copies the newest into the parameters between decode batches. There is one staging
    per version, so a swap that finds a receive in progress takes nothing at once and
    the next one picks the version up.

    ``params`` must be laid out by ``flatten_parameters_`` (as the generator's model is),
    so applying a version from one trainer rank is one copy per run. The buckets are the
    senders' (read in the layout handshake); ``bucket_mb`` only cuts this side's own
    layout document.
    ``verify`` (``llamarl.app.weights.digest.DigestCheck``), when given, is told of each version as
    its header lands, fed each broadcast's bytes (views of staging) as it lands, sender
    by sender in order, and asked at the end whether to take it; a version it refuses is
    never applied: the model keeps the version it has.
    """

    def __init__(self, groups: WeightGroup | Iterable[WeightGroup], params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 verify: Verifier | None = None) -> None:
        self.params = list(params)
        self.layout = Layout(self.params, int(bucket_mb * 2**20))
        self.groups: list[WeightGroup] = []
        self._senders: list[_SenderPlan] = []
        # Group by group, each through its handshake before the next is asked for: a lazy
        # iterable may build the next one only then (``llamarl.app.weights.subscriber``).
        for rank, group in enumerate([groups] if isinstance(groups, WeightGroup) else groups):
            if group.rank == 0:
                raise ValueError("rank 0 of a weight group is its sender, not a receiver")
            self.groups.append(group)
            if rank == 0:
                self.group = group
                # The model's device; staging is on the group's (the host when weights are staged).
                self.device = self.params[0][1].device
                live = self._live_views()  # fail here, not at the first swap
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
        self.staging = Staging([p.buffers for p in self._senders], [p.moves for p in self._senders], live)
        self.verify = verify
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        """Why the receive loop ended, when it failed: staging may hold a version half
        written, never to be copied."""
        self._stats: list[SyncStats] = []
        self._stats_lock = threading.Lock()  # not staging.lock: that one is held for a whole receive

    def _sender_plan(self, group: WeightGroup, rank: int) -> _SenderPlan:
        """Handshake with trainer rank ``rank`` over ``group``: its layout rebuilt from its
        document, checked against this model, and where each of its spans lands."""
        mine = json.loads(self.layout.describe())
        doc = handshake(group, mine)[0]
        try:
            sent = Layout(meta_params(doc["params"]), int(doc["bucket_bytes"]), int(doc["alone_bytes"]))
            sh = doc["shards"]
            shards = Shards(rank=int(sh["rank"]), ranks=int(sh["ranks"]),
                            full_shapes=tuple(tuple(int(d) for d in s) for s in sh["full_shapes"]),
                            starts=tuple(int(x) for x in sh["starts"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLayoutError(f"weight sync: trainer rank {rank}'s layout document is not one this "
                                    f"generator reads ({type(e).__name__}: {e})") from None
        check_same_model(group, mine["params"], full_entries(sent, shards), 0)
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
            if should_stop is not None and should_stop():
                return False
            if self._stop.wait(backoff.next()):  # set: stop now, not after the sleep
                return False
        return True

    def _receive(self) -> tuple[SyncStats, Verification | None]:
        t0 = time.perf_counter()
        version: int | str = "?"
        g = self.group
        with sync_failures(g, lambda: f"weight sync of version {version}: receiving on generator rank {g.rank}",
                           "a trainer rank or another generator of the weight group is gone"):
            headers = [torch.zeros(HEADER_LEN, dtype=torch.int64, device=g.device) for _ in self.groups]
            for group, work in [(group, group.broadcast(h)) for group, h in zip(self.groups, headers)]:
                group.wait(work)
            versions = {h[0].item() for h in headers}
            version = headers[0][0].item()
            if len(versions) > 1:
                raise WeightSyncError(f"weight sync: the trainer ranks sent versions {sorted(versions)} "
                                      "in one sync")
            verification = None if self.verify is None else self.verify.start(
                int(version), [[run.dtype for run in plan.layout.runs] for plan in self._senders])
            self._land([plan.post(header.tolist()) for plan, header in zip(self._senders, headers)],
                       verification)
            for group in self.groups:
                group.synchronize()
        for group in self.groups:
            group.syncs += 1
            group.signed.forget(names.weight_sync_announce_key(group.syncs))  # read once
        return SyncStats(version=int(version), bytes=self.layout.nbytes,
                         seconds=time.perf_counter() - t0), verification

    def _land(self, broadcasts: list[list[_Landed]], verification: Verification | None) -> None:
        """Wait for every sender's ``broadcasts``, each sender's in order, taking whichever
        sender's next is in first: with a ``verification``, its bytes are fed to it, so
        they are hashed while the rest arrives."""
        queues = [deque(b) for b in broadcasts]
        while live := [s for s, q in enumerate(queues) if q]:
            s = live[wait_first([(queues[s][0].group, queues[s][0].work) for s in live])]
            item = queues[s].popleft()
            if verification is not None:
                item.group.synchronize()  # on a GPU: landed before another thread reads them
                verification.feed(s, item.run, [item.piece])

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
        ``error``, and raised by ``latest_version`` and the swap), ``None`` when told to stop."""
        staging = self.staging
        try:
            while self._wait_announced(should_stop):
                with staging.lock:
                    stats, verification = self._receive()
                    # Refused: staging holds bytes not to apply, whatever it held before.
                    taken = verification is None or verification.taken()
                    staging.version = stats.version if taken else staging.applied
                    with self._stats_lock:  # counted by the time the version is staged
                        self._stats.append(stats)
        except BaseException as e:  # surfaced to the generator by the swap
            self.error = e
        return self.error

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise WeightSyncError(f"background weight receiver failed: {self.error}") from self.error

    # -- between decode batches ----------------------------------------------------------
    def latest_version(self) -> int | None:
        """The newest completely received (staged) version, None before the first."""
        self.raise_if_failed()
        return self.staging.version

    def waiting(self) -> bool:
        """Whether a swap would apply a version now: one newer than the model's is staged
        and no receive is writing into staging."""
        self.raise_if_failed()
        staging = self.staging
        return staging.version is not None and staging.version != staging.applied and not staging.lock.locked()

    def pop_stats(self) -> list[SyncStats]:
        """Stats of background receives since the last call (for ``llamarl.app.metrics.events.weight_sync``)."""
        with self._stats_lock:
            out, self._stats = self._stats, []
        return out

    def stop_background(self, timeout_s: float = 10.0) -> None:
        """Stop the thread between syncs; a receive in progress is allowed to finish."""
        self._thread = stop_thread(self._thread, self._stop, timeout_s, "background weight receiver")
        self.raise_if_failed()

