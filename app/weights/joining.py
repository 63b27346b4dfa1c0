"""A generator's side of the weight plane's epochs (``llamarl.app.weights.epochs``): it asks
to join (``names.weight_joins_key``: a token of the request and the newest epoch it was
in), waits for an epoch whose roster holds it, receives there in a background thread
(``llamarl.app.weights.receiver``) until a newer epoch is announced or a receive fails, then
asks again. A newer epoch abandons a receive blocked in the old group at once, instead
of at the group's timeout. ``swap_if_newer`` and friends are ``WeightReceiver``'s, on the
current epoch.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from llamarl.app import names
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.transport import Backoff, Stopped
from llamarl.app.weights.epochs import JOIN_TIMEOUT_S, group_members, plane_store, weights_device
from llamarl.app.weights.group import (SyncStats, WeightGroup, WeightLayoutError, WeightSyncError, init_weight_group,
                                       stop_thread)
from llamarl.app.weights.receiver import Verifier, WeightReceiver

log = logging.getLogger("llamarl")

__all__ = ["ElasticReceiver"]


class ElasticReceiver:
    """A generator's side of the weight plane, across epochs (see the module docstring)."""

    def __init__(self, signed: SignedStore, replica: int, params: Sequence[tuple[str, torch.Tensor]], *,
                 timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S,
                 verify: Verifier | None = None) -> None:
        # Its own connection: the epoch polls never queue behind the generator's other calls.
        self.signed, self.plane, self.replica = signed, plane_store(signed.clone()), replica
        self.params, self.timeout_s = list(params), timeout_s
        self.device = weights_device(self.params)
        self.join_timeout_s = join_timeout_s
        self.verify = verify
        """Asked of each received version before it may be applied (``WeightReceiver``)."""
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
        epoch = self.plane.get(names.WEIGHT_EPOCH_KEY, writers=(CONTROLLER,), default=0)
        return epoch if isinstance(epoch, int) else 0

    def _roster(self, epoch: int) -> dict | None:
        """The controller's roster of ``epoch`` (its generators and sending trainer ranks),
        once it is there."""
        roster = self.plane.get(names.weight_roster_key(epoch), writers=(CONTROLLER,))
        return roster if isinstance(roster, dict) and isinstance(roster.get("generators"), list) else None

    def _wait_for_epoch(self, should_stop: Callable[[], bool]) -> tuple[int, dict]:
        """The newest epoch after this one whose roster holds this generator, and its roster."""
        deadline = time.monotonic() + self.join_timeout_s
        backoff = Backoff(first_s=0.005, max_s=0.05)
        while True:
            epoch = self._newest_epoch()
            if epoch > self.epoch:
                roster = self._roster(epoch)
                if roster is not None and self.replica in roster["generators"]:
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
                self.plane.put(names.weight_joins_key(self.replica),
                               {"token": secrets.token_hex(8), "epoch": self.epoch})
                epoch, roster = self._wait_for_epoch(stop)
                self.epoch = epoch
                newer = lambda: self._roster(epoch + 1) is not None  # noqa: E731  (epochs are consecutive)
                abandoned = threading.Event()  # one for all of the epoch's groups
                try:
                    receiver = WeightReceiver(self._groups(epoch, roster, lambda: stop() or newer(), abandoned),
                                              self.params, verify=self.verify)
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
                                            args=(abandoned, lambda: stop() or newer(), received),
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

    def _groups(self, epoch: int, roster: dict, should_stop: Callable[[], bool],
                abandoned: threading.Event) -> Iterator[WeightGroup]:
        """The epoch's weight groups, one per trainer rank, each built as the receiver asks
        for it: trainer rank r > 0 joins only once rank 0's group is through its layout
        handshake, so a generator must not wait in group r's rendezvous before that."""
        for sender in range(roster["senders"]):
            group = init_weight_group(self.signed, rank=roster["generators"].index(self.replica) + 1,
                                      world_size=len(roster["generators"]) + 1, device=self.device,
                                      timeout_s=self.timeout_s, prefix=names.weight_epoch_prefix(epoch, sender),
                                      should_stop=should_stop, members=group_members(sender, roster["generators"]))
            group.abandoned = abandoned
            yield group

    @staticmethod
    def _abandon_when(abandoned: threading.Event, condition: Callable[[], bool], received: threading.Event) -> None:
        """Give the epoch's groups up once ``condition()``, unless its receive loop ended first."""
        while not received.wait(0.05):
            if condition():
                abandoned.set()
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
            for group in self._current.groups:
                group.forget_keys()
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

    def waiting(self) -> bool:
        """``WeightReceiver.waiting`` of the current epoch (False while there is none, or it broke)."""
        self._raise_if_failed()
        with self._lock:
            current = self._current
        try:
            return current is not None and current.waiting()
        except WeightSyncError:
            return False

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
