"""The weighted composite of reward components, and where each component runs.

``CompositeReward.score`` scores a batch with every component, sums ``weight * score``
into each sample's total and quarantines a sample that any component failed on (see
``llamarl.app.rewards.core`` for the reasons). It never raises for a failing component; only a
component whose worker cannot start at all raises (``RewardWorkerError``: configuration).

Where a component runs:

- ``Component.inline`` (the rule-based built-ins: the verifiers, ``format`` and
  ``length_penalty``): in the calling thread. Pure Python that cannot hang or crash, so
  it needs neither a process nor a timeout.
- every other component (model-based built-ins, plugins, user code): in its own worker
  process (``llamarl.app.rewards.worker``), so a call that runs past ``timeout_s`` is killed with
  its process and a crash (segfault, ``os.abort()``) takes down only the worker. Either
  way that sample (a function) or that batch (a batched component) is quarantined as
  ``timeout`` or ``crashed``, a fresh worker starts, and the remaining samples are scored.
  The component is sent to its worker pickled, so it must be a module-level function or
  an instance of a module-level class, checked when the composite is built.

``load()`` starts the workers, all at once, so the first batch does not wait for them;
without it they start on first use. ``close()`` (or collection) ends them, and they die
with this process in any case.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import types
from typing import Any, Sequence

from llamarl.app.rewards.core import TOTAL, Component, RewardResult, Sample, Score, call_batched, call_function
from llamarl.app.rewards.worker import WorkerProcess, start_workers

log = logging.getLogger(__name__)


def _pickled(c: Component) -> bytes:
    """The component as its worker receives it; TypeError saying what to change otherwise."""
    obj = c.fn
    try:
        payload = pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"reward component {c.name!r} runs in a worker process, so it must be picklable: "
                        f"define it at module level (a function, or an instance of a module-level class), "
                        f"not as a lambda or a nested function; pickling {obj!r} failed with "
                        f"{type(exc).__name__}: {exc}") from exc
    defined_in = obj.__module__ if isinstance(obj, (types.FunctionType, type)) else type(obj).__module__
    if defined_in == "__main__":
        raise TypeError(f"reward component {c.name!r} is defined in __main__ (the script being run), which "
                        f"its worker process cannot import; move it into a module and import it from there")
    return payload


class CompositeReward:
    """Weighted sum of named components; see the module docstring for where they run.

    ``score`` is serialised by a lock: one batch at a time per composite.
    """

    def __init__(self, components: Sequence[Component], *, timeout_s: float = 30.0,
                 start_timeout_s: float = 300.0) -> None:
        self._workers: dict[str, WorkerProcess] = {}  # first: __del__ runs even if validation fails
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
        if not timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"timeout_s and start_timeout_s must be > 0, got {timeout_s}, {start_timeout_s}")
        for c in components:
            if not c.inline:
                _pickled(c)
        self.components = list(components)
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.components}

    def load(self) -> None:
        """Start every worker process now, all at once, each loading its model-based
        component (``load()``); inline components with a ``load`` load here. Call once at
        executor start, so that the first batch pays none of it. RewardWorkerError when a
        worker cannot start."""
        with self._lock:
            for c in self.components:
                if c.inline and callable(getattr(c.fn, "load", None)):
                    c.fn.load()
            self._start([c for c in self.components if not c.inline])

    def _start(self, components: list[Component]) -> None:
        missing = {}
        for c in components:
            worker = self._workers.get(c.name)
            if worker is not None and worker.in_call:  # an interrupted call: its results may follow
                worker.kill()
                del self._workers[c.name]
            elif worker is not None and not worker.alive():  # died while idle: not a sample's fault
                log.warning("reward component %r: its idle worker process %d died (%s); starting another",
                            c.name, worker.pid, worker.describe_exit())
                worker.kill()
                del self._workers[c.name]
            if c.name not in self._workers:
                missing[c.name] = (_pickled(c), c.batched)
        self._workers.update(start_workers(missing, self.start_timeout_s))

    def worker_pids(self) -> dict[str, int]:
        """The process id of each running worker, by component name."""
        return {name: w.pid for name, w in self._workers.items()}

    def close(self) -> None:
        """End the worker processes. Also done when the composite is collected; a later
        ``score`` starts new ones."""
        workers, self._workers = self._workers, {}
        for w in workers.values():
            w.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit, half the world may be gone already
            pass

    def __enter__(self) -> "CompositeReward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _score_component(self, c: Component, samples: list[Sample], timeout_s: float) -> list[Score]:
        if c.inline:
            return call_batched(c.fn, samples) if c.batched else [call_function(c.fn, s) for s in samples]
        scores: list[Score] = []
        while len(scores) < len(samples):
            self._start([c])
            got, failure = self._workers[c.name].score(samples[len(scores):], timeout_s)
            scores += got
            if failure is not None:  # that worker is gone; the rest go to a fresh one
                del self._workers[c.name]
                lost = len(samples) - len(scores) if c.batched else 1
                scores += [(None, failure)] * lost
        return scores

    def score(self, samples: Sequence[Sample], timeout_s: float | None = None) -> list[RewardResult]:
        """One ``RewardResult`` per sample, in order. Never raises for a failing component."""
        samples = list(samples)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            per_component = {c.name: self._score_component(c, samples, timeout_s) for c in self.components}
        results = []
        for i in range(len(samples)):
            scores: dict[str, Any] = {}
            failures: dict[str, str] = {}
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
