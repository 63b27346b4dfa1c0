"""Which generators and reward executors are alive, and what a lost one leaves behind.

Trainer replica 0 runs a ``Membership`` watcher thread. An executor whose heartbeat has
not moved for ``GONE_AFTER_S`` is gone. While another of its role is alive, the loss is
tolerated: the member is listed as gone in the store (``Control.mark_gone``, which
``health.check_health`` on every trainer rank skips), the groups it held go back to be
regenerated, and the run goes on. The last generator or the last reward executor is
not tolerated: it is marked failed with a line that says so, which stops the run.

What an executor holds is in the store: the slots it reserved (a generator) or the
groups it popped (a reward executor) and has not yet passed on (``slots.HeldSlots``). On
a loss the watcher returns those slots (``slots.return_held``: the slot lifecycle's
*lose*, ``llamarl.app.control.slots``), and generators regenerate them before reserving
new slots: none is skipped. A group
that did get out just before its executor died arrives twice (the original and the
regenerated one); the trainer's slot ledger drops the second (``faults/duplicate_groups``):
nothing is trained twice.

A member killed before it registered (``health.vanished_before_registering``: the lock it
took on its first line is free) is lost the same way, from the moment the trainer starts
waiting for the members: it held nothing, and the weight plane's first epoch does not wait
for it.

The same thread returns the slots whose groups were lost on the way, once overdue
(``Membership.deadlines``: ``llamarl.app.control.overdue``).

A member whose heartbeat moves again (the scheduler restarted it, same replica id) is
alive again; a generator rejoins the weight plane at the next weight version
(``llamarl.app.weights.epochs``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from llamarl.app.control import health
from llamarl.app.control import overdue
from llamarl.app.control import slots
from llamarl.app import names
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import Control

log = logging.getLogger("llamarl")

GONE_AFTER_S = 5.0
"""A generator or reward executor silent this long is gone (heartbeats every second):
half the app's fatal ``health.HEARTBEAT_TIMEOUT_S``, so a tolerated loss is taken out
before the health check would call it a failure."""
WATCH_EVERY_S = 0.5
TOLERABLE_ROLES = ("generator", "reward")


@dataclass
class Loss:
    """One executor lost: when, and how many groups it held."""

    member: str
    at: float
    groups: int


@dataclass
class Membership:
    """Alive and gone executors of one app; ``poll`` once, or ``start`` the watcher."""

    signed: SignedStore
    """The controller's signed store (cloned: the watcher's calls never queue behind the trainer's)."""
    expected: dict[str, int]
    """Replicas of each tolerable role the app was launched with (``{"generator": 2}``)."""
    gone_after_s: float = GONE_AFTER_S
    watch_heartbeats: bool = True
    """Whether silent registered members are looked for. The trainer starts the watcher
    with ``False`` before it waits for the members to register (a member killed before it
    registered is taken out from then on) and sets it once every member registered: a
    heartbeat that stalls while a process imports torch and loads the policy is the
    start-up health check's to judge, at its longer ``health.HEARTBEAT_TIMEOUT_S``."""
    deadlines: overdue.Deadlines | None = None
    """Set once the trainer's ledger exists: the watcher returns overdue slots too
    (``llamarl.app.control.overdue``), also while the trainer waits for rollouts."""
    losses: list[Loss] = field(default_factory=list)
    rejoined: list[str] = field(default_factory=list)
    _gone: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.signed = self.signed.clone()
        self.control = Control(self.signed)

    # --- what the trainer asks ---------------------------------------------------------
    def gone(self) -> set[str]:
        with self._lock:
            return set(self._gone)

    def tolerated(self, member: str) -> bool:
        """Whether ``member`` was lost and the run goes on without it."""
        with self._lock:
            return member in self._gone

    def alive(self, role: str) -> list[str]:
        """Replicas of ``role`` not taken out (registered or not yet)."""
        with self._lock:
            return [m for r in range(self.expected.get(role, 0))
                    if (m := names.member(role, r)) not in self._gone]

    def lost_groups(self) -> int:
        with self._lock:
            return sum(loss.groups for loss in self.losses)

    # --- watching ------------------------------------------------------------------------
    def poll(self) -> list[str]:
        """Look once: the members found gone now (their held groups returned)."""
        ages = self.control.last_heartbeats()
        newly = []
        for member in health.vanished_before_registering(set(ages)):
            role = member.split("/")[0]
            if role in TOLERABLE_ROLES and not self.tolerated(member) and self._take_out(
                    member, role, ages, why="gone: " + health.describe_vanished(member).removeprefix(member + " ")):
                newly.append(member)
        if not self.watch_heartbeats:
            return newly
        for member, age in sorted(ages.items()):
            role = member.split("/")[0]
            if role not in TOLERABLE_ROLES:
                continue
            with self._lock:
                was_gone = member in self._gone
            if was_gone and age < self.gone_after_s:
                with self._lock:
                    self._gone.discard(member)
                    self.rejoined.append(member)
                log.warning("%s is back (restarted): it takes part again", member)
            elif not was_gone and age > self.gone_after_s:
                if self._take_out(member, role, ages):
                    newly.append(member)
        return newly

    def _take_out(self, member: str, role: str, ages: dict[str, float], why: str = "") -> bool:
        """``member`` is lost (``why``; by default: its heartbeat stood still): taken out
        while another of its role is alive (registered and beating, or not registered
        yet), else marked failed."""
        survivors = [m for m in self.alive(role) if m != member and ages.get(m, 0.0) <= self.gone_after_s]
        what = "generator" if role == "generator" else "reward executor"
        crash = health.sibling_crash(member)  # "<member> crashed (...) in <function> (...)"
        why = why or (crash.removeprefix(member + " ") if crash else
                      f"gone: no heartbeat for {self.gone_after_s:g} s (killed, out of memory, or its node was lost)")
        if not survivors:
            # Marked failed (once): the run stops, naming the member and why it cannot go on.
            if member not in self.control.failures():
                _, replica = member.split("/")
                self.control.mark_failed(role, int(replica), (
                    f"{why}, and it was the last {what}: no {what} is left to go on with"))
            return False
        groups = slots.return_held(self.signed, member)
        with self._lock:
            self._gone.add(member)
            self.losses.append(Loss(member, time.time(), groups))
        self.control.mark_gone(member)
        log.error("%s is %s: the run goes on with %s; %d group(s) it held go back to be regenerated",
                  member, why, ", ".join(survivors), groups)
        return True

    def start(self) -> None:
        """Watch every ``WATCH_EVERY_S`` on a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._watch, daemon=True, name="membership")
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            try:
                self.poll()
                if self.deadlines is not None:
                    self.deadlines.poll()
            except Exception as e:  # the store is going away with the run
                log.debug("membership watcher: %s", e)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
