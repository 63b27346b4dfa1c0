"""``--max-staleness auto``: a staleness bound that follows what the run measures.

A larger bound lets generators run further ahead of the trainer, so neither waits on the
other; the price is older rollouts, whose importance ratios pi/mu drift from 1 and whose
AIPO weights start carrying the gradient on a few tokens. ``BoundPolicy`` weighs the two
after every step, from what the step already measured (``Observation``):

- **raise** the bound by one (up to ``cap``) when the generators waited on it for at
  least ``blocked_min`` of their time over the last ``patience`` steps (the bound is
  the bottleneck; a mean, since generators report their waits when their next batch is
  done, not at every step), and the ratios are tame;
- **lower** it by one (down to ``floor``) when the ratios are not tame: the lowest
  effective sample size of the AIPO weights over the lags present is below ``ess_min``,
  or the truncated share is above ``truncated_max``, or KL(mu || pi) at the worst lag is
  above ``kl_max`` (``llamarl.app.rl.mismatch``);
- otherwise **hold** it.

After a change it holds for ``settle_steps`` steps: the first rollouts of the new bound
take that long to reach the trainer, and the ratios measured meanwhile still describe the
old one. Pure: observations in, ``Decision`` (the new bound and why) out; the controller
applies it between steps (``llamarl.app.roles.controller``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Observation:
    """What one step measured. A ratio statistic that is ``None`` was not measured (a
    skipped step, a batch whose advantages were all 0): it neither proves nor disproves
    tameness, so the policy holds."""

    blocked: float
    """The generators' share of time since the last step spent waiting on the bound."""
    ess: float | None = None
    """``names.AIPO_ESS``: lowest ESS share of the AIPO weights over the lags present."""
    frac_truncated: float | None = None
    """``names.AIPO_FRAC_TRUNCATED``: share of tokens whose ratio exceeded rho_max."""
    kl: float | None = None
    """``names.AIPO_KL_BEHAVIOUR``: highest KL(mu || pi) per token over the lags present."""


@dataclass(frozen=True)
class Decision:
    bound: int
    action: Literal["raise", "lower", "hold"]
    reason: str

    @property
    def changed(self) -> bool:
        return self.action != "hold"


@dataclass(kw_only=True)
class BoundPolicy:
    """The rule of the module docstring; ``bound`` is the bound in force (``floor`` <=
    ``bound`` <= ``cap``). The thresholds' defaults suit the AIPO defaults (rho_max 4):
    at a healthy lag the ESS stays above 0.95 and almost nothing is truncated."""

    bound: int
    floor: int = 1
    cap: int = 4
    blocked_min: float = 0.1
    ess_min: float = 0.9
    truncated_max: float = 0.01
    kl_max: float = 0.05
    patience: int = 2
    settle_steps: int = 2
    _blocked: deque = field(default_factory=deque, repr=False)  # the last ``patience`` observations
    _since_change: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.cap:
            raise ValueError(f"the bound's range must satisfy 0 <= floor <= cap, got floor {self.floor}, cap {self.cap}")
        if not self.floor <= self.bound <= self.cap:
            raise ValueError(f"bound {self.bound} is outside [{self.floor}, {self.cap}]")
        if self.patience < 1 or self.settle_steps < 0:
            raise ValueError("patience must be >= 1 and settle_steps >= 0")

    def wild(self, obs: Observation) -> str | None:
        """Why the ratios are not tame, or ``None``."""
        if obs.ess is not None and obs.ess < self.ess_min:
            return f"ESS {obs.ess:.3f} < {self.ess_min:g}"
        if obs.frac_truncated is not None and obs.frac_truncated > self.truncated_max:
            return f"truncated share {obs.frac_truncated:.3f} > {self.truncated_max:g}"
        if obs.kl is not None and obs.kl > self.kl_max:
            return f"KL(mu||pi) {obs.kl:.4f} > {self.kl_max:g}"
        return None

    def observe(self, obs: Observation) -> Decision:
        """The bound after this step, and why; it moves by at most one a step."""
        self._since_change += 1
        self._blocked.append(obs.blocked)
        while len(self._blocked) > self.patience:
            self._blocked.popleft()
        blocked = sum(self._blocked) / len(self._blocked)
        settling = self._since_change <= self.settle_steps
        why = self.wild(obs)
        if why is not None:
            if self.bound <= self.floor:
                return self._hold(f"{why}, at the floor {self.floor}")
            if settling:
                return self._hold(f"{why}, settling after the last change")
            return self._move(self.bound - 1, "lower", why)
        measured = obs.ess is not None or obs.frac_truncated is not None or obs.kl is not None
        if len(self._blocked) < self.patience or blocked < self.blocked_min:
            return self._hold(f"generators blocked {blocked:.0%} of the time")
        if not measured:
            return self._hold("no ratio measured this step")
        if self.bound >= self.cap:
            return self._hold(f"generators blocked {blocked:.0%}, at the cap {self.cap}")
        if settling:
            return self._hold("settling after the last change")
        return self._move(self.bound + 1, "raise", f"generators blocked {blocked:.0%} of the last "
                          f"{len(self._blocked)} steps, ratios tame ({self._tame(obs)})")

    def _tame(self, obs: Observation) -> str:
        parts = [f"ESS {obs.ess:.3f}" if obs.ess is not None else "",
                 f"truncated {obs.frac_truncated:.3f}" if obs.frac_truncated is not None else "",
                 f"KL {obs.kl:.4f}" if obs.kl is not None else ""]
        return ", ".join(p for p in parts if p)

    def _move(self, bound: int, action: Literal["raise", "lower"], reason: str) -> Decision:
        self.bound, self._since_change = bound, 0
        self._blocked.clear()
        return Decision(bound, action, reason)

    def _hold(self, reason: str) -> Decision:
        return Decision(self.bound, "hold", reason)


def blocked_share(intervals: list[dict], generators: int, window_s: float) -> float:
    """The generators' share of ``window_s`` seconds (each of ``generators``) spent waiting
    on the staleness bound, from their timeline events (``interval`` events whose ``what``
    is ``staleness_bound``); 0 for an empty window."""
    if window_s <= 0 or generators <= 0:
        return 0.0
    waited = sum(e["t1"] - e["t0"] for e in intervals
                 if e.get("type") == "interval" and e.get("what") == "staleness_bound"
                 and str(e.get("role")) == "generator")
    return min(1.0, waited / (generators * window_s))
