"""A run's shared CPU host, read from its metrics database: what each phase cost with a
core to itself, and how much of the cores other programs took.

On a CPU host every executor's process competes for the same cores (a thread each: the
app's ``--threads 1``): a trainer step is slower while a generator decodes beside it and
slower still under another program's load, so the wall time of a phase is its cost over
the share of a core it had. Generators and the trainer record the CPU seconds of their
work (``names.GEN_CPU_S``, ``names.TRAIN_CPU_S``): that is the cost with a core to itself,
and CPU over wall is the share. The share, with the run's own phases running at the same
time, tells the other programs' load (``Loop.host_load``): ``share = cores / (running +
load)`` once the cores are oversubscribed. A phase without CPU seconds (scoring,
evaluation) is costed at its wall time times the share the model gives it.
"""

from __future__ import annotations

import bisect
import os
import statistics
from typing import Any

from llamarl.app import names
from llamarl.app.sim.costs import cpu_share

CPU_PHASES = (("generator", "generate"), ("reward", "score"), ("trainer", "train"), ("trainer", "eval"))
"""The busy intervals that are CPU work (``llamarl.app.sim.engine``'s shared cores)."""

Spans = list[tuple[float, float]]


def busy_spans(db: Any) -> Spans:
    """Every CPU phase's interval of the run, every executor's, in time order."""
    spans: Spans = []
    for role, what in CPU_PHASES:
        spans += [(t0, t1) for _, _, _, t0, t1 in db.intervals(role, what)]
    return sorted(spans)


def running(t0: float, t1: float, spans: Spans, *, besides: bool = False) -> float:
    """The mean number of CPU phases running over ``[t0, t1]``: the one timed included,
    or (``besides``) the work outside every phase there, plus the phases beside it."""
    if t1 <= t0:
        return 1.0
    starts = [s[0] for s in spans]
    covered = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in spans[:bisect.bisect_right(starts, t1)])
    return 1.0 + covered / (t1 - t0) if besides else max(1.0, covered / (t1 - t0))


def cpu_seconds(db: Any, role: str, name: str, units: list[tuple]) -> list[float | None]:
    """For each unit of work (``calibrate._paired``'s: replica, t0, t1, ...), the CPU
    seconds its executor reported after it (``name``), or None where none was."""
    series: dict[int, list[tuple[float, float]]] = {}
    for rep, t, v in db.scalars(name, role):
        series.setdefault(rep, []).append((t, v))
    out: list[float | None] = []
    for rep, _, t1, *_ in units:
        s = series.get(rep, [])
        i = bisect.bisect_left(s, (t1 - 1e-6, float("-inf")))
        out.append(s[i][1] if i < len(s) and s[i][0] - t1 <= 5.0 else None)
    return out


def fit_load(cores: int, samples: list[tuple[float, float]]) -> float:
    """Other programs' runnable threads, from (share of a core, own phases running) per
    unit of work: the median of ``cores / share - running`` (0 where the share is full)."""
    loads = [max(0.0, cores / got - n) for got, n in samples if got > 0]
    return statistics.median(loads) if loads else 0.0


def work(wall: float, cores: int, load: float, n: float) -> float:
    """A phase's cost with a core to itself, from its wall time with ``n`` phases running."""
    return wall * cpu_share(cores, load, n)


def fit(db: Any, cfg: dict, batches: list[tuple], steps: list[tuple],
        notes: list[str]) -> tuple[int, float, dict[str, list[float]]]:
    """A run on CPUs: its host's cores, the other programs' load, and the costs of the
    generators' batches and the trainer's steps (``calibrate._paired``'s units) with a
    core to themselves (their CPU seconds where recorded); on GPUs, no shared cores and
    the wall times. What it assumed goes to ``notes``."""
    walls = {"generator": [u[3] for u in batches], "trainer": [u[3] for u in steps]}
    if cfg.get("device") != "cpu":
        return 0, 0.0, walls
    cores = os.cpu_count() or 1
    spans = busy_spans(db)
    cpu = {"generator": cpu_seconds(db, "generator", names.GEN_CPU_S, batches),
           "trainer": cpu_seconds(db, "trainer", names.TRAIN_CPU_S, steps)}
    samples = [(c / u[3], running(u[1], u[2], spans))
               for role, units in (("generator", batches), ("trainer", steps))
               for u, c in zip(units, cpu[role]) if c is not None and u[3] > 0]
    load = fit_load(cores, samples)
    notes.append(f"a CPU host of {cores} cores (this machine's), other programs' load {load:.2f} "
                 + ("(from the recorded CPU seconds)" if samples else "(no CPU seconds recorded: taken as 0)"))
    fallback = {role: unit_work(db, units, cores, load) for role, units in (("generator", batches), ("trainer", steps))}
    return cores, load, {role: [c if c is not None else w for c, w in zip(cpu[role], fallback[role])]
                         for role in fallback}


def unit_work(db: Any, units: list[tuple], cores: int, load: float) -> list[float]:
    """Each unit's busy seconds as the cost with a core to itself (``work``)."""
    if not cores:
        return [u[3] for u in units]
    spans = busy_spans(db)
    return [work(u[3], cores, load, running(u[1], u[2], spans)) for u in units]


def gap_work(gaps: list[tuple[float, float, float]], spans: Spans, cores: int, load: float) -> list[float]:
    """Untimed work between an executor's phases, (seconds, from, to) each, as its cost
    with a core to itself: at the share it had beside the phases running meanwhile."""
    return [work(g, cores, load, running(t0, t1, spans, besides=True)) for g, t0, t1 in gaps]
