"""The trainer's side of the weight plane behind one call: ``Publisher.publish(version)``.

Every trainer rank builds one ``Publisher`` at start (``start()`` joins the plane: waits
for the generators to ask in and builds the first epoch) and calls ``publish`` once per
version, all ranks the same versions. One call does, in this order:

1. with the digest on, starts hashing this rank's shard on a thread, which publishes the
   signed digest record as soon as it is hashed (``llamarl.app.weights.digest.ShardDigest``:
   it overlaps the send, and a generator never waits for the record on a resend);
2. on rank 0, publishes the policy version (``Control.set_version``) before the send: a
   generator may push a group of this version as soon as it has the weights, and a
   reader (a reward executor) refuses a version it has not seen published;
3. sends this rank's part of the weights to every generator of the current epoch
   (``llamarl.app.weights.epochs``: rank 0 takes joiners in and regroups around a lost
   generator, resending the same version; ranks > 0 follow its attempts, each sending its
   FSDP2 shard in its own group);
4. waits for that record to be published (a generator hashes what it received first,
   then waits for the record);
5. records what it cost: the ``weight_sync`` and ``weight_digest`` busy intervals of the
   rank's timeline, ``weights/digest_s`` and ``weights/digest_wait_s`` at the version's step,
   and the ``weight_sync`` event of this sender (``trainer/<rank>``: its shard's bytes
   and seconds, the dashboard's per-sender row).

The store keys and the events are those of ``names`` and ``llamarl.app.metrics.events``;
nothing here is new on the wire.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from llamarl.app import names
from llamarl.app.control.runtime import Runtime
from llamarl.app.metrics import events as metrics
from llamarl.app.weights.digest import ShardDigest
from llamarl.app.weights.epochs import ElasticSender, elastic_sender
from llamarl.app.weights.group import SyncStats

__all__ = ["Publisher"]


class Publisher:
    """Trainer rank ``rank`` of ``ranks``: its weights to every generator, one ``publish``
    per version.

    ``params``: the model's parameters as the optimizer updates them (FSDP2 DTensors with
    several ranks, their local shards in one flat buffer per dtype, ``sharding.flatten_shards_``;
    with one, views of one flat buffer per dtype, ``flatten_parameters_``), so each run
    goes out with no copy. ``gone``: on rank 0, the membership's lost members
    (``Membership.gone``), which the plane regroups without; ``None`` on the other ranks.
    ``digest``: sign a digest of every version (``--weight-digest``). ``timeline``: the
    rank's busy and idle intervals, where the sync and the digest wait are recorded.
    """

    def __init__(self, rt: Runtime, params: Sequence[tuple[str, torch.Tensor]], *, rank: int, ranks: int,
                 num_generators: int, timeout_s: float, digest: bool, gone: Callable[[], set[str]] | None,
                 timeline: metrics.Timeline) -> None:
        self.rt, self.rank, self.timeline = rt, rank, timeline
        self.member = names.member("trainer", rank)
        params = list(params)
        self.sender = elastic_sender(rt.signed, params, rank=rank, ranks=ranks, num_generators=num_generators,
                                     timeout_s=timeout_s, gone=gone, should_stop=rt.should_stop)
        # Every rank signs the digest of the shard it sends: no gather for it.
        self.digest = ShardDigest(rt.signed, params, rank=rank, ranks=ranks) if digest else None

    @property
    def regroups(self) -> int:
        """Epochs built after the first (rank 0 builds them; 0 on the other ranks)."""
        return self.sender.regroups if isinstance(self.sender, ElasticSender) else 0

    def start(self) -> None:
        """Join the weight plane: on rank 0, once every generator still alive asked to join
        (waits up to ``epochs.JOIN_TIMEOUT_S``); elsewhere, after telling the other ranks
        where this rank's weights live."""
        self.sender.start()

    def publish(self, version: int) -> SyncStats:
        """The current weights to every generator as ``version``, with its signed digest;
        returns this rank's stats (what its ``weight_sync`` event records, and the digest's
        seconds when it is on). The weights must not change until it returns."""
        pending = self.digest.start(version) if self.digest is not None else None
        if self.rank == 0:
            self.rt.control.set_version(version)
        with self.timeline.busy("weight_sync"):
            stats = self.sender.send(version)
        if pending is not None:
            t0 = time.perf_counter()
            with self.timeline.busy("weight_digest"):
                stats.hashed_s = pending.wait()
            stats.digest_wait_s = time.perf_counter() - t0
            self.rt.emit(metrics.scalars({names.WEIGHT_DIGEST_S: stats.hashed_s,
                                          names.WEIGHT_DIGEST_WAIT_S: stats.digest_wait_s},
                                         role="trainer", replica=self.rank, step=version))
        self.rt.emit([metrics.weight_sync(stats.version, self.member, stats.bytes, stats.seconds)])
        return stats
