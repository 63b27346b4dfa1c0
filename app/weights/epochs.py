"""The weight plane across membership changes: one weight group per epoch.

``llamarl.app.weights.group`` is one fixed process group: a member that dies breaks it for good
(gloo and NCCL groups cannot shrink). Here the trainer builds new groups whenever the
generators change, an *epoch*: the roster of epoch N (the generators, in rank order, and
the number of trainer ranks that send) is published under ``weights/roster/<N>`` and the
group of trainer rank r rendezvouses under ``weights/<N>/<r>`` (``names.weight_epoch_prefix``),
so no key of an old group is read by a new one. With N trainer ranks (FSDP2) each sends
its own shard in its own group; every generator is in all of them. The epoch, the rosters,
the join requests and the trainer ranks' attempts, results and verdicts are records
signed by their writer (``llamarl.app.control.signed``): one someone else wrote moves no member. So are
the keys llamarl writes inside each group's prefix (``llamarl.app.weights.group``): each rank's
presence and device (``present/<rank>``), its layout document (``layout/<n>/<rank>``) and
the sender's sync announcements (``syncs/<n>``), each readable only as the record of the
member at that rank (``group_members``); a forged one is ignored, counted under
``security/rejected_writes/weights`` and waited past, and an overwritten one is
re-published by its writer. What cannot be signed is the backend's own rendezvous,
written by torch inside ``ProcessGroupGloo``/``ProcessGroupNCCL`` through the same prefix
store: gloo's ``<gloo device index>/<rank>`` (each rank's listening address; seen on
torch 2.13 through a store that logs its calls), NCCL's ``<communicator counter>`` (the
``ncclUniqueId``, rank 0's bootstrap address: ``broadcastUniqueNCCLID``), and whatever
else a backend keeps there. They are read inside the C++ constructor, before llamarl
could check anything, and their format is the backend's. A forged address there makes a member connect to the forger: the group then
fails and the plane regroups, or the forger takes part in its traffic (reads the
weights, or sends bytes the weight digest refuses). That, and the unauthenticated,
unencrypted traffic itself, is why the weight plane belongs on a private network
(docs/security.md).

- ``ElasticSender`` (trainer replica 0, the only one that knows who is alive):
  ``send(version)``. When a send fails it waits
  until ``llamarl.app.control.membership`` has taken the dead generator out (or a generator asked to
  rejoin), builds the next epoch among the survivors and sends the same version again.
  A generator that asks to join (a restarted replica, or a survivor whose receive broke)
  is taken in at the next send: it rejoins at the next weight version. With no generator
  left: ``NoGeneratorsLeft``.
- a generator's side is its ``Subscriber`` (``llamarl.app.weights.subscriber``): it asks to
  join (``names.weight_joins_key``: a token of the request and the newest epoch it was
  in), waits for an epoch whose roster holds it, receives there in a background thread
  until a newer epoch is announced or a receive fails, then asks again. A newer epoch
  abandons a receive blocked in the old group at once, instead of at the group's timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from llamarl.app import devices
from llamarl.app import names
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.transport import Backoff, Stopped
from llamarl.app.weights.group import SyncStats, WeightLayoutError, WeightSyncError, init_weight_group
from llamarl.app.weights.sender import WeightSender

log = logging.getLogger("llamarl")

__all__ = ["JOIN_TIMEOUT_S", "ElasticSender", "NoGeneratorsLeft", "ShardFollower", "elastic_sender", "group_members",
           "plane_store", "weights_device"]

JOIN_TIMEOUT_S = 900.0
"""A generator waits this long for an epoch that takes it in (the trainer may still be
warm-starting the policy, or waiting for the other generators at start)."""


class NoGeneratorsLeft(RuntimeError):
    """Every generator is gone: nothing can make rollouts any more."""


def weights_device(params: list[tuple[str, torch.Tensor]]) -> torch.device:
    """Where a member's weights live: what it tells the others when a group is built
    (``init_weight_group`` picks NCCL or gloo from every member's)."""
    if not params:
        raise ValueError("the weight plane needs at least one parameter")
    return params[0][1].device


def plane_store(signed: SignedStore) -> SignedStore:
    return signed.prefixed(names.WEIGHT_PLANE_PREFIX)


def group_members(sender: int, generators: Sequence[int]) -> list[str]:
    """The member id of each rank of trainer rank ``sender``'s weight group: the only
    writer of that rank's keys there (``init_weight_group``)."""
    return [names.member("trainer", sender)] + [names.member("generator", r) for r in generators]


def _wait_for(plane: SignedStore, key: str, timeout_s: float, should_stop: Callable[[], bool],
              what: str, writer: str) -> str:
    """The value ``writer`` signed at ``key`` once it is there: ``WeightSyncError`` after
    ``timeout_s``, ``Stopped`` once ``should_stop()``."""
    try:
        # At most 10 ms late: the ranks meet here on every sync, right after sending.
        return str(plane.wait(key, timeout_s, what, writers=(writer,), should_stop=should_stop, poll_s=0.01))
    except TimeoutError:
        raise WeightSyncError(f"weight plane: waited {timeout_s:g} s for {what}") from None


def _trainer_device_key(plane: SignedStore, rank: int, ranks: int, device: torch.device,
                        should_stop: Callable[[], bool]) -> str:
    """What the trainer, as one weight-plane member, tells every group it is in: the
    devices of all its ranks (``devices.joint_key``), so that the groups of all trainer
    ranks choose the same path. Every trainer rank publishes its own and reads the others'."""
    mine = devices.device_key(device)
    if ranks == 1:
        return mine
    plane.put(names.weight_trainer_device_key(rank), mine)
    keys = [_wait_for(plane, names.weight_trainer_device_key(r), JOIN_TIMEOUT_S, should_stop,
                      f"trainer rank {r} to say where its weights are", names.member("trainer", r))
            for r in range(ranks)]
    return devices.joint_key(keys)


def elastic_sender(signed: SignedStore, params: Sequence[tuple[str, torch.Tensor]], *, rank: int, ranks: int,
                   num_generators: int, timeout_s: float, gone: Callable[[], set[str]] | None,
                   should_stop: Callable[[], bool]) -> ElasticSender | ShardFollower:
    """Trainer rank ``rank`` of ``ranks``'s side of the weight plane: the leader on rank 0
    (``gone``: the membership's lost members), a follower elsewhere. Every rank calls
    ``start()`` once and ``send(version)`` for every version, all ranks the same versions."""
    if rank == 0:
        if gone is None:
            raise ValueError("trainer rank 0 leads the weight plane: it needs the membership's gone()")
        return ElasticSender(signed, params, num_generators=num_generators, timeout_s=timeout_s, gone=gone,
                             should_stop=should_stop, ranks=ranks)
    return ShardFollower(signed, params, rank=rank, ranks=ranks, timeout_s=timeout_s, should_stop=should_stop)


class ElasticSender:
    """Trainer replica 0's side of the weight plane, over as many epochs as it takes.

    ``gone()`` names the members taken out of the run (``Membership.gone``);
    ``should_stop`` ends every wait.
    """

    def __init__(self, signed: SignedStore, params: Sequence[tuple[str, torch.Tensor]], *,
                 num_generators: int, timeout_s: float, gone: Callable[[], set[str]],
                 should_stop: Callable[[], bool], gone_wait_s: float = 15.0, ranks: int = 1) -> None:
        self.signed, self.plane = signed, plane_store(signed)
        self.ranks = ranks
        """Trainer ranks that send (each its shard); ranks > 0 follow this one's attempts."""
        self.attempts = 0
        self.params, self.num_generators, self.timeout_s = list(params), num_generators, timeout_s
        self.gone, self.should_stop, self.device = gone, should_stop, weights_device(self.params)
        self.device_key: str | None = None
        """The trainer's devices as one weight-plane member (set by ``start``)."""
        self.gone_wait_s = gone_wait_s
        """After a failed send: how long to wait for the dead generator to be taken out."""
        self.epoch = 0
        self.roster: list[int] = []
        self.regroups = 0
        """Epochs built after the first."""
        self.last_regroup_at: float | None = None
        """``time.time()`` when the newest epoch after the first was ready."""
        self._answered: dict[int, str] = {}  # the join request each generator's roster entry answered
        self._sender: WeightSender | None = None
        self._retired: list[WeightSender] = []

    # --- who is in ---------------------------------------------------------------------
    def _requests(self) -> dict[int, tuple[str, int]]:
        """Each generator's newest join request: (its token, the newest epoch it was in)."""
        out = {}
        for r in range(self.num_generators):
            request = self.plane.get(names.weight_joins_key(r), writers=(names.member("generator", r),))
            if (isinstance(request, dict) and isinstance(request.get("token"), str)
                    and isinstance(request.get("epoch"), int)):
                out[r] = (request["token"], request["epoch"])
        return out

    def _alive(self, replica: int) -> bool:
        return names.member("generator", replica) not in self.gone()

    def joiners(self) -> list[int]:
        """Generators whose newest request the current epoch does not answer: one not in
        it, one that was in it and broke, or a new process (it was in no epoch yet)."""
        return [r for r, (token, was_in) in self._requests().items()
                if self._alive(r) and token != self._answered.get(r)
                and (r not in self.roster or was_in >= self.epoch or was_in == 0)]

    def start(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """The first epoch, once every generator still alive asked to join (one lost
        while starting is not waited for)."""
        self.device_key = _trainer_device_key(self.plane, 0, self.ranks, self.device, self.should_stop)
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(first_s=0.005, max_s=0.1)
        while True:
            alive = [r for r in range(self.num_generators) if self._alive(r)]
            missing = sorted(set(alive) - set(self.joiners()))
            if alive and not missing:
                break
            if self.should_stop():
                raise Stopped("stopped while waiting for the generators to join the weight plane")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weight plane: generators {missing} did not join within {timeout_s:g} s")
            time.sleep(backoff.next())
        try:
            self._regroup(alive)
        except BaseException as e:
            self._fail_followers(e)
            raise

    # --- epochs ------------------------------------------------------------------------
    def _regroup(self, roster: list[int]) -> None:
        """Build the next epoch's group among ``roster`` (those missing at its rendezvous
        are left out, until they ask again)."""
        while True:
            roster = sorted(r for r in roster if self._alive(r))
            if not roster:
                raise NoGeneratorsLeft("no generator is left in the weight plane: every generator is gone "
                                       "(killed, out of memory, or its node was lost)")
            requests = self._requests()
            for r in roster:
                self._answered[r] = requests.get(r, ("", 0))[0]
            if self._sender is not None:
                # Kept until the run ends: a collective it started may still be running in
                # the backend's thread, which a destructor would wait for.
                self._sender.group.forget_keys()
                self._retired.append(self._sender)
                self._sender = None
            self.epoch += 1
            self.plane.put(names.weight_roster_key(self.epoch), {"generators": roster, "senders": self.ranks})
            self.plane.put(names.WEIGHT_EPOCH_KEY, self.epoch, keep=True)  # re-published if overwritten
            try:
                group = init_weight_group(self.signed, rank=0, world_size=len(roster) + 1, device=self.device,
                                          timeout_s=self.timeout_s, prefix=names.weight_epoch_prefix(self.epoch),
                                          should_stop=self.should_stop, device_key=self.device_key,
                                          members=group_members(0, roster))
                self._sender = WeightSender(group, self.params, rank=0, ranks=self.ranks)
            except WeightLayoutError:
                raise
            except WeightSyncError as e:
                present = self._present(roster)
                log.error("weight plane epoch %d: %s; regrouping without generators %s", self.epoch, e,
                          sorted(set(roster) - set(present)))
                roster = present
                continue
            if self.epoch > 1:
                self.regroups += 1
                self.last_regroup_at = time.time()
            self.roster = roster
            log.info("weight plane epoch %d: generators %s, %s (%s)", self.epoch, roster,
                     group.path.backend, group.path.reason)
            return

    def _present(self, roster: list[int]) -> list[int]:
        """The generators of ``roster`` that reached the current epoch's rendezvous (their
        own record of it: a forged one does not keep a missing generator in)."""
        group = self.signed.prefixed(names.weight_epoch_prefix(self.epoch, 0))
        return [r for i, r in enumerate(roster) if group.record(names.weight_rank_present_key(i + 1),
                                                                 writers=(names.member("generator", r),)) is not None]

    def send(self, version: int) -> SyncStats:
        """Broadcast ``version`` (this rank's shard of it) to every generator in the plane,
        regrouping first when one asked to join, and again (then resending) when a
        generator is lost mid-send; with several trainer ranks, for all of them."""
        try:
            if joiners := self.joiners():
                log.info("generators %s join the weight plane at version %d", joiners, version)
                self._regroup(self.roster + joiners)
            while True:
                self.attempts += 1
                if self.ranks > 1:
                    self.plane.put(names.weight_attempt_key(self.attempts), str(self.epoch))
                try:
                    stats = self._sender.send(version)
                    error = None
                except WeightLayoutError:
                    raise
                except WeightSyncError as e:
                    error = e
                error = self._followers_outcome(version) or error
                if error is None:
                    self._verdict("done")
                    return stats
                left = self._wait_for_change(error)
                log.warning("weight sync of version %d failed (%s); regrouping among generators %s",
                            version, str(error).splitlines()[0][:200], left)
                self._regroup(left)
                self._verdict("retry")
        except BaseException as e:
            self._fail_followers(e)
            raise

    def _fail_followers(self, error: BaseException) -> None:
        """Tell the other trainer ranks this rank gave up: they wait on the current
        attempt's verdict, or on the next attempt."""
        if self.ranks > 1:
            why = f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            self._verdict(why)
            self.plane.put(names.weight_attempt_key(self.attempts + 1), why)

    def _verdict(self, verdict: str) -> None:
        key = names.weight_attempt_verdict_key(self.attempts)
        if self.ranks > 1 and self.attempts and self.plane.record(key, writers=(CONTROLLER,)) is None:
            self.plane.put(key, verdict)

    def _followers_outcome(self, version: int) -> WeightSyncError | None:
        """The other trainer ranks' outcome of the current attempt: ``None`` when each sent
        its shard, else the first failure (``WeightLayoutError`` raised at once)."""
        for rank in range(1, self.ranks):
            # A rank's send fails at the latest at its group's timeout; building its group
            # for a new epoch may take another one.
            outcome = _wait_for(self.plane, names.weight_attempt_result_key(self.attempts, rank),
                                2 * self.timeout_s + 30.0, self.should_stop,
                                f"trainer rank {rank} to send its shard of version {version}",
                                names.member("trainer", rank))
            if outcome.startswith("layout: "):
                raise WeightLayoutError(f"trainer rank {rank}: {outcome.removeprefix('layout: ')}")
            if outcome != "ok":
                return WeightSyncError(f"trainer rank {rank}'s shard of version {version}: {outcome}")
        return None

    def _wait_for_change(self, error: WeightSyncError) -> list[int]:
        """After a failed send: the roster to regroup once a generator of this one is
        taken out or asks to join again; ``error`` if neither happens in ``gone_wait_s``."""
        deadline = time.monotonic() + self.gone_wait_s
        while True:
            lost = [r for r in self.roster if not self._alive(r)]
            joiners = self.joiners()
            if lost or joiners:
                return sorted(set(self.roster) - set(lost) | set(joiners))
            if self.should_stop():
                raise Stopped("stopped while regrouping the weight plane")
            if time.monotonic() > deadline:
                raise error
            time.sleep(0.1)


class ShardFollower:
    """A trainer rank > 0's side of the weight plane: sends its shard of every version in
    the epoch trainer rank 0 names for each attempt, in a weight group of its own with
    every generator of that epoch, and reports how it went (``ElasticSender`` leads)."""

    def __init__(self, signed: SignedStore, params: Sequence[tuple[str, torch.Tensor]], *, rank: int, ranks: int,
                 timeout_s: float, should_stop: Callable[[], bool],
                 lead_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        if not 0 < rank < ranks:
            raise ValueError(f"a shard follower is a trainer rank > 0, not {rank} of {ranks}")
        self.signed, self.plane = signed, plane_store(signed)
        self.params, self.rank, self.ranks = list(params), rank, ranks
        self.timeout_s, self.should_stop = timeout_s, should_stop
        self.device = weights_device(self.params)
        self.device_key: str | None = None
        self.lead_timeout_s = lead_timeout_s
        """How long to wait for rank 0's next attempt or verdict (it may be waiting for
        generators to start, or for a lost one to be taken out, or rebuilding groups)."""
        self.epoch = 0
        self.attempts = 0
        self._sender: WeightSender | None = None
        self._retired: list[WeightSender] = []  # as ElasticSender's: a destructor would wait

    def start(self) -> None:
        """Where the trainer's weights are, with the other ranks; rank 0 names the first
        epoch at the first send."""
        self.device_key = _trainer_device_key(self.plane, self.rank, self.ranks, self.device, self.should_stop)

    def _join(self, epoch: int) -> None:
        roster = self.plane.get(names.weight_roster_key(epoch), writers=(CONTROLLER,))
        if not isinstance(roster, dict) or roster.get("senders") != self.ranks:
            raise WeightLayoutError(f"weight plane epoch {epoch} has {roster['senders']} trainer ranks "
                                    f"sending; this is rank {self.rank} of {self.ranks}")
        if self._sender is not None:
            self._sender.group.forget_keys()
            self._retired.append(self._sender)
            self._sender = None
        self.epoch = epoch
        group = init_weight_group(self.signed, rank=0, world_size=len(roster["generators"]) + 1,
                                  device=self.device, timeout_s=self.timeout_s,
                                  prefix=names.weight_epoch_prefix(epoch, self.rank), should_stop=self.should_stop,
                                  device_key=self.device_key, members=group_members(self.rank, roster["generators"]))
        self._sender = WeightSender(group, self.params, rank=self.rank, ranks=self.ranks)

    def send(self, version: int) -> SyncStats:
        stats = None
        while True:
            self.attempts += 1
            epoch = _wait_for(self.plane, names.weight_attempt_key(self.attempts), self.lead_timeout_s,
                              self.should_stop, f"trainer rank 0 to start sending version {version}", CONTROLLER)
            if epoch.startswith("failed"):
                raise WeightSyncError(f"trainer rank 0 gave up the weight sync of version {version}: {epoch}")
            try:
                if int(epoch) != self.epoch or self._sender is None:
                    self._join(int(epoch))
                stats = self._sender.send(version)
                outcome = "ok"
            except WeightLayoutError as e:
                outcome = f"layout: {e}"
            except WeightSyncError as e:
                outcome = f"failed: {str(e).splitlines()[0][:300]}"
            self.plane.put(names.weight_attempt_result_key(self.attempts, self.rank), outcome)
            verdict = _wait_for(self.plane, names.weight_attempt_verdict_key(self.attempts), self.lead_timeout_s,
                                self.should_stop, f"trainer rank 0's verdict on version {version}", CONTROLLER)
            if verdict == "done":
                return stats
            if verdict != "retry":
                raise WeightSyncError(f"trainer rank 0 gave up the weight sync of version {version}: {verdict}")
            log.warning("weight sync of version %d: resending in a new epoch (%s)", version, outcome)
