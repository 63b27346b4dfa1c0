"""Trainer replica 0's side of ``--max-staleness auto``: measure, decide, publish.

The bound is shared state: the generators' slot budget (``slots.SlotBudget``), every
trainer rank's staleness filter and its holding cap must agree on it. So it changes only
between two steps, at one point of the trainer's loop that every rank passes together
(``llamarl.app.roles.trainer.Trainer.run``): after a step is recorded and before its
weights go out, replica 0 decides (``AutoBound.decide``, the pure rule of
``llamarl.app.rl.staleness``), every other rank receives the decision in a collective,
and the controller's signed record ``names.STALENESS_BOUND_KEY`` carries it to the
generators (read at every reservation; a forged value is ignored, as every signed one).

What it measures: the generators' time waiting on the bound (their ``staleness_bound``
idle intervals, drained with every other metric: ``saw``) over the wall time since the
last decision, and the step's AIPO statistics (``names.AIPO_ESS``,
``names.AIPO_FRAC_TRUNCATED``, ``names.AIPO_KL_BEHAVIOUR``). Every change is logged with
its reason and recorded as a ``bound`` event (table ``staleness_bounds``); the bound and
the blocked share are scalars of every step (``names.STALENESS_BOUND``,
``names.STALENESS_BLOCKED``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from llamarl.app import names
from llamarl.app.config import AUTO_START_BOUND, TrainerConfig
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.metrics import events as metrics
from llamarl.app.rl.staleness import BoundPolicy, Decision, Observation, blocked_share

log = logging.getLogger("llamarl")


class AutoBound:
    """The policy, what it has seen since its last decision, and the published record.
    ``generators()``: how many generators are alive (the blocked share is per generator)."""

    def __init__(self, signed: SignedStore, cfg: TrainerConfig, *, generators: Callable[[], int],
                 emit: Callable[[list[dict]], None]) -> None:
        self.signed, self.generators, self.emit = signed, generators, emit
        self.policy = BoundPolicy(bound=AUTO_START_BOUND, floor=AUTO_START_BOUND, cap=cfg.staleness_cap)
        self._waits: list[dict] = []
        self._since = time.monotonic()

    @property
    def bound(self) -> int:
        return self.policy.bound

    def publish(self, version: int) -> None:
        """The bound in force from ``version`` on, for the generators (re-published if
        anyone overwrites it)."""
        self.signed.put(names.STALENESS_BOUND_KEY, {"bound": self.policy.bound, "version": version}, keep=True)

    def state_dict(self) -> dict:
        """The policy's state, for the checkpoint (``BoundPolicy.state_dict``)."""
        return self.policy.state_dict()

    def start(self, step: int, state: dict | None) -> None:
        """Publishes the bound the run starts (or resumes after ``step``) with: a resumed
        run's continues from its checkpoint's ``state`` (taken after ``step``'s decision);
        with none (a new run, or a checkpoint without an auto bound), the first bound."""
        if state is not None:
            self.policy.load_state_dict(state)
            log.info("staleness bound %d, continued from the checkpoint of step %d", self.policy.bound, step)
        self.publish(step)

    def saw(self, events: list[dict]) -> None:
        """Events drained from every role: the generators' waits on the bound are kept."""
        self._waits += [e for e in events if e.get("type") == "interval" and e.get("what") == "staleness_bound"]

    def decide(self, step: int, version: int, values: dict[str, float]) -> Decision:
        """After ``step`` (its scalars ``values``): the bound for the batches from ``version``
        on, published, logged and recorded when it changed."""
        now = time.monotonic()
        blocked = blocked_share(self._waits, self.generators(), now - self._since)
        self._waits, self._since = [], now
        previous = self.policy.bound
        decision = self.policy.observe(Observation(
            blocked=blocked, ess=values.get(names.AIPO_ESS), frac_truncated=values.get(names.AIPO_FRAC_TRUNCATED),
            kl=values.get(names.AIPO_KL_BEHAVIOUR), step_s=values.get(names.TRAIN_STEP_S)))
        events = metrics.scalars({names.STALENESS_BLOCKED: blocked}, role="trainer", step=step)
        if decision.changed:
            self.publish(version)
            log.info("staleness bound %d -> %d after step %d: %s", previous, decision.bound, step, decision.reason)
            events.append(metrics.bound_change(step, previous, decision.bound, decision.reason))
        self.emit(events)
        return decision


def published_bound(signed: SignedStore, default: int) -> int:
    """The staleness bound the controller published (``names.STALENESS_BOUND_KEY``), or
    ``default`` when there is no authentic, well-formed record."""
    rec = signed.get(names.STALENESS_BOUND_KEY, writers=(CONTROLLER,))
    bound = rec.get("bound") if isinstance(rec, dict) else None
    return bound if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0 else default
