"""Reward components and what they return: samples, results, quarantine, metrics events.

A reward *component* is either

- a plain function ``fn(prompt: str, completion: str, meta: dict) -> float`` (the common
  case: verifiers, format checks, user code), called once per sample, or
- a batched object with ``score_batch(samples: list[Sample]) -> Sequence[float]`` (model
  based rewards), called once per batch.

A call's outcome is a finite score or the *reason* it failed (``check_score``,
``call_function``, ``call_batched``: the same rules inline and in a worker process).
A sample with a failure is *quarantined*: its total is ``None`` and the caller must not
train on it. ``CompositeReward`` (``llamarl.app.rewards.composite``) sums the weighted scores and
runs the components; ``quarantine_counts`` and ``reward_events`` turn results into
counts and metrics events.

Pure: no processes, no transport, no torch at import time (a worker process imports
this module too, and its start-up should stay light).
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from llamarl.app.metrics import events as metrics
from llamarl.app import names

# Reasons a sample is quarantined; ``raised:<ExceptionType>`` is the seventh kind.
TIMEOUT, NAN, INF, NOT_A_NUMBER, WRONG_LENGTH = "timeout", "nan", "inf", "not_a_number", "wrong_length"
CRASHED = "crashed"
"""The component's worker process died (a segfault, ``os.abort()``, killed) during the call."""
TOTAL = "total"
"""Reserved: ``reward/total`` is the logged mean of the weighted sum."""


@dataclass(frozen=True)
class Sample:
    """One rollout to score. ``meta`` is JSON-able: ``{"answer": 8, "solution": "...", "level": 2}``."""

    prompt: str
    completion: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(prompt=d["prompt"], completion=d["completion"], meta=dict(d.get("meta") or {}))


RewardFn = Callable[[str, str, dict], float]


@runtime_checkable
class BatchedReward(Protocol):
    def score_batch(self, samples: list[Sample]) -> Sequence[float]: ...


@dataclass(frozen=True)
class RewardResult:
    """The scores of one sample.

    ``components`` holds every component that returned a valid score; ``failures`` maps
    each component that did not to its reason. ``quarantined`` is the reason of the first
    failing component in spec order, and then ``total`` is None.
    """

    total: float | None
    components: dict[str, float]
    quarantined: str | None = None
    failures: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RewardResult":
        return cls(total=d["total"], components=dict(d["components"]),
                   quarantined=d.get("quarantined"), failures=dict(d.get("failures") or {}))


@dataclass(frozen=True)
class Component:
    name: str
    """Log name: ``reward/<name>`` in the metrics database. Unique within a composite."""
    fn: Any
    """A reward function or a ``BatchedReward``."""
    weight: float = 1.0
    inline: bool = False
    """Call it in the scoring thread, with no worker process and no timeout. Only for code
    that can neither hang nor crash the process: ``build_reward`` sets it for the
    rule-based built-ins (``spec.INLINE_BUILTINS``). Any other component runs in its own
    worker process (``llamarl.app.rewards.worker``), so it must be picklable."""

    @property
    def batched(self) -> bool:
        return callable(getattr(self.fn, "score_batch", None))


def check_score(value: object) -> tuple[float | None, str | None]:
    """``(score, None)`` for a finite real number, else ``(None, reason)``.

    bool counts as a number (True is 1.0). numpy and torch scalars (0-d) are accepted
    through ``.item()``; str, None, lists and tensors of more than one element are not.
    """
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        try:
            value = value.item()
        except Exception:
            return None, NOT_A_NUMBER
    if not isinstance(value, numbers.Real):
        return None, NOT_A_NUMBER
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        return None, INF
    except (TypeError, ValueError):
        return None, NOT_A_NUMBER
    if math.isnan(x):
        return None, NAN
    if math.isinf(x):
        return None, INF
    return x, None


Score = tuple[float | None, str | None]
"""``(score, None)`` or ``(None, reason)`` for one sample and one component."""


def raised(exc: BaseException) -> str:
    return f"raised:{type(exc).__name__}"


def call_function(fn: RewardFn, sample: Sample) -> Score:
    """One call of a plain reward function. SystemExit from user code is a failed reward
    like any other exception; Ctrl-C is not swallowed."""
    try:
        value = fn(sample.prompt, sample.completion, sample.meta)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return None, raised(exc)
    return check_score(value)


def call_batched(reward: BatchedReward, samples: list[Sample]) -> list[Score]:
    """One ``score_batch`` call; a failure of the call as a whole fails every sample."""
    try:
        out = reward.score_batch(samples)
        try:
            out = list(out)
        except TypeError:
            return [(None, NOT_A_NUMBER)] * len(samples)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return [(None, raised(exc))] * len(samples)
    if len(out) != len(samples):
        return [(None, WRONG_LENGTH)] * len(samples)
    return [check_score(v) for v in out]


def quarantine_counts(results: Sequence[RewardResult]) -> dict[str, int]:
    """Quarantined samples per reason, e.g. ``{"timeout": 2, "raised:KeyError": 1}``."""
    return dict(Counter(r.quarantined for r in results if r.quarantined is not None))


def reward_events(results: Sequence[RewardResult], components: Sequence[str], step: int | None, *,
                  role: str = "reward", replica: int = 0) -> list[dict[str, Any]]:
    """Metrics events for one scored batch.

    - one ``reward`` event per component per sample: its score, or value None for a
      quarantined sample, with the component's own failure reason, or ``"quarantined"``
      when the component scored fine but another one failed;
    - ``scalar`` events: ``reward/<component>`` and ``reward/total`` means over the samples
      that were kept, ``quarantined/total`` (always, 0 included) and ``quarantined/<reason>``
      counts.
    """
    events = []
    for r in results:
        for name in components:
            if r.quarantined is None:
                events.append(metrics.reward(name, r.components[name], step=step))
            else:
                events.append(metrics.reward(name, None, step=step,
                                             reason=r.failures.get(name, "quarantined")))
    kept = [r for r in results if r.quarantined is None]
    means: dict[str, float] = {}
    if kept:
        for name in components:
            means[names.reward_metric(name)] = sum(r.components[name] for r in kept) / len(kept)
        means[names.reward_metric(TOTAL)] = sum(r.total for r in kept) / len(kept)
    counts = quarantine_counts(results)
    means[names.QUARANTINED_TOTAL] = float(sum(counts.values()))
    for reason, n in sorted(counts.items()):
        means[names.quarantined_metric(reason)] = float(n)
    events += metrics.scalars(means, role=role, replica=replica, step=step)
    return events
