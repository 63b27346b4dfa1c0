"""The simulator's cost models, fitted from a run's metrics database or built from a spec.

``from_run(runs/<id>)`` reads what the run recorded (``llamarl.app.metrics.events``), the
database opened read-only:

- generators: each batch (its ``generate`` intervals), with the ``gen/tokens_per_s`` and
  ``gen/seqs_per_s`` its batch reported right after, gives (seconds, tokens, rows): a least-
  squares fit of ``batch_s + step_s * longest + token_s * tokens`` (``longest``: the
  expected longest of that many rows under the fitted lengths); the untimed time between
  batches (pushes, swaps, reservations, metrics; not the modeled waits) is ``overhead_s``;
- completion lengths: the mean over all batches and, from how much the batch means vary
  (the variance of a mean of n rows is the rows' variance over n), the tail of the
  log-normal;
- reward executors: each ``score`` interval and its ``reward/samples_per_s``;
- the trainer: each ``train`` interval and its ``train/tokens_per_s``; ``weight_sync``
  plus ``weight_digest`` intervals per step, with the bytes of the ``weight_sync`` table;
  the rest of each step, outside every timed interval, is ``overhead_s``; ``eval``.

A term the run cannot tell apart from another (one batch shape: ``batch_s`` from
``step_s``; one receiver count: ``receiver_slope``) is left at 0 and the whole cost given
to the term it cannot be told from; ``Calibration.summary`` says which.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import sqlite3
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llamarl.app import names
from llamarl.app.metrics.events import DB_NAME
from llamarl.app.sim import host
from llamarl.app.sim.costs import GenCost, Lengths, Loop, RewardCost, SyncCost, TrainCost, cpu_share
from llamarl.app.sim.engine import Report


RUN_FLAGS = {"steps": "steps", "prompts_per_step": "prompts_per_step", "group_size": "group_size",
             "max_staleness": "max_staleness", "num_generators": "generators",
             "gen_batch_prompts": "gen_batch_prompts", "num_reward": "reward_executors",
             "trainer_ranks": "trainer_ranks", "eval_every": "eval_every"}
"""``Loop``'s fields that are a run's configuration, by their name in the configuration the
run recorded (the controller's: ``TrainerConfig``'s and ``GeneratorConfig``'s fields and the
app's shape, ``num_generators``, ``num_reward``, ``trainer_ranks``). Read by name from the
record, not from those classes: this package sits below ``llamarl.app.config`` and stays
free of torch for the dashboard, and a loop may be one no run has (a spec, a what-if). A
key the record lacks keeps ``Loop``'s default."""

NARROW = 0.2
"""A regressor whose spread (standard deviation over mean) is below this cannot separate a
constant from a slope in a run's timings."""


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_moments(mean: float, sigma: float, cap: float) -> tuple[float, float]:
    """Mean and standard deviation of ``min(X, cap)`` for X log-normal with mean ``mean``
    and shape ``sigma`` (closed form, rounding ignored)."""
    if sigma <= 0:
        return min(mean, cap), 0.0
    mu, lc = math.log(mean) - sigma ** 2 / 2, math.log(cap)
    above = 1.0 - _normal_cdf((lc - mu) / sigma)
    m1 = math.exp(mu + sigma ** 2 / 2) * _normal_cdf((lc - mu - sigma ** 2) / sigma) + cap * above
    m2 = math.exp(2 * mu + 2 * sigma ** 2) * _normal_cdf((lc - mu - 2 * sigma ** 2) / sigma) + cap ** 2 * above
    return m1, math.sqrt(max(0.0, m2 - m1 ** 2))


def fit_lengths(capped_mean: float, capped_std: float, cap: int) -> Lengths:
    """The log-normal (cut at ``cap``) whose capped mean and deviation are the measured ones."""
    capped_mean = min(max(capped_mean, 1.0), cap * 0.999)
    best: tuple[float, Lengths] | None = None
    for sigma in [i / 20 for i in range(0, 41)]:
        lo, hi = 1.0, 100.0 * cap
        for _ in range(60):  # the uncapped mean whose capped mean is the measured one
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if capped_moments(mid, sigma, cap)[0] < capped_mean else (lo, mid)
        mean = (lo + hi) / 2
        miss = abs(capped_moments(mean, sigma, cap)[1] - capped_std)
        if best is None or miss < best[0]:
            best = (miss, Lengths(mean=mean, sigma=sigma, cap=cap))
    assert best is not None
    return best[1]


def expected_longest(lengths: Lengths, rows: int, draws: int = 400) -> float:
    """The mean longest of ``rows`` completions (by sampling, a fixed seed)."""
    rng = random.Random(7)
    return sum(max(lengths.sample(rng, rows)) for _ in range(draws)) / draws


def least_squares(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares of ``y = x . c`` by elimination: columns that do not vary
    (beyond the first, the constant) or whose coefficient comes out negative are dropped
    and refitted without. Small systems only (a handful of columns)."""
    n = len(xs[0])
    keep = [0] + [j for j in range(1, n) if statistics.pstdev([x[j] for x in xs]) > 1e-9 * (1 + abs(xs[0][j]))]
    while True:
        coef = _solve([[x[j] for j in keep] for x in xs], ys)
        if coef is None:
            keep = keep[:-1]
            continue
        bad = [keep[i] for i, c in enumerate(coef) if c < 0]
        if not bad:
            out = [0.0] * n
            for j, c in zip(keep, coef):
                out[j] = c
            return out
        if bad == [0] and len(keep) > 1:  # a negative constant: the slope alone
            keep = keep[1:]
        else:
            keep = [j for j in keep if j != max(bad)]
        if not keep:
            return [0.0] * n


def robust_fit(xs: list[list[float]], ys: list[float], rounds: int = 2) -> list[float]:
    """``least_squares`` without the points whose residual is far off the others' (over 3
    median absolute deviations): on a shared machine a timing now and then is several
    times the usual one, and the simulator is to predict the typical step, not the mean."""
    keep = list(range(len(ys)))
    coef = least_squares(xs, ys)
    for _ in range(rounds):
        res = [ys[i] - sum(c * x for c, x in zip(coef, xs[i])) for i in keep]
        mid = statistics.median(res)
        mad = statistics.median(abs(r - mid) for r in res)
        if mad <= 0:
            break
        kept = [i for i, r in zip(keep, res) if abs(r - mid) <= 3 * 1.4826 * mad]
        if len(kept) == len(keep) or len(kept) < 3:
            break
        keep = kept
        coef = least_squares([xs[i] for i in keep], [ys[i] for i in keep])
    return coef


def _solve(xs: list[list[float]], ys: list[float]) -> list[float] | None:
    k = len(xs[0]) if xs else 0
    if k == 0:
        return []
    a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] + [sum(x[i] * y for x, y in zip(xs, ys))] for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row[:k])):
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(k):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [u - f * v for u, v in zip(a[r], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


@dataclass
class Calibration:
    """Cost models fitted from one run, and that run's configuration."""

    config: dict[str, Any]
    lengths: Lengths
    gen: GenCost
    reward: RewardCost
    train: TrainCost
    sync: SyncCost
    cores: int = 0
    """The run's host's cores, when it ran on CPUs (``Loop.cores``); 0 on GPUs."""
    host_load: float = 0.0
    """Other programs' runnable threads while it ran (``Loop.host_load``)."""
    notes: list[str] = field(default_factory=list)
    """What the run could not tell apart, and what was assumed instead."""

    def loop(self, *, extra_reward_s_per_rollout: float = 0.0, max_new_tokens: int | None = None,
             **overrides: Any) -> Loop:
        """The calibrated loop, in the run's configuration unless ``overrides`` (``Loop``'s
        fields) say otherwise; ``extra_reward_s_per_rollout`` adds a known wait per rollout
        scored (``RewardCost.wait_s``)."""
        base = {name: self.config[key] for key, name in RUN_FLAGS.items() if key in self.config}
        base.update(cores=self.cores, host_load=self.host_load)
        base.update(overrides)
        lengths = self.lengths if max_new_tokens is None else replace(self.lengths, cap=max_new_tokens)
        reward = replace(self.reward, wait_s=self.reward.wait_s + extra_reward_s_per_rollout)
        return Loop(**base, lengths=lengths, gen=self.gen, reward=reward, train=self.train, sync=self.sync)

    def summary(self) -> dict[str, Any]:
        return {"lengths": vars(self.lengths), "gen": vars(self.gen), "reward": vars(self.reward),
                "train": vars(self.train), "sync": vars(self.sync), "cores": self.cores,
                "host_load": self.host_load, "notes": self.notes}


# --------------------------------------------------------------------------- reading a run

class _Db:
    def __init__(self, run_dir: str | Path) -> None:
        path = Path(run_dir) / DB_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir}: no {DB_NAME} (is it a run directory, runs/<id>?)")
        self.db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        self.config: dict[str, Any] = json.loads(row[0]) if row else {}
        world = self.config.get("trainer_ranks") or 1
        self.config.setdefault("trainer_ranks", world)

    def intervals(self, role: str, what: str | None = None) -> list[tuple[int, str, str, float, float]]:
        sql = "SELECT replica, kind, what, t0, t1 FROM intervals WHERE role = ?"
        args: list[Any] = [role]
        if what is not None:
            sql += " AND what = ?"
            args.append(what)
        return list(self.db.execute(sql + " ORDER BY t0", args))

    def scalars(self, name: str, role: str) -> list[tuple[int, float, float]]:
        return list(self.db.execute("SELECT replica, t, value FROM scalars WHERE name = ? AND role = ? ORDER BY t",
                                    [name, role]))

    def step_s(self) -> list[float]:
        return [v for (v,) in self.db.execute(
            "SELECT value FROM scalars WHERE name = ? AND role = 'trainer' AND replica = 0 ORDER BY step",
            [names.TRAIN_STEP_S])]

    def close(self) -> None:
        self.db.close()


def _auto_bound(db: _Db, notes: list[str]) -> int:
    """The bound an ``auto`` run (``--max-staleness auto``) held for most of its steps
    (its ``staleness/bound`` scalar), since the simulator runs one fixed bound."""
    bounds = [round(v) for _, _, v in db.scalars(names.STALENESS_BOUND, "trainer")]
    if not bounds:
        raise ValueError("the run's --max-staleness is auto but it recorded no staleness/bound: "
                         "nothing tells which bound to simulate (give one with --max-staleness K)")
    held = statistics.mode(bounds)
    notes.append(f"--max-staleness auto: simulated at {held}, the bound it held longest "
                 f"(from {min(bounds)} to {max(bounds)} over {len(bounds)} steps)")
    return held


def _paired(db: _Db, role: str, what: str, rate_names: list[str]) -> list[tuple[int, float, float, float, list[float]]]:
    """Each unit of work of ``role`` with the rates its executor reported after it: the
    ``what`` intervals before one report (the first scalar of each name at or after their
    end, same replica) are one unit, since an executor reports once per unit: a
    generator's batch is several ``generate`` intervals, cut by the push of each group
    (``llamarl.app.control.outbox``), and its rates are over their sum. (replica, first
    t0, last t1, busy seconds, [rate x busy seconds for each name])."""
    rates = {n: {} for n in rate_names}
    for n in rate_names:
        for rep, t, v in db.scalars(n, role):
            rates[n].setdefault(rep, []).append((t, v))
    units: dict[tuple[int, int], list[float]] = {}  # (replica, report) -> [t0, t1, busy]
    for rep, _, _, t0, t1 in db.intervals(role, what):
        found = []
        for n in rate_names:
            series = rates[n].get(rep, [])
            i = bisect.bisect_left(series, (t1 - 1e-6, -math.inf))
            if i >= len(series) or series[i][0] - t1 > 5.0:
                break
            found.append(i)
        else:
            unit = units.setdefault((rep, found[0]), [t0, t1, 0.0, *found])
            unit[1], unit[2] = t1, unit[2] + (t1 - t0)
    out = []
    for (rep, _), (t0, t1, busy, *found) in sorted(units.items(), key=lambda kv: kv[1][0]):
        amounts = [rates[n][rep][i][1] * busy for n, i in zip(rate_names, found)]
        out.append((rep, t0, t1, busy, amounts))
    return out


def _cycle_overheads(units: list[tuple[int, float, float, float, list[float]]],
                     rows: list[tuple[int, str, str, float, float]],
                     modeled: tuple[str, ...]) -> list[tuple[float, float, float]]:
    """Per replica, the time from the start of one unit of work to the next that is neither
    the unit's busy time nor an idle wait the simulator models (``modeled``): its pushes,
    swaps, reservations and metrics, the executor's untimed work per cycle; with the
    window most of it fell in, from the unit's end to the next's start."""
    out = []
    for rep in sorted({u[0] for u in units}):
        mine = [u for u in units if u[0] == rep]
        waits = [(t0, t1) for r, kind, w, t0, t1 in rows if r == rep and kind == "idle" and w in modeled]
        for (_, a0, a1, busy, _), (_, b0, *_) in zip(mine, mine[1:]):
            waited = sum(max(0.0, min(t1, b0) - max(t0, a0)) for t0, t1 in waits)
            out.append((max(0.0, b0 - a0 - busy - waited), a1, b0))
    return out


def _untimed_gaps(rows: list[tuple[int, str, str, float, float]], what: str) -> list[float]:
    """Per replica, the time between the end of one ``what`` interval and the start of the
    next that no recorded interval covers: the executor's untimed work per cycle."""
    gaps = []
    by_rep: dict[int, list[tuple[float, float, str]]] = {}
    for rep, _, w, t0, t1 in rows:
        by_rep.setdefault(rep, []).append((t0, t1, w))
    for spans in by_rep.values():
        spans.sort()
        starts = [i for i, (_, _, w) in enumerate(spans) if w == what]
        for a, b in zip(starts, starts[1:]):
            covered = sum(t1 - t0 for t0, t1, _ in spans[a + 1:b])
            gaps.append(max(0.0, spans[b][0] - spans[a][1] - covered))
    return gaps


def from_run(run_dir: str | Path, *, lengths_sigma: float | None = None) -> Calibration:
    """The cost models of the run in ``run_dir`` (``runs/<id>``)."""
    db = _Db(run_dir)
    try:
        return _fit(db, lengths_sigma)
    finally:
        db.close()


def _fit(db: _Db, lengths_sigma: float | None) -> Calibration:
    cfg, notes = db.config, []
    if cfg.get("max_staleness") == "auto":
        cfg["max_staleness"] = _auto_bound(db, notes)
    cap = int(cfg.get("max_new_tokens", 48))
    batches = _paired(db, "generator", "generate", [names.GEN_TOKENS_PER_S, names.GEN_SEQS_PER_S])
    if not batches:
        raise ValueError("the run recorded no generator batch (generate intervals with gen/tokens_per_s)")
    tokens = [a[0] for *_, a in batches]
    rows = [max(1, round(a[1])) for *_, a in batches]
    mean_len = sum(tokens) / sum(rows)
    batch_means = [t / r for t, r in zip(tokens, rows)]
    row_std = math.sqrt(statistics.pvariance(batch_means) * statistics.mean(rows)) if len(batches) > 1 else 0.0
    lengths = (fit_lengths(mean_len, row_std, cap) if lengths_sigma is None
               else Lengths.with_capped_mean(mean_len, sigma=lengths_sigma, cap=cap))
    steps = _paired(db, "trainer", "train", [names.TRAIN_TOKENS_PER_S])
    cores, load, cost = host.fit(db, cfg, batches, steps, notes)
    longest = {r: expected_longest(lengths, r) for r in set(rows)}
    r_s = 0.0
    if cores and statistics.pstdev(rows) < NARROW * statistics.mean(rows):
        # One batch shape: what a batch costs beyond its tokens cannot be told apart from a
        # per-batch, per-row or per-step cost, and another group size's batches differ in
        # rows. A CPU computes every row (its prompt's prefill, each step's compute), so on
        # a CPU host it is taken per row; a GPU's step is memory-bound, whatever the rows.
        r_s, c = robust_fit([[float(r), t] for r, t in zip(rows, tokens)], cost["generator"])
        a = b = 0.0
        notes.append("one batch shape on a CPU host: the generator's cost per row and per token "
                     "(per batch and per decode step left at 0)")
    else:
        a, b, c = robust_fit([[1.0, longest[r], t] for r, t in zip(rows, tokens)], cost["generator"])
        if len(set(rows)) == 1:
            notes.append("one batch shape: per-batch and per-decode-step generator costs are one term (batch_s)")
    gaps = _cycle_overheads(batches, db.intervals("generator"), ("wait_weights", "staleness_bound"))
    gen = GenCost(batch_s=a, row_s=r_s, step_s=b, token_s=c,
                  overhead_s=_median(host.gap_work(gaps, host.busy_spans(db), cores, load) if cores
                                     else [g for g, _, _ in gaps]))

    scores = _paired(db, "reward", "score", [names.REWARD_SAMPLES_PER_S])
    if scores:
        ra, rb = robust_fit([[1.0, amt[0]] for *_, amt in scores], host.unit_work(db, scores, cores, load))
        reward = RewardCost(batch_s=ra, rollout_s=rb)
    else:
        reward = RewardCost()
        notes.append("no reward executor: inline scoring taken as free (untimed in the trainer's thread)")

    step_tokens = [amt[0] for *_, amt in steps]
    if len(steps) > 2 and statistics.pstdev(step_tokens) < NARROW * statistics.mean(step_tokens):
        # Batches of one size: a constant and a per-token cost cannot be told apart, and a
        # training pass is forward and backward over its tokens: all of it per token.
        ta, (tb,) = 0.0, robust_fit([[t] for t in step_tokens], cost["trainer"])
        notes.append("one training batch size: the training step taken as proportional to its tokens")
    else:
        ta, tb = robust_fit([[1.0, t] for t in step_tokens], cost["trainer"])
    trainer = db.intervals("trainer")
    per_step_sync = _per_train(trainer, ("weight_sync", "weight_digest"))
    alone = cpu_share(cores, load, 1)  # the trainer's untimed work and syncs: at the share of a phase alone
    evals = host.unit_work(db, [(0, t0, t1, t1 - t0) for _, _, w, t0, t1 in trainer if w == "eval"], cores, load)
    train = TrainCost(step_s=ta, token_s=tb, overhead_s=alone * _median(_untimed_gaps(trainer, "train")),
                      eval_s=_median(evals))
    sent = [nb for (nb,) in db.db.execute("SELECT bytes FROM weight_sync WHERE receiver LIKE 'trainer%'")]
    nbytes = float(_median(sent))
    sync_s = alone * _median(per_step_sync)
    sync = SyncCost(fixed_s=0.0 if nbytes else sync_s, byte_s=sync_s / nbytes if nbytes else 0.0, bytes=nbytes)
    notes.append("one policy size: the sync's fixed and per-byte costs are one term (byte_s); "
                 "one receiver count: receiver_slope left at 0")
    return Calibration(config=cfg, lengths=lengths, gen=gen, reward=reward, train=train, sync=sync,
                       cores=cores, host_load=load, notes=notes)


def _per_train(rows: list[tuple[int, str, str, float, float]], whats: tuple[str, ...]) -> list[float]:
    """The seconds of ``whats`` intervals between consecutive ``train`` intervals (replica 0)."""
    spans = sorted((t0, t1, w) for rep, _, w, t0, t1 in rows if rep == 0)
    out, acc, seen_train = [], 0.0, False
    for t0, t1, w in spans:
        if w == "train":
            if seen_train:
                out.append(acc)
            acc, seen_train = 0.0, True
        elif w in whats and seen_train:
            acc += t1 - t0
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# --------------------------------------------------------------------------- what a run measured

def host_load(run_dir: str | Path) -> float:
    """The other programs' load on the host while the run in ``run_dir`` ran (0 for a run
    on GPUs or without CPU seconds): the environment a prediction of that run needs, on a
    machine shared with others."""
    db = _Db(run_dir)
    try:
        batches = _paired(db, "generator", "generate", [names.GEN_TOKENS_PER_S, names.GEN_SEQS_PER_S])
        return host.fit(db, db.config, batches, _paired(db, "trainer", "train", [names.TRAIN_TOKENS_PER_S]), [])[1]
    finally:
        db.close()


def measured(run_dir: str | Path) -> Report:
    """What the run in ``run_dir`` measured, as the simulator reports it: step times, idle
    fractions over the intervals after the first training pass began, staleness of the
    trained rollouts (by rollout), dropped groups, throughput."""
    db = _Db(run_dir)
    try:
        step_s = db.step_s()
        first = db.db.execute("SELECT MIN(t0) FROM intervals WHERE role = 'trainer' AND what = 'train'").fetchone()[0]
        idle: dict[str, list[float]] = {}
        per: dict[str, list[float]] = {}
        for role, rep, kind, total in db.db.execute(
                "SELECT role, replica, kind, SUM(t1 - t0) FROM intervals WHERE t0 >= ? GROUP BY role, replica, kind",
                (first or 0.0,)):
            for key, table in ((role, idle), (f"{role}/{rep}", per)):
                table.setdefault(key, [0.0, 0.0])[kind == "idle"] += total
        lags = dict(db.db.execute("SELECT staleness, COUNT(*) FROM staleness WHERE used = 1 GROUP BY staleness"))
        dropped = db.db.execute("SELECT COUNT(*) FROM staleness WHERE used = 0").fetchone()[0]
        group = int(db.config.get("group_size", 1)) or 1
        tokens = db.db.execute("SELECT SUM(value) FROM scalars WHERE name = ? AND role = 'trainer' AND replica = 0 "
                               "AND step > 1", [names.RESPONSE_LEN]).fetchone()[0] or 0.0
    finally:
        db.close()
    frac = {k: i / (b + i) if b + i > 0 else 0.0 for k, (b, i) in idle.items()}
    span = sum(step_s[1:])
    per_step = int(db.config.get("prompts_per_step", 0)) * group
    return Report(step_s=step_s, idle=frac, staleness={int(k): v // group for k, v in lags.items()},
                  idle_per_executor={k: i / (b + i) if b + i > 0 else 0.0 for k, (b, i) in per.items()},
                  dropped=dropped // group, samples_per_s=per_step * (len(step_s) - 1) / span if span else 0.0,
                  tokens_per_s=tokens * per_step / span if span else 0.0)
