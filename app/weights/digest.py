"""A signed digest of every weight version, per trainer rank, so a generator refuses
weights altered in flight and names the trainer rank whose shard was.

gloo and NCCL groups authenticate nothing: whoever can reach the weight plane's ports can
write into a broadcast. So every trainer rank publishes, for each version, a digest of
the bytes it sends (its shard: ``llamarl.app.weights.shards``; with one rank the whole model), a
record signed by that rank (``llamarl.app.control.signed``, writer ``trainer/<rank>``) at
``names.weight_digest_key(version, rank)``. A generator hashes what it received from each
trainer rank the same way (its runs as they lie in that rank's staging on the
generator: ``llamarl.app.weights.receiver``) and takes the version only when every rank's digest
matches. A mismatch (or a record that is missing, forged, or for another version or
rank) is refused: the generator keeps the version it has, counts it
(``security/weight_digest/<reason>``) and logs, naming the trainer ranks, the first of
each reason. No rank gathers anything for it: each hashes 1/N of the model.

The digest of one sender: SHA-256 over each run's dtype and byte count and the SHA-256
of each ``CHUNK_BYTES`` slice of it (a run is every parameter part of one dtype, end to
end: ``llamarl.app.weights.layout``). A run is given as its pieces (consecutive tensors: a
sender's parameter parts, or a generator's slices of staging): chunks are cut from the
pieces' bytes as if they lay end to end, so the digest is the bytes', whatever memory
they sit in, nothing is packed to hash it, the chunks hash in parallel threads
(``hashlib`` releases the GIL) and a CUDA piece is copied to the host a chunk at a time.
Cryptographic on purpose: a checksum (a sum, a CRC) is easy to keep while changing the
weights, and the attacker here chooses the bytes.

Overlapped with the send (``ShardDigest.start``): a trainer rank hashes its shard on a
thread while the shard is on the wire, and that thread publishes the record as soon as
the hash is done, whether or not the send is: a send that fails on a lost generator is
resent in a new weight group (``llamarl.app.weights.epochs``), and a generator that
received the version whole in the old group waits for its record before it joins the
new one. A record published only after the resend would keep it out until its wait
ran out, then the version was refused (``no_record``) with nothing altered.

Overlapped with the receive, on a generator (``DigestCheck.start``, ``Arriving``): the
receiver feeds each broadcast's bytes, as it lands, to a ``Digest`` per trainer rank,
which cuts them into chunks as ``digest()`` does and hands each full chunk to the
threads at once; when the last broadcast lands only the last chunks are left to hash,
then the records are read (waiting at most ``DigestCheck.wait_s``). Why this shape:
the bytes of a broadcast are final once it completes (a later one never writes them),
so nothing is copied to hash them early; the receiver takes each trainer rank's
broadcasts in that rank's order (``digest()``'s order: run by run, bucket by bucket),
whichever rank's next is in first, so the value is the same function of the bytes (no
second definition: ``digest()`` itself is a ``Digest`` fed whole runs);
hashing each broadcast as it lands rather than the whole version after it turns the
generator's hash (~3x a bare sharded sync at 100M parameters on 2 cores, almost all
after the receive) into work done while the rest is on the wire, which is where a host
with cores to spare, or a GPU generator whose receive (NCCL) leaves the host idle,
gains it (on 2 cores shared with the trainer the hashing mostly moves: under a tenth
saved, benchmarks/README.md). ``DigestCheck(overlap=False)`` hashes after the receive as before, for
``benchmarks/weight_sync.py --digest`` and ``benchmarks/security.py`` to compare. The
costs are measured there; the digest is optional (``--no-weight-digest``) because at
~100M parameters on a CPU host hashing costs about as much as the sync itself.

``LLAMARL_TEST_CORRUPT_WEIGHTS`` is a test hook: a comma-separated list of
``<generator replica>:<version>[:<trainer rank>]``; that generator flips the bits of the
first value received of that version from that trainer rank (0 when not given) as it
lands, before it is hashed (a flip after would go unseen: its chunk may be hashed
already), as an attacker on the weight plane would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

import torch

from llamarl.app import names
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import Backoff
from llamarl.app.weights.layout import DEFAULT_BUCKET_MB, Layout
from llamarl.app.weights.shards import local_parts

log = logging.getLogger("llamarl")

__all__ = ["CHUNK_BYTES", "Arriving", "Digest", "DigestCheck", "Pending", "ShardDigest", "TEST_CORRUPT_ENV", "digest",
           "run_pieces"]

CHUNK_BYTES = 16 << 20
"""Bytes hashed per task: large enough that a thread's start is noise, small enough that
a 100M-parameter model splits into ~25 tasks for the threads."""
KEEP_VERSIONS = 4
"""Digest records each trainer rank keeps in the store: a generator checks the version it
just received, which the trainer published at most a send or two ago."""
RECORD_WAIT_S = 60.0
"""How long a generator waits for a trainer rank's record after it hashed what it
received: the rank publishes once its own hash is done, which it started with the send."""
HASH_WAIT_S = 600.0
"""The longest a digest waits for its hash threads: hashing is local CPU work (SHA-256 at
~1 GB/s per thread, a few seconds for billions of parameters), so a wait this long means a
thread is stuck, and the sync fails saying so rather than waiting for ever."""
TEST_CORRUPT_ENV = "LLAMARL_TEST_CORRUPT_WEIGHTS"
MISMATCH, NO_RECORD, BAD_RECORD = "mismatch", "no_record", "bad_record"
_WHY = {MISMATCH: "its digest differs from the one that trainer rank signed: altered in flight",
        NO_RECORD: "that trainer rank published no digest for it",
        BAD_RECORD: "its digest record is not signed by that trainer rank with the app's secret, "
                    "or is for another version or rank"}

Run = torch.Tensor | Sequence[torch.Tensor]
"""One run: a tensor, or its pieces in order (at least one, empty ones allowed)."""

_pool: ThreadPoolExecutor | None = None
_overlap: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()  # a receiver thread and a trainer's hashing thread may both ask first


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="weight-digest")
        return _pool


def _hashed(future: Future, deadline: float) -> Any:
    """``future``'s result, waiting until ``deadline`` (``time.monotonic``) at the latest."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise TimeoutError(f"hashing the weights took more than {HASH_WAIT_S:g} s (HASH_WAIT_S): "
                           "a weight-digest thread is stuck") from None


def _chunk_digest(pieces: list[torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        host = piece if piece.device.type == "cpu" else piece.to("cpu")
        h.update(host.numpy().data)
    return h.digest()


class Digest:
    """``digest()`` of one sender's runs, fed piece by piece in order: each full chunk goes
    to the threads as soon as it is cut, so the hashing runs beside whatever produces the
    next pieces (a generator's receive), and ``hexdigest`` has only the tail left.

    ``dtypes``: the sender's runs' dtypes, in order (a run fed nothing is an empty run).
    ``deferred``: keep the chunks and hash them all in ``hexdigest`` (a generator that
    hashes after its receive, as before: benchmarks compare the two). A piece must not
    change between ``update`` and ``hexdigest``: its chunks are read in place."""

    def __init__(self, dtypes: Sequence[torch.dtype], *, deferred: bool = False) -> None:
        self.dtypes, self.deferred = list(dtypes), deferred
        self._chunk_bytes = CHUNK_BYTES
        self._nbytes: list[int] = []  # per run begun
        self._hashes: list[list[Future | list[torch.Tensor]]] = []  # per run begun: its chunks
        self._chunk: list[torch.Tensor] = []
        self._room = self._chunk_bytes

    def update(self, run: int, piece: torch.Tensor) -> None:
        """Feed ``piece``, the next bytes of run ``run`` (runs in order, never back)."""
        if not max(0, len(self._hashes) - 1) <= run < len(self.dtypes):
            raise ValueError(f"weight digest: run {run} fed after run {len(self._hashes) - 1} "
                             f"(of {len(self.dtypes)} runs); runs go in order")
        if piece.dtype != self.dtypes[run]:
            raise ValueError(f"weight digest: a run's pieces must share one dtype, not "
                             f"{self.dtypes[run]} and {piece.dtype}")
        while len(self._hashes) <= run:
            self._begin_run()
        raw = piece.detach().reshape(-1).view(torch.uint8)
        self._nbytes[-1] += raw.numel()
        at = 0
        while at < raw.numel():
            take = min(self._room, raw.numel() - at)
            self._chunk.append(raw[at:at + take])
            at, self._room = at + take, self._room - take
            if not self._room:
                self._cut()

    def _begin_run(self) -> None:
        if self._chunk:  # a chunk never spans two runs
            self._cut()
        self._hashes.append([])
        self._nbytes.append(0)

    def _cut(self) -> None:
        chunk, self._chunk, self._room = self._chunk, [], self._chunk_bytes
        self._hashes[-1].append(chunk if self.deferred else _threads().submit(_chunk_digest, chunk))

    def hexdigest(self) -> str:
        """The digest of everything fed (runs never fed count as empty)."""
        while len(self._hashes) < len(self.dtypes):
            self._begin_run()
        if self._chunk:
            self._cut()
        hashes = [[_threads().submit(_chunk_digest, c) if isinstance(c, list) else c for c in run]
                  for run in self._hashes]
        top = hashlib.sha256(f"llamarl weights v1, chunks of {self._chunk_bytes}\0".encode())
        deadline = time.monotonic() + HASH_WAIT_S
        for dtype, nbytes, run in zip(self.dtypes, self._nbytes, hashes):
            top.update(f"{dtype}:{nbytes}\0".encode())
            top.update(b"".join(_hashed(f, deadline) for f in run))
        return top.hexdigest()


def _pieces(run: Run) -> list[torch.Tensor]:
    return [run] if isinstance(run, torch.Tensor) else list(run)


def digest(runs: Sequence[Run]) -> str:
    """Hex digest of one sender's ``runs`` (in layout order, on any device); see the
    module docstring. The same bytes give the same digest however they are cut in pieces."""
    pieces = [_pieces(run) for run in runs]
    h = Digest([p[0].dtype for p in pieces])
    for k, run in enumerate(pieces):
        for piece in run:
            h.update(k, piece)
    return h.hexdigest()


def run_pieces(params: Sequence[tuple[str, torch.Tensor]], layout: Layout) -> list[list[torch.Tensor]]:
    """Each run of ``layout`` as the pieces the sender sends: its parameters (parts), in
    order, as they are (no copy)."""
    return [[params[s.index][1].detach().reshape(-1) for s in run.slots] for run in layout.runs]


def _key_writer(rank: int) -> str:
    return names.member("trainer", rank)


class Pending:
    """A digest being computed and published on a thread (``ShardDigest.start``)."""

    def __init__(self, version: int, future: Future) -> None:
        self.version, self.future = version, future

    def wait(self) -> float:
        """Wait until the record is published (or raise why it was not); the seconds the
        hash took."""
        return _hashed(self.future, time.monotonic() + HASH_WAIT_S)


class ShardDigest:
    """A trainer rank's side: the digest of its shard of each version, published as a
    record it signs. ``params`` as the weight sender holds them (DTensors with several
    ranks); the layout is the sender's run order, fixed here."""

    def __init__(self, signed: SignedStore, params: Sequence[tuple[str, torch.Tensor]], *, rank: int,
                 ranks: int) -> None:
        # A connection of its own: the hashing thread publishes while the caller sends.
        self.signed, self.params, self.rank, self.ranks = signed.clone(), list(params), rank, ranks
        local, _ = local_parts(self.params, rank, ranks)
        # Only the runs' order matters to the digest (dtype by dtype, params order), not buckets.
        self.layout = Layout(local, int(DEFAULT_BUCKET_MB * 2**20))

    def runs(self) -> list[list[torch.Tensor]]:
        """This rank's current shard, run by run (DTensors' local tensors move: read now)."""
        return run_pieces(local_parts(self.params, self.rank, self.ranks)[0], self.layout)

    def publish(self, version: int, hexdigest: str) -> None:
        self.signed.put(names.weight_digest_key(version, self.rank),
                        {"version": int(version), "rank": self.rank, "ranks": self.ranks, "digest": hexdigest})
        if version >= KEEP_VERSIONS:
            self.signed.store.delete_key(names.weight_digest_key(version - KEEP_VERSIONS, self.rank))

    def now(self, version: int) -> float:
        """Hash and publish ``version`` before it is sent; the seconds the hash took."""
        return self.start(version, overlap=False).wait()

    def start(self, version: int, *, overlap: bool = True) -> Pending:
        """Start hashing ``version`` and publishing its record once hashed (on a thread of
        its own when ``overlap``, so the caller sends meanwhile; the weights must not
        change until ``Pending.wait`` returns)."""
        runs = self.runs()

        def hashed() -> float:
            t0 = time.perf_counter()
            hexdigest = digest(runs)
            seconds = time.perf_counter() - t0
            self.publish(version, hexdigest)
            return seconds

        if not overlap:
            done: Future = Future()
            done.set_result(hashed())
            return Pending(version, done)
        global _overlap
        with _pool_lock:
            if _overlap is None:
                _overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-digest-send")
        return Pending(version, _overlap.submit(hashed))


def _corrupt(replica: int) -> dict[int, int]:
    """The versions the test hook alters on generator ``replica``, and from which trainer rank."""
    out = {}
    for item in os.environ.get(TEST_CORRUPT_ENV, "").split(","):
        if item.strip():
            who, version, *sender = item.split(":")
            if int(who) == replica:
                out[int(version)] = int(sender[0]) if sender else 0
    return out


class DigestCheck:
    """A generator's check of each received version against every trainer rank's signed
    record; counts refusals by reason (``refused``: the trainer ranks of the last one)
    and logs the first of each reason.

    ``start`` a version once its header is in, ``feed`` it what has landed, each sender's
    pieces in order, and ask ``taken`` once the whole version is in (``WeightReceiver``
    does). ``overlap``: hash each piece as it is fed (on the threads, beside the rest of
    the receive); False hashes everything in ``taken``, after the receive (the path
    before, kept for ``benchmarks/weight_sync.py --digest``)."""

    def __init__(self, signed: SignedStore, replica: int, *, wait_s: float = RECORD_WAIT_S,
                 should_stop: Callable[[], bool] | None = None, overlap: bool = True) -> None:
        self.signed, self.where = signed, names.member("generator", replica)
        self.wait_s, self.should_stop, self.overlap = wait_s, should_stop, overlap
        self.counts: Counter[str] = Counter()
        self.refused: dict[int, str] = {}
        """The last refused version's trainer ranks whose shard failed, with the reason."""
        self._reported: dict[str, float] = {}  # what new_counts last returned
        self._corrupt = _corrupt(replica)

    def start(self, version: int, dtypes: Sequence[Sequence[torch.dtype]]) -> Arriving:
        """Check ``version``, whose runs from each trainer rank have ``dtypes[rank]``."""
        return Arriving(self, version, dtypes)

    def __call__(self, version: int, senders: Sequence[Sequence[Run]]) -> bool:
        """Whether ``senders`` (for each trainer rank, the runs received from it for
        ``version``, all in) are the weights the trainer ranks sent."""
        runs = [[_pieces(run) for run in sender] for sender in senders]
        arriving = self.start(version, [[pieces[0].dtype for pieces in sender] for sender in runs])
        for rank, sender in enumerate(runs):
            for k, pieces in enumerate(sender):
                arriving.feed(rank, k, pieces)
        return arriving.taken()

    def judge(self, version: int, mine: Sequence[str]) -> bool:
        """Whether ``mine`` (each trainer rank's digest of what arrived) match their records."""
        failed = {}
        for rank, hexdigest in enumerate(mine):
            expected, reason = self._record(version, rank, len(mine))
            if reason is None and hexdigest != expected:
                reason = MISMATCH
            if reason is not None:
                failed[rank] = reason
        if not failed:
            return True
        self.refused = failed
        reason = next(iter(failed.values()))
        self.counts[reason] += 1
        if self.counts[reason] == 1:
            log.error("%s: refused weights of version %d (%s): %s; keeping the version it has; further "
                      "refusals are only counted", self.where, version, reason,
                      "; ".join(f"trainer rank {r}'s shard ({why}): {_WHY[why]}" for r, why in failed.items()))
        return False

    def _record(self, version: int, rank: int, ranks: int) -> tuple[str | None, str | None]:
        """(trainer rank ``rank``'s digest of ``version``, None) or (None, why there is none),
        once its record is there or ``wait_s`` has passed."""
        key = names.weight_digest_key(version, rank)
        deadline = time.monotonic() + self.wait_s
        backoff = Backoff(first_s=0.001, max_s=0.01)
        while not self.signed.store.check([key]):
            if time.monotonic() >= deadline or (self.should_stop is not None and self.should_stop()):
                return None, NO_RECORD
            time.sleep(backoff.next())
        record = self.signed.record(key, writers=(_key_writer(rank),))
        value = record.value if record is not None else None
        if (not isinstance(value, dict) or value.get("version") != version or value.get("rank") != rank
                or value.get("ranks") != ranks or not isinstance(value.get("digest"), str)):
            return None, BAD_RECORD
        return value["digest"], None

    def metrics(self) -> dict[str, float]:
        return {names.weight_digest_metric(k): float(n) for k, n in dict(self.counts).items()}

    def new_counts(self) -> dict[str, float]:
        """``metrics()`` when they changed since the last call, else an empty dict."""
        now = self.metrics()
        if now == self._reported:
            return {}
        self._reported = now
        return now


class Arriving:
    """One version as it arrives on a generator (``DigestCheck.start``): each trainer rank's
    bytes hashed as they are fed, then checked against the records."""

    def __init__(self, check: DigestCheck, version: int, dtypes: Sequence[Sequence[torch.dtype]]) -> None:
        self.check, self.version = check, version
        self.digests = [Digest(d, deferred=not check.overlap) for d in dtypes]
        # The test hook: that rank's first byte altered as it lands, before it is hashed.
        self._corrupt_rank = check._corrupt.pop(version, None)

    def feed(self, rank: int, run: int, pieces: Sequence[torch.Tensor]) -> None:
        """Trainer rank ``rank``'s next bytes of run ``run``, landed (read in place: they
        must stay as they are until ``taken``)."""
        for piece in pieces:
            if rank == self._corrupt_rank and piece.numel():
                with torch.no_grad():
                    piece.view(-1)[:1].view(torch.uint8).bitwise_not_()
                self._corrupt_rank = None
            self.digests[rank].update(run, piece)

    def hexdigests(self) -> list[str]:
        """Once every byte is fed: each rank's digest of what arrived."""
        return [d.hexdigest() for d in self.digests]

    def taken(self) -> bool:
        """Once every byte is fed: whether every rank's digest matches its signed record
        (hashed first: the records are published as the trainer ranks finish their own hash)."""
        return self.check.judge(self.version, self.hexdigests())
