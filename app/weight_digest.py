"""A signed digest of every weight version, so a generator refuses weights altered in flight.

gloo and NCCL groups authenticate nothing: whoever can reach the weight plane's ports can
write into a broadcast. So the trainer publishes, for each version it sends, a digest of
the bytes it sends, signed as a frame of ``app.frames`` under the app's secret
(``names.weight_digest_key(version)``); a generator hashes what it received the same way
and takes the version only when the two match. A mismatch (or a record that is missing,
unsigned or for another version) is refused: the generator keeps the version it has,
counts it (``security/weight_digest/<reason>``) and logs the first of each reason.

The digest: SHA-256 over each run's dtype and length and the SHA-256 of each
``CHUNK_BYTES`` slice of it (a run is every parameter of one dtype, end to end:
``app.weight_layout``), so the chunks hash in parallel threads (``hashlib`` releases the
GIL) and a CUDA run is copied to the host one chunk at a time. Cryptographic on purpose:
a checksum (a sum, a CRC) is easy to keep while changing the weights, and the attacker
here chooses the bytes. Its cost is measured in ``benchmarks/security.py``; it is
optional (``--no-weight-digest``) because at ~100M parameters on a CPU host it is not a
few percent of a sync but 1.7 syncs (0.26 s against 0.16 s on 2 cores).

``LLAMARL_TEST_CORRUPT_WEIGHTS`` is a test hook: a comma-separated list of
``<generator replica>:<version>``; that generator flips the bytes of one received value
of that version before checking it, as an attacker on the weight plane would.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.distributed as dist

from app import frames, names
from app.weight_layout import Layout, span_view

log = logging.getLogger("llamarl")

__all__ = ["CHUNK_BYTES", "DigestCheck", "TEST_CORRUPT_ENV", "digest", "publish", "sent_runs"]

CHUNK_BYTES = 16 << 20
"""Bytes hashed per task: large enough that a thread's start is noise, small enough that
a 100M-parameter model splits into ~25 tasks for the threads."""
KEEP_VERSIONS = 4
"""Digest records kept in the store: a generator checks the version it just received,
which the trainer published at most a send or two ago."""
TEST_CORRUPT_ENV = "LLAMARL_TEST_CORRUPT_WEIGHTS"
MISMATCH, NO_RECORD, BAD_RECORD = "mismatch", "no_record", "bad_record"

_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="weight-digest")
    return _pool


def _chunk_digest(chunk: torch.Tensor) -> bytes:
    host = chunk if chunk.device.type == "cpu" else chunk.to("cpu")
    return hashlib.sha256(host.numpy().data).digest()


def digest(runs: Sequence[torch.Tensor]) -> str:
    """Hex digest of ``runs`` (1-d contiguous tensors, the weight plane's runs in layout
    order, on any device); see the module docstring."""
    chunks, heads = [], []
    for run in runs:
        raw = run.detach().reshape(-1).view(torch.uint8)
        heads.append((str(run.dtype), raw.numel(), len(chunks)))
        chunks += [raw[i:i + CHUNK_BYTES] for i in range(0, raw.numel(), CHUNK_BYTES)]
    hashed = list(_threads().map(_chunk_digest, chunks))
    top = hashlib.sha256(f"llamarl weights v1, chunks of {CHUNK_BYTES}\0".encode())
    for k, (dtype, nbytes, first) in enumerate(heads):
        last = heads[k + 1][2] if k + 1 < len(heads) else len(hashed)
        top.update(f"{dtype}:{nbytes}\0".encode())
        top.update(b"".join(hashed[first:last]))
    return top.hexdigest()


def sent_runs(params: Sequence[tuple[str, torch.Tensor]], layout: Layout) -> list[torch.Tensor]:
    """The sender's runs, as the weight plane sends them: a view of each run's flat
    buffer, or (parameters not laid out flat) a packed copy."""
    out = []
    for run in layout.runs:
        device = params[run.slots[0].index][1].device
        view = span_view(run, params, device)
        out.append(view if view is not None else
                   torch.cat([params[s.index][1].detach().reshape(-1) for s in run.slots]))
    return out


def publish(store: dist.Store, secret: bytes, version: int, hexdigest: str) -> None:
    """Trainer replica 0, before it sends ``version``: the signed record generators check."""
    store.set(names.weight_digest_key(version), frames.encode({"version": int(version), "digest": hexdigest}, secret))
    if version >= KEEP_VERSIONS:
        store.delete_key(names.weight_digest_key(version - KEEP_VERSIONS))


def _corrupt_versions(replica: int) -> set[int]:
    """The versions the test hook alters on generator ``replica``."""
    pairs = [item.split(":") for item in os.environ.get(TEST_CORRUPT_ENV, "").split(",") if item.strip()]
    return {int(version) for who, version in pairs if int(who) == replica}


class DigestCheck:
    """A generator's check of each received version against the trainer's signed record;
    counts refusals by reason and logs the first of each."""

    def __init__(self, store: dist.Store, secret: bytes, replica: int) -> None:
        frames.check_secret(secret)
        self.store, self.secret, self.where = store, secret, names.member("generator", replica)
        self.counts: Counter[str] = Counter()
        self._reported: dict[str, float] = {}  # what new_counts last returned
        self._corrupt = _corrupt_versions(replica)

    def __call__(self, version: int, runs: Sequence[torch.Tensor]) -> bool:
        """Whether ``runs`` (just received, for ``version``) are the weights the trainer sent."""
        if version in self._corrupt:  # the test hook: one byte altered in flight
            self._corrupt.discard(version)
            with torch.no_grad():
                runs[0].view(-1)[:1].view(torch.uint8).bitwise_not_()
        expected, reason = self._record(version)
        if expected is not None and digest(runs) != expected:
            reason = MISMATCH
        if reason is None:
            return True
        self.counts[reason] += 1
        if self.counts[reason] == 1:
            log.error("%s: refused weights of version %d (%s): %s; keeping the version it has; "
                      "further refusals are only counted", self.where, version, reason, {
                          MISMATCH: "their digest differs from the trainer's signed one: altered in flight",
                          NO_RECORD: "the trainer published no digest for it",
                          BAD_RECORD: "its digest record is not signed with the app's secret or is "
                                      "not for this version"}[reason])
        return False

    def _record(self, version: int) -> tuple[str | None, str | None]:
        """(the trainer's digest of ``version``, None) or (None, why there is none)."""
        key = names.weight_digest_key(version)
        if not self.store.check([key]):
            return None, NO_RECORD
        try:
            record = frames.decode(self.store.get(key), self.secret)
        except (frames.AuthenticationError, ValueError):
            return None, BAD_RECORD
        if record.get("version") != version or not isinstance(record.get("digest"), str):
            return None, BAD_RECORD
        return record["digest"], None

    def metrics(self) -> dict[str, float]:
        return {names.weight_digest_metric(k): float(n) for k, n in dict(self.counts).items()}

    def new_counts(self) -> dict[str, float]:
        """``metrics()`` when they changed since the last call, else an empty dict."""
        now = self.metrics()
        if now == self._reported:
            return {}
        self._reported = now
        return now
