"""The weight plane across membership changes: one weight group per epoch.

``app.weight_sync`` is one fixed process group: a member that dies breaks it for good
(gloo and NCCL groups cannot shrink). Here the trainer builds a new group whenever the
generators change, an *epoch*: the roster of epoch N (the generators, in rank order) is
published under ``weights/roster/<N>`` and the group rendezvouses under
``weights/<N>`` (``names.weight_epoch_prefix``), so no key of an old group is read by a
new one.

- ``ElasticSender`` (trainer replica 0): ``send(version)``. When a send fails it waits
  until ``app.membership`` has taken the dead generator out (or a generator asked to
  rejoin), builds the next epoch among the survivors and sends the same version again.
  A generator that asks to join (a restarted replica, or a survivor whose receive broke)
  is taken in at the next send: it rejoins at the next weight version. With no generator
  left: ``NoGeneratorsLeft``.
- ``ElasticReceiver`` (a generator): asks to join (``names.weight_joins_key``: a token
  of the request and the newest epoch it was in), waits for an epoch whose roster holds
  it, receives there in a background thread until a newer epoch is announced or a
  receive fails, then asks again. A newer epoch abandons a receive blocked in the old
  group at once, instead of at the group's timeout. ``swap_if_newer`` and
  friends are ``WeightReceiver``'s, on the current epoch.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from app import names
from app.transport import Backoff, Stopped
from app.weight_sync import (
    SyncStats,
    WeightLayoutError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    init_weight_group,
    stop_thread,
)

log = logging.getLogger("llamarl")

__all__ = ["ElasticReceiver", "ElasticSender", "NoGeneratorsLeft"]

JOIN_TIMEOUT_S = 900.0
"""A generator waits this long for an epoch that takes it in (the trainer may still be
warm-starting the policy, or waiting for the other generators at start)."""


class NoGeneratorsLeft(RuntimeError):
    """Every generator is gone: nothing can make rollouts any more."""


def _device_of(params: list[tuple[str, torch.Tensor]]) -> torch.device:
    """Where a member's weights live: what it tells the others when a group is built
    (``init_weight_group`` picks NCCL or gloo from every member's)."""
    if not params:
        raise ValueError("the weight plane needs at least one parameter")
    return params[0][1].device


def _plane_store(store: dist.Store) -> dist.Store:
    return dist.PrefixStore(names.WEIGHT_PLANE_PREFIX, store)


class ElasticSender:
    """Trainer replica 0's side of the weight plane, over as many epochs as it takes.

    ``gone()`` names the members taken out of the run (``Membership.gone``);
    ``should_stop`` ends every wait.
    """

    def __init__(self, store: dist.Store, params: Sequence[tuple[str, torch.Tensor]], *,
                 num_generators: int, timeout_s: float, gone: Callable[[], set[str]],
                 should_stop: Callable[[], bool], gone_wait_s: float = 15.0) -> None:
        self.store, self.plane = store, _plane_store(store)
        self.params, self.num_generators, self.timeout_s = list(params), num_generators, timeout_s
        self.gone, self.should_stop, self.device = gone, should_stop, _device_of(self.params)
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
            key = names.weight_joins_key(r)
            if self.plane.check([key]):
                token, epoch = self.plane.get(key).decode().split()
                out[r] = (token, int(epoch))
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
        self._regroup(alive)

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
                self._retired.append(self._sender)
                self._sender = None
            self.epoch += 1
            self.plane.set(names.weight_roster_key(self.epoch), json.dumps(roster))
            self.plane.set(names.WEIGHT_EPOCH_KEY, str(self.epoch))
            try:
                group = init_weight_group(self.store, rank=0, world_size=len(roster) + 1, device=self.device,
                                          timeout_s=self.timeout_s, prefix=names.weight_epoch_prefix(self.epoch),
                                          should_stop=self.should_stop)
                self._sender = WeightSender(group, self.params)
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
        """The generators of ``roster`` that reached the current epoch's rendezvous."""
        group_store = dist.PrefixStore(names.weight_epoch_prefix(self.epoch), self.store)
        return [r for i, r in enumerate(roster) if group_store.check([names.weight_rank_present_key(i + 1)])]

    def send(self, version: int) -> SyncStats:
        """Broadcast ``version`` to every generator in the plane, regrouping first when one
        asked to join, and again (then resending) when a generator is lost mid-send."""
        if joiners := self.joiners():
            log.info("generators %s join the weight plane at version %d", joiners, version)
            self._regroup(self.roster + joiners)
        while True:
            try:
                return self._sender.send(version)
            except WeightLayoutError:
                raise
            except WeightSyncError as e:
                left = self._wait_for_change(e)
                log.warning("weight sync of version %d failed (%s); regrouping among generators %s",
                            version, str(e).splitlines()[0][:200], left)
                self._regroup(left)

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


class ElasticReceiver:
    """A generator's side of the weight plane, across epochs (see the module docstring)."""

    def __init__(self, store: dist.Store, replica: int, params: Sequence[tuple[str, torch.Tensor]], *,
                 timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        # Its own connection: the epoch polls never queue behind the generator's other calls.
        plane_conn = store.clone() if isinstance(store, dist.TCPStore) else store
        self.store, self.plane, self.replica = store, _plane_store(plane_conn), replica
        self.params, self.timeout_s = list(params), timeout_s
        self.device = _device_of(self.params)
        self.join_timeout_s = join_timeout_s
        self.epoch = 0
        """The newest epoch this generator was in (0: none yet)."""
        self._current: WeightReceiver | None = None
        self._retired_version: int | None = None
        self._retired: list[WeightReceiver] = []
        self._lock = threading.Lock()
        self._stats: list[SyncStats] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _newest_epoch(self) -> int:
        return int(self.plane.get(names.WEIGHT_EPOCH_KEY)) if self.plane.check([names.WEIGHT_EPOCH_KEY]) else 0

    def _wait_for_epoch(self, should_stop: Callable[[], bool]) -> tuple[int, list[int]]:
        """The newest epoch after this one whose roster holds this generator."""
        deadline = time.monotonic() + self.join_timeout_s
        backoff = Backoff(first_s=0.005, max_s=0.05)
        while True:
            epoch = self._newest_epoch()
            if epoch > self.epoch:
                roster = json.loads(self.plane.get(names.weight_roster_key(epoch)))
                if self.replica in roster:
                    return epoch, roster
            if should_stop():
                raise Stopped("stopped while waiting to join the weight plane")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"generator {self.replica}: the trainer took it into no weight group "
                                      f"within {self.join_timeout_s:g} s")
            time.sleep(backoff.next())

    def _run(self, should_stop: Callable[[], bool]) -> None:
        stop = lambda: self._stop.is_set() or should_stop()  # noqa: E731
        try:
            while not stop():
                self.plane.set(names.weight_joins_key(self.replica), f"{secrets.token_hex(8)} {self.epoch}")
                epoch, roster = self._wait_for_epoch(stop)
                self.epoch = epoch
                next_roster = names.weight_roster_key(epoch + 1)  # epochs are consecutive
                newer = lambda: self.plane.check([next_roster])  # noqa: E731
                try:
                    group = init_weight_group(self.store, rank=roster.index(self.replica) + 1,
                                              world_size=len(roster) + 1, device=self.device,
                                              timeout_s=self.timeout_s, prefix=names.weight_epoch_prefix(epoch),
                                              should_stop=lambda: stop() or newer())
                    group.abandoned = threading.Event()
                    receiver = WeightReceiver(group, self.params)
                except WeightLayoutError:
                    raise
                except (WeightSyncError, Stopped) as e:
                    if stop():
                        return
                    log.warning("weight plane epoch %d: could not join (%s); asking again", epoch, e)
                    continue
                with self._lock:
                    self._retire()
                    self._current = receiver
                # A newer epoch while a receive of this one is blocked: give it up (the
                # trainer has left this group; a peer of it may be dead).
                received = threading.Event()
                watchdog = threading.Thread(target=self._abandon_when,
                                            args=(group, lambda: stop() or newer(), received),
                                            daemon=True, name=f"weight-plane-watch-{self.replica}")
                watchdog.start()
                try:
                    error = receiver.receive_until(lambda: stop() or newer())
                finally:
                    # Joined: a daemon thread inside a store call at exit aborts the process.
                    received.set()
                    watchdog.join()
                if isinstance(error, WeightLayoutError):
                    raise error
                if error is not None and not stop():  # the generator goes on with the weights it has
                    log.warning("weight plane epoch %d broke (%s): asking to join the next one", epoch,
                                str(error).splitlines()[0][:200])
        except Stopped:
            return
        except BaseException as e:  # raised to the generator by swap_if_newer()
            self._error = e

    @staticmethod
    def _abandon_when(group, condition: Callable[[], bool], received: threading.Event) -> None:
        """Give ``group`` up once ``condition()``, unless its receive loop ended first."""
        while not received.wait(0.05):
            if condition():
                group.abandoned.set()
                return

    def _retire(self) -> None:
        """Keep the stats and the newest version of the receiver being replaced (its staged
        weights go with it: the next epoch starts by resending the newest version)."""
        if self._current is not None:
            self._stats += self._current.pop_stats()
            staged = _staged(self._current)
            self._retired_version = staged if staged is not None else self._retired_version
            # Kept: an abandoned receive may still write into its staging buffers until
            # the group's timeout, and its backend's destructor would wait for it.
            self._retired.append(self._current)
            self._current = None

    # --- the generator's calls -----------------------------------------------------------
    def start_background(self, should_stop: Callable[[], bool]) -> None:
        self._thread = threading.Thread(target=self._run, args=(should_stop,), daemon=True,
                                        name=f"weight-plane-{self.replica}")
        self._thread.start()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WeightSyncError(f"weight plane of generator {self.replica} failed: {self._error}") from self._error

    def swap_if_newer(self) -> int | None:
        """``WeightReceiver.swap_if_newer`` of the current epoch; a broken epoch is this
        class's business (it rejoins), not the generator's: ``None`` meanwhile."""
        self._raise_if_failed()
        with self._lock:
            current = self._current
        try:
            return current.swap_if_newer() if current is not None else None
        except WeightSyncError:
            return None

    def latest_version(self) -> int | None:
        """The newest version received, in this epoch or an earlier one."""
        self._raise_if_failed()
        with self._lock:
            current = self._current
        staged = _staged(current) if current is not None else None
        return staged if staged is not None else self._retired_version

    def pop_stats(self) -> list[SyncStats]:
        with self._lock:
            out, self._stats = self._stats, []
            if self._current is not None:
                out += self._current.pop_stats()
        return out

    def stop_background(self, timeout_s: float = 10.0) -> None:
        self._thread = stop_thread(self._thread, self._stop, timeout_s, "the weight plane's receiver thread")


def _staged(receiver: WeightReceiver) -> int | None:
    """The newest version ``receiver`` holds complete; a broken epoch's still counts."""
    try:
        return receiver.latest_version()
    except WeightSyncError:
        return receiver._staged_version
