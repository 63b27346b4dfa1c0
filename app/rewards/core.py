"""Reward components, the weighted composite, quarantine and metrics events.

A reward *component* is either

- a plain function ``fn(prompt: str, completion: str, meta: dict) -> float`` (the common
  case: verifiers, format checks, user code), called once per sample, or
- a batched object with ``score_batch(samples: list[Sample]) -> Sequence[float]`` (model
  based rewards), called once per batch.

``CompositeReward`` scores a batch with every component, sums ``weight * score`` into the
sample's total and *quarantines* a sample whose component raised, ran past its timeout, or
returned NaN, inf or something that is not a real number: its total is ``None`` and the
caller must not train on it. The run goes on; ``quarantine_counts`` and ``reward_events``
turn the reasons into counts and metrics events.

Timeouts. A component runs in a daemon worker thread and the caller waits for it at most
``timeout_s`` per call (per sample for a function, per batch for a batched component).
Python cannot kill a thread, so a call that times out is *abandoned*: its thread keeps
running until the call returns, and its result is thrown away. At most
``max_hung_calls`` abandoned calls may be alive at once; past that, a component whose
worker was abandoned is not called again until one of them finishes, and its samples are
quarantined as ``timeout`` straight away. So a hung reward costs at most
``max_hung_calls * timeout_s`` of waiting and that many threads, never an unbounded wait
or unbounded threads. Daemon threads, not a ``ThreadPoolExecutor``: the executor joins its
workers at interpreter exit, so one hung reward would keep the process from exiting.
A daemon thread still inside torch when the interpreter tears down aborts the process
("terminate called without an active exception"), so a process that ends with abandoned
calls still running ends through ``exit_without_teardown_if_calls_hang``.

Pure: no process groups, no transport, no torch at import time.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import queue
import sys
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from app import metrics

# Reasons a sample is quarantined; ``raised:<ExceptionType>`` is the fifth kind.
TIMEOUT, NAN, INF, NOT_A_NUMBER, WRONG_LENGTH = "timeout", "nan", "inf", "not_a_number", "wrong_length"
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


# Threads of abandoned calls, across every composite of the process.
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def _abandon(thread: threading.Thread) -> None:
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()] + [thread]


def abandoned_calls_running() -> int:
    """Calls abandoned past their timeout, by any composite, whose threads still run."""
    with _abandoned_lock:
        return sum(t.is_alive() for t in _abandoned)


def exit_without_teardown_if_calls_hang(code: int = 0) -> None:
    """End the process now, with ``code``, when abandoned reward calls are still running.

    Interpreter teardown stops daemon threads where they next take the GIL; one that is
    inside a torch op then unwinds through C++ that cannot unwind, and the process aborts
    (exit status 134) after a run that succeeded. So: flush the logs and streams, and leave
    without teardown (``os._exit``). Returns when no abandoned call is running.
    """
    running = abandoned_calls_running()
    if not running:
        return
    logging.getLogger(__name__).warning(
        "%d reward call(s) abandoned past their timeout are still running; exiting without "
        "interpreter teardown, which would abort the process", running)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _raised(exc: BaseException) -> str:
    return f"raised:{type(exc).__name__}"


class _Worker:
    """A daemon thread that runs one component's calls, one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"reward-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                out: tuple[bool, Any] = (True, job())
            except BaseException as exc:  # SystemExit from user code is a failed reward too
                out = (False, exc)
            self._results.put(out)

    def call(self, job: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
        """``(True, value)`` or ``(False, exception)``; raises TimeoutError after ``timeout_s``."""
        self._jobs.put(job)
        try:
            return self._results.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError from None

    def retire(self) -> None:
        """The thread exits once its current call, if any, returns."""
        self._jobs.put(None)


class CompositeReward:
    """Weighted sum of named components; see the module docstring for the failure rules.

    ``score`` is serialised by a lock: one batch at a time per composite.
    """

    def __init__(self, components: Sequence[Component], *, timeout_s: float = 30.0,
                 max_hung_calls: int = 4) -> None:
        self._workers: dict[str, _Worker] = {}  # first: __del__ runs even if validation fails
        if not components:
            raise ValueError("a composite reward needs at least one component")
        names = [c.name for c in components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward component names must be unique, repeated: {dupes}")
        if TOTAL in names:
            raise ValueError(f"{TOTAL!r} is reserved for the weighted sum; rename that component")
        for c in components:
            if not (c.batched or callable(c.fn)):
                raise TypeError(f"reward component {c.name!r} is neither callable nor has "
                                f"score_batch: {c.fn!r}")
            if not math.isfinite(c.weight):
                raise ValueError(f"weight of reward component {c.name!r} must be finite, got {c.weight}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_hung_calls < 1:
            raise ValueError(f"max_hung_calls must be >= 1, got {max_hung_calls}")
        self.components = list(components)
        self.timeout_s = timeout_s
        self.max_hung_calls = max_hung_calls
        self._hung: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.components}

    def load(self) -> None:
        """Load model-based components now (they load lazily otherwise, inside the first
        call's timeout). Call once at executor start."""
        for c in self.components:
            if callable(getattr(c.fn, "load", None)):
                c.fn.load()

    def close(self) -> None:
        """Let the idle worker threads exit. Also done when the composite is collected."""
        workers, self._workers = self._workers, {}
        for w in workers.values():
            w.retire()

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "CompositeReward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hung_calls(self) -> int:
        """Abandoned calls whose threads are still running."""
        self._hung = [t for t in self._hung if t.is_alive()]
        return len(self._hung)

    def _call(self, component: Component, job: Callable[[], Any], timeout_s: float) -> tuple[Any, str | None]:
        """``(value, None)`` or ``(None, reason)`` for one call of ``component``."""
        worker = self._workers.get(component.name)
        if worker is None:
            if self.hung_calls() >= self.max_hung_calls:
                return None, TIMEOUT
            worker = self._workers[component.name] = _Worker(component.name)
        try:
            ok, value = worker.call(job, timeout_s)
        except TimeoutError:
            worker.retire()
            self._hung.append(worker.thread)
            _abandon(worker.thread)
            del self._workers[component.name]
            return None, TIMEOUT
        return (value, None) if ok else (None, _raised(value))

    def _score_component(self, c: Component, samples: list[Sample],
                         timeout_s: float) -> list[tuple[float | None, str | None]]:
        if c.batched:
            out, reason = self._call(c, lambda: c.fn.score_batch(samples), timeout_s)
            if reason is None:
                try:
                    out = list(out)
                except TypeError:
                    reason = NOT_A_NUMBER
            if reason is None and len(out) != len(samples):
                reason = WRONG_LENGTH
            if reason is not None:
                return [(None, reason)] * len(samples)
            return [check_score(v) for v in out]
        scores = []
        for s in samples:
            value, reason = self._call(c, lambda s=s: c.fn(s.prompt, s.completion, s.meta), timeout_s)
            scores.append((None, reason) if reason is not None else check_score(value))
        return scores

    def score(self, samples: Sequence[Sample], timeout_s: float | None = None) -> list[RewardResult]:
        """One ``RewardResult`` per sample, in order. Never raises for a failing component."""
        samples = list(samples)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            per_component = {c.name: self._score_component(c, samples, timeout_s) for c in self.components}
        results = []
        for i in range(len(samples)):
            scores, failures = {}, {}
            for c in self.components:
                value, reason = per_component[c.name][i]
                if reason is None:
                    scores[c.name] = value
                else:
                    failures[c.name] = reason
            if failures:
                first = next(failures[c.name] for c in self.components if c.name in failures)
                results.append(RewardResult(None, scores, first, failures))
            else:
                total = sum(c.weight * scores[c.name] for c in self.components)
                results.append(RewardResult(total, scores))
        return results


def quarantine_counts(results: Sequence[RewardResult]) -> dict[str, int]:
    """Quarantined samples per reason, e.g. ``{"timeout": 2, "raised:KeyError": 1}``."""
    return dict(Counter(r.quarantined for r in results if r.quarantined is not None))


def reward_events(results: Sequence[RewardResult], names: Sequence[str], step: int | None, *,
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
        for name in names:
            if r.quarantined is None:
                events.append(metrics.reward(name, r.components[name], step=step))
            else:
                events.append(metrics.reward(name, None, step=step,
                                             reason=r.failures.get(name, "quarantined")))
    kept = [r for r in results if r.quarantined is None]
    means: dict[str, float] = {}
    if kept:
        for name in names:
            means[f"reward/{name}"] = sum(r.components[name] for r in kept) / len(kept)
        means[f"reward/{TOTAL}"] = sum(r.total for r in kept) / len(kept)
    counts = quarantine_counts(results)
    means["quarantined/total"] = float(sum(counts.values()))
    for reason, n in sorted(counts.items()):
        means[f"quarantined/{reason}"] = float(n)
    events += metrics.scalars(means, role=role, replica=replica, step=step)
    return events
