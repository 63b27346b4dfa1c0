"""A signed digest of every weight version, per trainer rank, so a generator refuses
weights altered in flight and names the trainer rank whose shard was.

gloo and NCCL groups authenticate nothing: whoever can reach the weight plane's ports can
write into a broadcast. So every trainer rank publishes, for each version, a digest of
the bytes it sends (its shard: ``app.weight_shards``; with one rank the whole model), a
record signed by that rank (``app.signed``, writer ``trainer/<rank>``) at
``names.weight_digest_key(version, rank)``. A generator hashes what it received from each
trainer rank the same way (its runs as they lie in the generator's staging:
``weight_shards.Landing.received``) and takes the version only when every rank's digest
matches. A mismatch (or a record that is missing, forged, or for another version or
rank) is refused: the generator keeps the version it has, counts it
(``security/weight_digest/<reason>``) and logs, naming the trainer ranks, the first of
each reason. No rank gathers anything for it: each hashes 1/N of the model.

The digest of one sender: SHA-256 over each run's dtype and byte count and the SHA-256
of each ``CHUNK_BYTES`` slice of it (a run is every parameter part of one dtype, end to
end: ``app.weight_layout``). A run is given as its pieces (consecutive tensors: a
sender's parameter parts, or a generator's slices of staging): chunks are cut from the
pieces' bytes as if they lay end to end, so the digest is the bytes', whatever memory
they sit in, nothing is packed to hash it, the chunks hash in parallel threads
(``hashlib`` releases the GIL) and a CUDA piece is copied to the host a chunk at a time.
Cryptographic on purpose: a checksum (a sum, a CRC) is easy to keep while changing the
weights, and the attacker here chooses the bytes.

Overlapped with the send (``ShardDigest.start``): a trainer rank hashes its shard on a
thread while the shard is on the wire and publishes the record when both are done; a
generator hashes what it received first and then waits for the records (at most
``DigestCheck.wait_s``). Its cost is measured in ``benchmarks/security.py``; it is
optional (``--no-weight-digest``) because at ~100M parameters on a CPU host hashing is
slower than the sync itself.

``LLAMARL_TEST_CORRUPT_WEIGHTS`` is a test hook: a comma-separated list of
``<generator replica>:<version>[:<trainer rank>]``; that generator flips the first byte
received of that version from that trainer rank (0 when not given) before checking it,
as an attacker on the weight plane would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from app import names
from app.signed import SignedStore
from app.transport import Backoff
from app.weight_layout import DEFAULT_BUCKET_MB, Layout
from app.weight_shards import local_parts

log = logging.getLogger("llamarl")

__all__ = ["CHUNK_BYTES", "DigestCheck", "Pending", "ShardDigest", "TEST_CORRUPT_ENV", "digest", "run_pieces"]

CHUNK_BYTES = 16 << 20
"""Bytes hashed per task: large enough that a thread's start is noise, small enough that
a 100M-parameter model splits into ~25 tasks for the threads."""
KEEP_VERSIONS = 4
"""Digest records each trainer rank keeps in the store: a generator checks the version it
just received, which the trainer published at most a send or two ago."""
RECORD_WAIT_S = 60.0
"""How long a generator waits for a trainer rank's record after it hashed what it
received: the rank publishes once its own hash is done, which it started with the send."""
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


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="weight-digest")
    return _pool


def _chunk_digest(pieces: list[torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        host = piece if piece.device.type == "cpu" else piece.to("cpu")
        h.update(host.numpy().data)
    return h.digest()


def digest(runs: Sequence[Run]) -> str:
    """Hex digest of one sender's ``runs`` (in layout order, on any device); see the
    module docstring. The same bytes give the same digest however they are cut in pieces."""
    chunks: list[list[torch.Tensor]] = []
    heads = []
    for run in runs:
        pieces = [run] if isinstance(run, torch.Tensor) else list(run)
        dtypes = {p.dtype for p in pieces}
        if len(dtypes) != 1:
            raise ValueError(f"weight digest: a run's pieces must share one dtype, not {sorted(map(str, dtypes))}")
        heads.append((str(pieces[0].dtype), sum(p.numel() * p.element_size() for p in pieces), len(chunks)))
        chunk: list[torch.Tensor] = []
        room = CHUNK_BYTES
        for piece in pieces:
            raw = piece.detach().reshape(-1).view(torch.uint8)
            at = 0
            while at < raw.numel():
                take = min(room, raw.numel() - at)
                chunk.append(raw[at:at + take])
                at, room = at + take, room - take
                if not room:
                    chunks.append(chunk)
                    chunk, room = [], CHUNK_BYTES
        if chunk:
            chunks.append(chunk)
    hashed = list(_threads().map(_chunk_digest, chunks))
    top = hashlib.sha256(f"llamarl weights v1, chunks of {CHUNK_BYTES}\0".encode())
    for k, (dtype, nbytes, first) in enumerate(heads):
        last = heads[k + 1][2] if k + 1 < len(heads) else len(hashed)
        top.update(f"{dtype}:{nbytes}\0".encode())
        top.update(b"".join(hashed[first:last]))
    return top.hexdigest()


def run_pieces(params: Sequence[tuple[str, torch.Tensor]], layout: Layout) -> list[list[torch.Tensor]]:
    """Each run of ``layout`` as the pieces the sender sends: its parameters (parts), in
    order, as they are (no copy)."""
    return [[params[s.index][1].detach().reshape(-1) for s in run.slots] for run in layout.runs]


def _key_writer(rank: int) -> str:
    return names.member("trainer", rank)


class Pending:
    """A digest being computed on a thread (``ShardDigest.start``); ``publish`` waits for it."""

    def __init__(self, owner: "ShardDigest", version: int, future: Future) -> None:
        self.owner, self.version, self.future = owner, version, future

    def publish(self) -> float:
        """Wait for the hash, publish the signed record; the seconds the hash took."""
        hexdigest, seconds = self.future.result()
        self.owner.publish(self.version, hexdigest)
        return seconds


class ShardDigest:
    """A trainer rank's side: the digest of its shard of each version, published as a
    record it signs. ``params`` as the weight sender holds them (DTensors with several
    ranks); the layout is the sender's run order, fixed here."""

    def __init__(self, signed: SignedStore, params: Sequence[tuple[str, torch.Tensor]], *, rank: int,
                 ranks: int) -> None:
        self.signed, self.params, self.rank, self.ranks = signed, list(params), rank, ranks
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
        """Hash and publish ``version`` before it is sent; the seconds it took."""
        return self.start(version, overlap=False).publish()

    def start(self, version: int, *, overlap: bool = True) -> Pending:
        """Start hashing ``version`` (on a thread of its own when ``overlap``, so the
        caller sends meanwhile; the weights must not change until ``publish``)."""
        runs = self.runs()

        def hashed() -> tuple[str, float]:
            t0 = time.perf_counter()
            return digest(runs), time.perf_counter() - t0

        if not overlap:
            done: Future = Future()
            done.set_result(hashed())
            return Pending(self, version, done)
        global _overlap
        if _overlap is None:
            _overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-digest-send")
        return Pending(self, version, _overlap.submit(hashed))


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
    and logs the first of each reason."""

    def __init__(self, signed: SignedStore, replica: int, *, wait_s: float = RECORD_WAIT_S,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.signed, self.where = signed, names.member("generator", replica)
        self.wait_s, self.should_stop = wait_s, should_stop
        self.counts: Counter[str] = Counter()
        self.refused: dict[int, str] = {}
        """The last refused version's trainer ranks whose shard failed, with the reason."""
        self._reported: dict[str, float] = {}  # what new_counts last returned
        self._corrupt = _corrupt(replica)

    def __call__(self, version: int, senders: Sequence[Sequence[Run]]) -> bool:
        """Whether ``senders`` (for each trainer rank, the runs just received from it for
        ``version``) are the weights the trainer ranks sent."""
        if version in self._corrupt:  # the test hook: one byte altered in flight
            rank = self._corrupt.pop(version)
            first = senders[rank][0]
            piece = next(p for p in ([first] if isinstance(first, torch.Tensor) else first) if p.numel())
            with torch.no_grad():
                piece.view(-1)[:1].view(torch.uint8).bitwise_not_()
        # Hashed first: the records are published as the trainer ranks finish their own hash.
        mine = [digest(runs) for runs in senders]
        failed = {}
        for rank, hexdigest in enumerate(mine):
            expected, reason = self._record(version, rank, len(senders))
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
