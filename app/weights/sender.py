"""The sending end of a weight group (``llamarl.app.weights.group``): a trainer rank
broadcasts its part of the policy's weights as one version.

A run that is one slice of a flat buffer goes out whole, with no copy (what the trainer
does: one rank's parameters by ``flatten_parameters_``, an FSDP2 rank's shards by
``llamarl.app.rl.sharding.flatten_shards_``), in slices of one bucket's bytes
(``whole_cuts``: a generator hashes each as it lands, ``llamarl.app.weights.digest``,
instead of the whole run after it); any other run (parts in allocations of their own, or
with FSDP2's padding between them) goes bucket by bucket: a part of ``alone_mb`` or more (``DEFAULT_ALONE_MB``) goes as it
is, with no copy, and the smaller parts between them are packed, a bucket of them into
one of two packing buffers kept for the sender's life, while the bucket before it is on
the wire. Each broadcast has a fixed cost on the sender and on every generator (a
collective's setup and its wake-ups), so the many small parts (norms, biases, a small
model's matrices) travel a bucket at a time; the large ones are not worth a copy, which
costs more than their broadcast on a host whose cores are busy with the transfer.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from llamarl.app.weights.group import (
    SyncStats,
    WeightGroup,
    WeightLayoutError,
    announce,
    check_same_model,
    full_entries,
    handshake,
    host_or_device,
    sync_failures,
    whole_cuts,
)
from llamarl.app.weights.layout import DEFAULT_ALONE_MB, DEFAULT_BUCKET_MB, Layout, pack, span_view
from llamarl.app.weights.shards import local_parts

__all__ = ["WeightSender"]

_RING = 2  # packing buffers: one bucket is packed while the one before it is on the wire


class WeightSender:
    """Rank 0 of a weight group: broadcasts this trainer rank's part of ``params`` on ``send``.

    ``params`` are kept as given (not detached copies), so a sync always reads the tensors'
    current storage: a run is sent from its flat buffer while it is one, packed otherwise.
    With ``ranks`` > 1 trainer ranks, each rank has a group of its own to every generator
    and sends only its shard (``llamarl.app.weights.shards``: FSDP2's DTensors, sharded on dim 0);
    the generators assemble the full weights. One rank sends the full tensors.
    ``alone_mb``: parts of this size or more (up to a bucket's) go as they are, unpacked;
    the receivers read it from the layout handshake.
    """

    def __init__(self, group: WeightGroup, params: Sequence[tuple[str, torch.Tensor]],
                 bucket_mb: float = DEFAULT_BUCKET_MB, *, rank: int = 0, ranks: int = 1,
                 alone_mb: float = DEFAULT_ALONE_MB) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight sender must be rank 0 of the weight group, not {group.rank}")
        self.group = group
        self.params = list(params)
        self.rank, self.ranks = rank, ranks
        local, self.shards = local_parts(self.params, rank, ranks)
        if alone_mb <= 0:
            raise ValueError(f"weight sender: alone_mb must be > 0, not {alone_mb}")
        self.layout = Layout(local, int(bucket_mb * 2**20), int(min(alone_mb, bucket_mb) * 2**20))
        entries = full_entries(self.layout, self.shards)
        doc = {"fingerprint": self.layout.fingerprint, "bucket_bytes": self.layout.bucket_bytes,
               "alone_bytes": self.layout.alone_bytes, "params": self.layout.entries,
               "shards": self.shards.describe()}
        for r, theirs in enumerate(handshake(group, doc), start=1):
            check_same_model(group, entries, theirs["params"], r)
        # Packing buffers, for the sender's life: as large as the largest bucket of several
        # parts in a run that is not one flat buffer (a flattened model never packs; a
        # lone part that is not one contiguous tensor grows them at its first sync).
        packed = max((b.nbytes for run in self.layout.runs if span_view(run, local, group.device) is None
                      for b in run.buckets if len(b.slots) > 1), default=0)
        self._ring = [host_or_device(group, packed, torch.uint8) for _ in range(_RING)]
        self.zero_copy_buckets = 0
        """Buckets of the last sync that went out without packing (for tests and benchmarks)."""
        self.broadcasts = 0
        """Broadcasts of the last sync's bytes, its header not counted (for tests and benchmarks)."""

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
        with sync_failures(g, lambda: f"weight sync of version {version} to {g.world_size - 1} generator(s)",
                           "a generator is gone or stopped receiving. The weight group is unusable now"):
            params = self._local()
            announce(g, version)
            views = [span_view(run, params, g.device) for run in layout.runs]
            whole = sum(1 << r for r, view in enumerate(views) if view is not None)
            header = torch.tensor([version, layout.fingerprint, whole], dtype=torch.int64,
                                  device=g.device)
            works = [g.broadcast(header)]
            ring_works: list[dist.Work | None] = [None] * _RING  # last broadcast from each buffer
            packed = zero_copy = 0
            for run, view in zip(layout.runs, views):
                if view is not None:
                    works += [g.broadcast(view[a:b]) for a, b in whole_cuts(run, layout.bucket_bytes)]
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
        self.zero_copy_buckets, self.broadcasts = zero_copy, len(works) - 1 + packed
        g.syncs += 1
        return SyncStats(version=int(version), bytes=layout.nbytes,
                         seconds=time.perf_counter() - t0)

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        if self._ring[k].numel() < nbytes:
            self._ring[k] = host_or_device(self.group, nbytes, torch.uint8)
        return self._ring[k]

