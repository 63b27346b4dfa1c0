"""Which generator processes belong to this run attempt: the first half of every group id.

A group's id is ``(generator replica, seq)``; a generator process numbers its groups from
``seen_groups.first_seq(incarnation)``, so the incarnation (``seq >> INCARNATION_SHIFT``,
plus one) names the process that made the group. Two processes must never share one: a
reader would refuse the second one's groups as replays of the first's.

- **Drawn, not counted.** Each generator process draws its incarnation at random among
  2**31 (``draw``): there is no counter in the store that a forged ``add`` or ``set``
  could move back, and two processes of one replica share one with odds of 2**-31.
- **Registered under this attempt.** Before its first group, a process writes a signed
  record at a key of its own, ``names.incarnation_key(member, incarnation)`` (written by
  that generator only): ``{"attempt": <this attempt's token>}``. The attempt token is
  drawn by trainer replica 0 each time it starts, fresh or resumed, and published with
  the run's config (``runtime.publish_config``). The process re-publishes its record if
  someone overwrites or deletes it (``SignedStore.reassert``, on each heartbeat); one key
  per process, so no process rewrites another's registration.
- **Checked by every reader** (``Incarnations.known``, asked by ``seen_groups.Admission``):
  a group whose incarnation is not registered under the reader's own attempt is refused
  as a replay. That is what keeps a frame captured before a resume out of the resumed
  run: the new attempt's seen-id sets start empty and its generators number their groups
  afresh, but a captured group's incarnation was registered under another attempt, and a
  record of another attempt is not believed (nobody without the secret can sign one for
  this attempt; an old authentic record names the old token). The trainer's replica 0
  knows its token from its own write, so a replayed config record cannot change it.

A reader reads a process's record only when a group names an incarnation it does not
know yet (once per generator process), so the check costs nothing per group. What it
cannot stop: someone who reaches the store and learns a new process's incarnation (from
its groups, which are signed, not encrypted) deleting that record before a reader first
reads it; the reader refuses the process's groups until the heartbeat has put the record
back, within a second (a denial of service, counted as replays, like deleting any key).
"""

from __future__ import annotations

import secrets
from typing import Callable

from llamarl.app import names
from llamarl.app.control.seen_groups import Admission
from llamarl.app.control.signed import SignedStore

__all__ = ["INCARNATIONS", "Incarnations", "admission", "draw", "register"]

INCARNATIONS = 2**31
"""Incarnations to draw from: ``first_seq`` of the largest still fits an int64 (the
trainer ranks exchange group ids as int64 tensors) with 2**32 groups after it."""


def draw() -> int:
    """A new generator process's incarnation, 1-based (``seen_groups.first_seq``)."""
    return secrets.randbelow(INCARNATIONS) + 1


def register(signed: SignedStore, replica: int, attempt: str) -> int:
    """Generator ``replica``'s new process: draw its incarnation and register it under
    ``attempt`` (re-published if overwritten); returns it. ``signed`` writes as that
    generator."""
    incarnation = draw()
    signed.put(names.incarnation_key(names.member("generator", replica), incarnation), {"attempt": attempt},
               keep=True)
    return incarnation


class Incarnations:
    """A reader's view of the generator processes registered under ``attempt``."""

    def __init__(self, signed: SignedStore, attempt: str) -> None:
        self.signed, self.attempt = signed, attempt
        self._known: set[tuple[int, int]] = set()

    def known(self, generator: int, incarnation: int) -> bool:
        """Whether generator ``generator``'s process ``incarnation`` is of this attempt."""
        if (generator, incarnation) in self._known:
            return True
        if not 1 <= incarnation <= INCARNATIONS:  # no process draws it: not worth a store read
            return False
        member = names.member("generator", generator)
        record = self.signed.get(names.incarnation_key(member, incarnation), writers=(member,))
        if isinstance(record, dict) and record.get("attempt") == self.attempt:
            self._known.add((generator, incarnation))
            return True
        return False


def admission(signed: SignedStore, attempt: str, *, published_version: Callable[[], int],
              current_version: Callable[[], int] | None = None) -> Admission:
    """The ``Admission`` of a role that reads rollout groups: no replay (of this attempt's
    or, by incarnation, of another's), no version from the future."""
    return Admission(current_version=current_version, published_version=published_version,
                     known_process=Incarnations(signed, attempt).known)
