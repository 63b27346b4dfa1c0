"""Which generator processes belong to this run attempt: the first half of every group id.

A group's id is ``(generator replica, seq)``; a generator process numbers its groups from
``seen_groups.first_seq(incarnation)``, so the incarnation (``seq >> INCARNATION_SHIFT``,
plus one) names the process that made the group. Two processes must never share one: a
reader would refuse the second one's groups as replays of the first's.

- **Drawn, not counted.** Each generator process draws its incarnation at random among
  2**31 (``draw``): there is no counter in the store that a forged ``add`` or ``set``
  could move back, and two processes of one replica share one with odds of 2**-31.
- **Registered under this attempt.** Before its first group, a process adds its
  incarnation to its replica's signed record (``names.incarnation_key``, written by that
  generator only): ``{"attempt": <this attempt's token>, "incarnations": [...]}``. The
  attempt token is drawn by trainer replica 0 each time it starts, fresh or resumed, and
  published with the run's config (``runtime.publish_config``).
- **Checked by every reader** (``Incarnations.known``, asked by ``seen_groups.Admission``):
  a group whose incarnation is not registered under the reader's own attempt is refused
  as a replay. That is what keeps a frame captured before a resume out of the resumed
  run: the new attempt's seen-id sets start empty and its generators number their groups
  afresh, but a captured group's incarnation was registered under another attempt, and a
  record of another attempt is not believed (nobody without the secret can sign one for
  this attempt; an old authentic record names the old token). The trainer's replica 0
  knows its token from its own write, so a replayed config record cannot change it.

A reader reads a replica's record only when a group names an incarnation it does not
know yet (once per generator process), so the check costs nothing per group.
"""

from __future__ import annotations

import secrets
from typing import Callable

from app import names
from app.seen_groups import Admission
from app.signed import SignedStore

__all__ = ["INCARNATIONS", "KEPT_INCARNATIONS", "Incarnations", "admission", "draw", "register"]

INCARNATIONS = 2**31
"""Incarnations to draw from: ``first_seq`` of the largest still fits an int64 (the
trainer ranks exchange group ids as int64 tensors) with 2**32 groups after it."""
KEPT_INCARNATIONS = 64
"""Incarnations a replica's record lists (its newest processes): a reader learns each
one when the process's first group arrives, long before 64 restarts later."""


def draw() -> int:
    """A new generator process's incarnation, 1-based (``seen_groups.first_seq``)."""
    return secrets.randbelow(INCARNATIONS) + 1


def _listed(value: object, attempt: str) -> list[int]:
    """The incarnations a record's value lists under ``attempt`` (none under another)."""
    if not isinstance(value, dict) or value.get("attempt") != attempt:
        return []
    listed = value.get("incarnations")
    return [i for i in listed if isinstance(i, int) and 1 <= i <= INCARNATIONS] if isinstance(listed, list) else []


def register(signed: SignedStore, replica: int, attempt: str) -> int:
    """Generator ``replica``'s new process: draw its incarnation and add it to the
    replica's record under ``attempt``; returns it. ``signed`` writes as that generator."""
    member = names.member("generator", replica)
    key = names.incarnation_key(member)
    incarnation = draw()
    # The earlier processes' incarnations stay listed (a reader may not have met their
    # last groups yet); a record of another attempt, or a forged one, lists none.
    earlier = _listed(signed.get(key, writers=(member,)), attempt)
    signed.put(key, {"attempt": attempt, "incarnations": (earlier + [incarnation])[-KEPT_INCARNATIONS:]})
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
        member = names.member("generator", generator)
        listed = _listed(self.signed.get(names.incarnation_key(member), writers=(member,)), self.attempt)
        self._known.update((generator, i) for i in listed)
        return (generator, incarnation) in self._known


def admission(signed: SignedStore, attempt: str, *, published_version: Callable[[], int],
              current_version: Callable[[], int] | None = None) -> Admission:
    """The ``Admission`` of a role that reads rollout groups: no replay (of this attempt's
    or, by incarnation, of another's), no version from the future."""
    return Admission(current_version=current_version, published_version=published_version,
                     known_process=Incarnations(signed, attempt).known)
