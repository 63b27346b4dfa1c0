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
old one.

A raise is a trial: generators waiting on the bound say the bound holds them back, not
that letting them run would make steps faster (where the executors share CPU cores or
another bottleneck, a generator running ahead slows the trainer as much as it helps).
Over the ``trial_steps`` steps after settling, the median step time must have come down
by ``gain_min`` from the median of the ``trial_steps`` steps before the raise; if not, the
bound goes back down and no raise is tried for ``backoff_steps`` steps, twice as long
after each raise in a row that did not pay.

Pure: observations in, ``Decision`` (the new bound and why) out; the controller applies it
between steps (``llamarl.app.roles.controller``).
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
    step_s: float | None = None
    """``names.TRAIN_STEP_S``: the step's time (what a raise must bring down)."""


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
    trial_steps: int = 3
    gain_min: float = 0.05
    backoff_steps: int = 8
    _blocked: deque = field(default_factory=deque, repr=False)  # the last ``patience`` observations
    _since_change: int = 1 << 30
    _steps: deque = field(default_factory=deque, repr=False)  # the last ``trial_steps`` step times
    _before: float | None = None  # median step time before the raise on trial (None: no trial)
    _trial: list = field(default_factory=list, repr=False)  # step times of the trial so far
    _failed: int = 0  # raises in a row that did not pay
    _no_raise: int = 0  # steps left before a raise may be tried again

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.cap:
            raise ValueError(f"the bound's range must satisfy 0 <= floor <= cap, got floor {self.floor}, cap {self.cap}")
        if not self.floor <= self.bound <= self.cap:
            raise ValueError(f"bound {self.bound} is outside [{self.floor}, {self.cap}]")
        if self.patience < 1 or self.settle_steps < 0 or self.trial_steps < 1 or self.backoff_steps < 0:
            raise ValueError("patience and trial_steps must be >= 1, settle_steps and backoff_steps >= 0")

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
        self._no_raise = max(0, self._no_raise - 1)
        self._blocked.append(obs.blocked)
        while len(self._blocked) > self.patience:
            self._blocked.popleft()
        blocked = sum(self._blocked) / len(self._blocked)
        settling = self._since_change <= self.settle_steps
        if obs.step_s is not None:
            self._steps.append(obs.step_s)
            while len(self._steps) > self.trial_steps:
                self._steps.popleft()
            if self._before is not None and not settling:
                self._trial.append(obs.step_s)
        why = self.wild(obs)
        if why is not None:
            if self.bound <= self.floor:
                return self._hold(f"{why}, at the floor {self.floor}")
            if settling:
                return self._hold(f"{why}, settling after the last change")
            return self._move(self.bound - 1, "lower", why)
        if self._before is not None and len(self._trial) >= self.trial_steps:
            verdict = self._judge_trial()
            if verdict is not None:
                return verdict
        measured = obs.ess is not None or obs.frac_truncated is not None or obs.kl is not None
        if len(self._blocked) < self.patience or blocked < self.blocked_min:
            return self._hold(f"generators blocked {blocked:.0%} of the time")
        if not measured:
            return self._hold("no ratio measured this step")
        if self.bound >= self.cap:
            return self._hold(f"generators blocked {blocked:.0%}, at the cap {self.cap}")
        if settling or self._before is not None:
            return self._hold("settling after the last change" if settling else "a raise on trial")
        if self._no_raise:
            return self._hold(f"generators blocked {blocked:.0%}, but the last raise did not make steps "
                              f"faster: none tried for {self._no_raise} more steps")
        before = sorted(self._steps)[len(self._steps) // 2] if self._steps else None
        decision = self._move(self.bound + 1, "raise", f"generators blocked {blocked:.0%} of the last "
                              f"{len(self._blocked)} steps, ratios tame ({self._tame(obs)})")
        self._before = before
        return decision

    def _judge_trial(self) -> Decision | None:
        """The raise on trial paid (steps faster by ``gain_min``: kept, ``None``) or it did
        not (the bound back down, raises backed off)."""
        after = sorted(self._trial)[len(self._trial) // 2]
        before = self._before
        if after <= before * (1.0 - self.gain_min):
            self._before, self._trial, self._failed = None, [], 0
            return None
        self._failed += 1
        backoff = self.backoff_steps * 2 ** (self._failed - 1)
        decision = self._move(self.bound - 1, "lower", f"the raise to {self.bound} did not make steps faster "
                              f"(median {before:.2f} s before, {after:.2f} s after): no raise for {backoff} steps")
        self._no_raise = backoff
        return decision

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so a resumed run continues where this one stood: the
        bound, the blocked shares of the current window, the steps since the last change,
        the recent step times, a raise on trial and the back-off of raises."""
        return {"bound": self.bound, "blocked": list(self._blocked), "since_change": self._since_change,
                "steps": list(self._steps), "before": self._before, "trial": list(self._trial),
                "failed": self._failed, "no_raise": self._no_raise}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state_dict()``'s record; a bound outside ``[floor, cap]`` (the
        resumed run's ``--staleness-cap`` may be lower) is clamped into it."""
        try:
            bound, since = int(state["bound"]), int(state["since_change"])
            blocked, steps = [float(b) for b in state["blocked"]], [float(x) for x in state["steps"]]
            before = None if state["before"] is None else float(state["before"])
            trial, failed, no_raise = [float(x) for x in state["trial"]], int(state["failed"]), int(state["no_raise"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a staleness bound state: {state!r} ({e!r})") from None
        self.bound, self._since_change = min(max(bound, self.floor), self.cap), since
        self._blocked, self._steps = deque(blocked[-self.patience:]), deque(steps[-self.trial_steps:])
        self._before, self._trial, self._failed, self._no_raise = before, trial, failed, no_raise

    def _tame(self, obs: Observation) -> str:
        parts = [f"ESS {obs.ess:.3f}" if obs.ess is not None else "",
                 f"truncated {obs.frac_truncated:.3f}" if obs.frac_truncated is not None else "",
                 f"KL {obs.kl:.4f}" if obs.kl is not None else ""]
        return ", ".join(p for p in parts if p)

    def _move(self, bound: int, action: Literal["raise", "lower"], reason: str) -> Decision:
        self.bound, self._since_change = bound, 0
        self._blocked.clear()
        self._before, self._trial = None, []  # a change ends any trial (a raise starts its own)
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
