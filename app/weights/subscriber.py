"""A generator's side of the weight plane behind one call: ``Subscriber.swap_into(model)``.

Built once per generator from its model: it lays the model's parameters out as one flat
buffer per dtype (``flatten_parameters_``: a swap is then one copy per dtype from one
trainer rank, one per parameter part from several), sets its linear layers to
``--gen-precision`` (``llamarl.app.sampling.precision.quantize_``, refused
here when this device cannot run it), and joins the plane across its epochs
(``llamarl.app.weights.epochs``): it asks to join (``names.weight_joins_key``: a token of
the request and the newest epoch it was in), waits for an epoch whose roster holds it,
receives there on a background thread (``llamarl.app.weights.receiver.WeightReceiver``)
until a newer epoch is announced or a receive fails, then asks again. A newer epoch
abandons a receive blocked in the old group at once, instead of at the group's timeout.
With the digest on, each version is checked against the trainer ranks' signed records as
it lands (``llamarl.app.weights.digest.DigestCheck``; a refused version is never staged).

Between decode batches ``swap_into(model)`` copies the newest version staged in the
current epoch's receiver into the model (``swap_staged``, here, so the version goes
straight from the staging hand-off to the generator) and, below fp32, rebuilds its
quantized kernels from the new weights (recorded as the ``quantize`` busy interval and
``weights/quantize_s`` at the version's step). A broken epoch is this class's business
(it rejoins), not the generator's: ``swap_into`` finds nothing new meanwhile.

``events()`` hands over what the metrics record of it since the last call: a
``weight_sync`` event per receive (``generator/<replica>``) and the quantization times;
``digest_metrics()`` the refusals so far, by reason (``security/weight_digest/<reason>``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from llamarl.app import names
from llamarl.app.control.runtime import Runtime
from llamarl.app.control.signed import CONTROLLER
from llamarl.app.control.transport import Backoff, Stopped
from llamarl.app.metrics import events as metrics
from llamarl.app.sampling import quantize_
from llamarl.app.weights.digest import DigestCheck
from llamarl.app.weights.epochs import JOIN_TIMEOUT_S, group_members, plane_store, weights_device
from llamarl.app.weights.group import (SyncStats, WeightGroup, WeightLayoutError, WeightSyncError, init_weight_group,
                                       stop_thread)
from llamarl.app.weights.layout import flatten_parameters_
from llamarl.app.weights.receiver import WeightReceiver

log = logging.getLogger("llamarl")

__all__ = ["Subscriber", "swap_staged"]


def swap_staged(receiver: WeightReceiver, held: int | None = None) -> int | None:
    """Copy the newest version staged in ``receiver`` into the parameters it receives for
    (each trainer rank's buffers through their ``moves``), when it is newer than the one they
    hold (``held``, when an earlier receiver put it there: a new epoch starts by resending
    the newest version, which a generator may have swapped in already): the version now in
    them, or ``None`` when nothing changed (nothing new, or a receive is writing staging:
    the next call takes it).
    ``WeightSyncError`` when the receiver's loop failed (staging may be half written)."""
    staging = receiver.staging
    if not staging.lock.acquire(blocking=False):
        return None
    try:
        if receiver.error is not None:
            raise WeightSyncError(f"background weight receiver failed: {receiver.error}") from receiver.error
        if staging.version is None or staging.version == staging.applied:
            return None
        if held is not None and staging.version <= held:
            staging.applied = staging.version  # in the parameters already: not waiting any more
            return None
        with torch.no_grad():
            for buffers, moves in zip(staging.buffers, staging.moves):  # trainer rank by rank
                for live, flat, run_moves in zip(staging.live, buffers, moves):
                    for src, dst, n in run_moves:
                        live[dst:dst + n].copy_(flat[src:src + n])
        staging.applied = staging.version
        return staging.applied
    finally:
        staging.lock.release()


class Subscriber:
    """Generator ``rt.replica``'s weights, kept current: ``start()`` once, ``swap_into(model)``
    between decode batches, ``close()`` at the end.

    ``precision``: the generator's ``--gen-precision``. ``timeout_s``: the weight group's
    timeout (``--weight-sync-timeout-s``), also how long a received version waits for its
    digest records. ``digest``: check every version's signed digest (``--weight-digest``).
    ``timeline``: the generator's busy and idle intervals, where quantizing is recorded.
    ``join_timeout_s``: how long to wait for an epoch that takes this generator in.
    """

    def __init__(self, rt: Runtime, model: nn.Module, *, precision: str, timeout_s: float, digest: bool,
                 timeline: metrics.Timeline, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.rt, self.model, self.timeline = rt, model, timeline
        self.replica, self.member = rt.replica, names.member("generator", rt.replica)
        flatten_parameters_(model)
        # The same parameters, so the receiver writes into them as at fp32.
        self.quantized = quantize_(model, precision)
        self.params = list(model.named_parameters())
        self.device = weights_device(self.params)
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        # Its own connection: the epoch polls never queue behind the generator's other calls.
        self.plane = plane_store(rt.signed.clone())
        # Runs on the receiver's thread: a store connection of its own.
        self.check = (DigestCheck(rt.signed.clone(), rt.replica, wait_s=timeout_s, should_stop=rt.should_stop)
                      if digest else None)
        self.epoch = 0
        """The newest epoch this generator was in (0: none yet)."""
        self._current: WeightReceiver | None = None
        self._retired_version: int | None = None
        self._applied: int | None = None  # the version in the model (only ``swap_into`` changes it)
        self._retired: list[WeightReceiver] = []
        self._lock = threading.Lock()  # guards _current and _stats
        self._stats: list[SyncStats] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._quantize_events: list[dict[str, Any]] = []

    # --- the generator's calls -----------------------------------------------------------
    def start(self) -> None:
        """Receive in the background from now on, until the run stops or ``close``."""
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"weight-plane-{self.replica}")
        self._thread.start()

    def swap_into(self, model: nn.Module) -> int | None:
        """Copy the newest complete version into ``model`` (the one this subscriber was built
        for) and refresh its quantized kernels; the version now in it, or ``None`` when none
        newer is waiting (or a receive is writing staging: the next call takes it)."""
        if model is not self.model:
            raise ValueError("Subscriber.swap_into: this subscriber receives into the model it was built for, "
                             "not another one")
        self._raise_if_failed()
        current = self._current
        try:
            new = swap_staged(current, held=self._applied) if current is not None else None
        except WeightSyncError:  # the epoch broke: the thread rejoins
            return None
        if new is not None:
            self._applied = new
        if new is not None and self.quantized is not None:
            with self.timeline.busy("quantize"):
                seconds = self.quantized.refresh()
            self._quantize_events += metrics.scalars({names.WEIGHTS_QUANTIZE_S: seconds}, role="generator",
                                                     replica=self.replica, step=new)
        return new

    def waiting(self) -> bool:
        """Whether a version newer than the model's is staged and ``swap_into`` would take it
        now (False while there is no epoch, or it broke)."""
        self._raise_if_failed()
        current = self._current
        try:
            return current is not None and current.waiting()
        except WeightSyncError:
            return False

    def latest_version(self) -> int | None:
        """The newest version received (swapped in or not), in this epoch or an earlier one;
        ``None`` before the first."""
        self._raise_if_failed()
        current = self._current
        staged = _staged(current) if current is not None else None
        return staged if staged is not None else self._retired_version

    def events(self) -> list[dict[str, Any]]:
        """The ``weight_sync`` events of the receives and the quantization times since the last call."""
        with self._lock:
            stats, self._stats = self._stats, []
            if self._current is not None:
                stats += self._current.pop_stats()
        out = [metrics.weight_sync(s.version, self.member, s.bytes, s.seconds) for s in stats]
        out, self._quantize_events = out + self._quantize_events, []
        return out

    def digest_metrics(self) -> dict[str, float]:
        """Versions refused so far, by reason (empty with the digest off)."""
        return self.check.metrics() if self.check is not None else {}

    def new_refusals(self) -> dict[str, float]:
        """``digest_metrics()`` when they changed since the last call, else an empty dict."""
        return self.check.new_counts() if self.check is not None else {}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the receiver thread (it must leave gloo before the interpreter exits, or the
        process aborts; it can only be stuck in a sync when the run is failing anyway)."""
        try:
            self._thread = stop_thread(self._thread, self._stop, timeout_s, "the weight plane's receiver thread")
        except WeightSyncError as e:
            log.warning("%s", e)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WeightSyncError(f"weight plane of generator {self.replica} failed: {self._error}") from self._error

    # --- the epochs, on the receiver thread -----------------------------------------------
    def _stopping(self) -> bool:
        return self._stop.is_set() or self.rt.should_stop()

    def _newest_epoch(self) -> int:
        epoch = self.plane.get(names.WEIGHT_EPOCH_KEY, writers=(CONTROLLER,), default=0)
        return epoch if isinstance(epoch, int) else 0

    def _roster(self, epoch: int) -> dict | None:
        """The controller's roster of ``epoch`` (its generators and sending trainer ranks),
        once it is there."""
        roster = self.plane.get(names.weight_roster_key(epoch), writers=(CONTROLLER,))
        return roster if isinstance(roster, dict) and isinstance(roster.get("generators"), list) else None

    def _wait_for_epoch(self) -> tuple[int, dict]:
        """The newest epoch after this one whose roster holds this generator, and its roster."""
        deadline = time.monotonic() + self.join_timeout_s
        backoff = Backoff(first_s=0.005, max_s=0.05)
        while True:
            epoch = self._newest_epoch()
            if epoch > self.epoch:
                roster = self._roster(epoch)
                if roster is not None and self.replica in roster["generators"]:
                    return epoch, roster
            if self._stopping():
                raise Stopped("stopped while waiting to join the weight plane")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"generator {self.replica}: the trainer took it into no weight group "
                                      f"within {self.join_timeout_s:g} s")
            time.sleep(backoff.next())

    def _run(self) -> None:
        try:
            while not self._stopping():
                self.plane.put(names.weight_joins_key(self.replica),
                               {"token": secrets.token_hex(8), "epoch": self.epoch})
                epoch, roster = self._wait_for_epoch()
                self.epoch = epoch
                newer = lambda: self._stopping() or self._roster(epoch + 1) is not None  # noqa: E731  (consecutive)
                abandoned = threading.Event()  # one for all of the epoch's groups
                try:
                    receiver = WeightReceiver(self._groups(epoch, roster, newer, abandoned), self.params,
                                              verify=self.check)
                except WeightLayoutError:
                    raise
                except (WeightSyncError, Stopped) as e:
                    if self._stopping():
                        return
                    log.warning("weight plane epoch %d: could not join (%s); asking again", epoch, e)
                    continue
                with self._lock:
                    self._retire()
                    self._current = receiver
                # A newer epoch while a receive of this one is blocked: give it up (the
                # trainer has left this group; a peer of it may be dead).
                received = threading.Event()
                watchdog = threading.Thread(target=_abandon_when, args=(abandoned, newer, received),
                                            daemon=True, name=f"weight-plane-watch-{self.replica}")
                watchdog.start()
                try:
                    error = receiver.receive_until(newer)
                finally:
                    # Joined: a daemon thread inside a store call at exit aborts the process.
                    received.set()
                    watchdog.join()
                if isinstance(error, WeightLayoutError):
                    raise error
                if error is not None and not self._stopping():  # the generator goes on with the weights it has
                    log.warning("weight plane epoch %d broke (%s): asking to join the next one", epoch,
                                str(error).splitlines()[0][:200])
        except Stopped:
            return
        except BaseException as e:  # raised to the generator by its next call
            self._error = e

    def _groups(self, epoch: int, roster: dict, should_stop: Callable[[], bool],
                abandoned: threading.Event) -> Iterator[WeightGroup]:
        """The epoch's weight groups, one per trainer rank, each built as the receiver asks
        for it: trainer rank r > 0 joins only once rank 0's group is through its layout
        handshake, so a generator must not wait in group r's rendezvous before that."""
        for sender in range(roster["senders"]):
            group = init_weight_group(self.rt.signed, rank=roster["generators"].index(self.replica) + 1,
                                      world_size=len(roster["generators"]) + 1, device=self.device,
                                      timeout_s=self.timeout_s, prefix=names.weight_epoch_prefix(epoch, sender),
                                      should_stop=should_stop, members=group_members(sender, roster["generators"]))
            group.abandoned = abandoned
            yield group

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


def _abandon_when(abandoned: threading.Event, condition: Callable[[], bool], received: threading.Event) -> None:
    """Give the epoch's groups up once ``condition()``, unless its receive loop ended first.
    A store that no longer answers ``condition`` (the app is ending: its host, trainer
    replica 0, is gone) gives them up too: the receive loop then ends, and the run's own
    stop path says why, not a traceback of this thread."""
    while not received.wait(0.05):
        try:
            done = condition()
        except (RuntimeError, OSError) as e:  # torch.distributed's DistError is a RuntimeError
            log.debug("weight plane watchdog: the store did not answer (%s): giving the epoch up", e)
            done = True
        if done:
            abandoned.set()
            return


def _staged(receiver: WeightReceiver) -> int | None:
    """The newest version ``receiver`` holds complete; a broken epoch's still counts."""
    return receiver.staging.version
