"""``--max-staleness auto`` against fixed bounds of 1 and 4, through the real TorchX app.

    python benchmarks/adaptive_staleness.py --json out.json

Each case runs the app once with ``--max-staleness 1``, ``4`` and ``auto`` (cap 4), one
after the other (the same warm-started policy, trained samples, one torch thread per
process), and reports per run the held-out greedy accuracy after the last step with its
standard error (binomial, over ``--eval-size`` problems), the median step time (step 1,
with start-up, left out), the mean lag trained, the groups dropped as stale and, for
``auto``, every change of the bound with its reason. Cases:

- ``gen_fast``: two generators, rewards inline: generation outruns training, so the
  generators wait on a bound of 1;
- ``gen_slow``: one generator and a reward executor whose verifier sleeps
  ``--reward-latency-s`` a sample: the trainer waits for rollouts and a larger bound buys
  little;
- ``hurt``: ``gen_fast`` with a learning rate ten times the default and no ratio
  correction (``--no-ratio-correction``): rollouts 4 versions old, trained as if
  on-policy, against ``auto``, which watches the ratios (``--bounds 4 auto`` to leave the
  bound of 1 out).

Targets (``targets`` in the JSON): ``auto``'s accuracy within noise (2 standard errors of
a difference) of the best fixed bound's, and its median step no slower than the fixed
bound of 1's (within 5 %), in ``gen_fast`` and ``gen_slow``; in ``hurt``, ``auto`` no worse
than the fixed bound of 4. One run each on a shared 2-core machine: the step times carry
the load of the moment, and one run is one sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/adaptive_staleness.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import async_vs_sync  # noqa: E402
from llamarl.app import names  # noqa: E402
from llamarl.app.config import TrainerConfig  # noqa: E402
from llamarl.app.tasks.arithmetic import is_correct  # noqa: E402


class SlowVerifier:
    """A reward component: the built-in task's verifier after ``seconds`` of waiting (a
    remote judge's latency), for ``--rewards benchmarks.adaptive_staleness:SlowVerifier(seconds=S)``
    (a module-level class: reward workers receive it pickled)."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    def __call__(self, prompt: str, completion: str, meta: dict) -> float:
        time.sleep(self.seconds)
        return 1.0 if is_correct(completion, meta["answer"]) else 0.0


def cases(args: argparse.Namespace) -> dict[str, dict]:
    slow = f"benchmarks.adaptive_staleness:SlowVerifier(seconds={args.reward_latency_s})"
    lr = TrainerConfig().lr * args.hurt_lr_factor
    return {
        "gen_fast": {"generators": 2, "num_reward": 0, "rewards": "math_verifier", "flags": [],
                     "bounds": ["1", "4", "auto"]},
        "gen_slow": {"generators": 1, "num_reward": 1, "rewards": slow, "flags": [], "bounds": ["1", "4", "auto"]},
        "hurt": {"generators": 2, "num_reward": 0, "rewards": "math_verifier",
                 "flags": ["--lr", f"{lr:g}", "--no-ratio-correction"], "bounds": ["1", "4", "auto"]},
    }


def launch(name: str, bound: str, case: dict, args: argparse.Namespace) -> tuple[Path, list[float]]:
    """The run's directory and the machine's load average before and after it (the
    context of its step time on a shared machine)."""
    run_args = argparse.Namespace(**{**vars(args), "generators": case["generators"]})
    extra = ["--staleness-cap", "4", *case["flags"]]
    options = ["--num_reward", str(case["num_reward"]), "--rewards", case["rewards"]]
    before = os.getloadavg()[0]
    run_dir = async_vs_sync.launch(f"{name} max_staleness={bound}", bound, run_args, extra, options=options)
    return run_dir, [before, os.getloadavg()[0]]


def summarise(launched: tuple[Path, list[float]], eval_size: int) -> dict:
    run_dir, loads = launched
    out = async_vs_sync.summarise(run_dir)
    out["load_before_after"] = loads
    db = sqlite3.connect(f"file:{run_dir / 'metrics.db'}?mode=ro", uri=True)
    acc = out["acc"]
    out["acc_se"] = math.sqrt(max(acc * (1 - acc), 1e-12) / eval_size)
    out["dropped_stale"] = db.execute("SELECT COUNT(*) FROM staleness WHERE used = 0").fetchone()[0]
    bounds = [v for (v,) in db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step",
                                       [names.STALENESS_BOUND])]
    out["bound_mean"] = statistics.fmean(bounds) if bounds else None
    out["bound_changes"] = [{"step": s, "from": p, "to": b, "reason": r} for s, p, b, r in db.execute(
        "SELECT step, previous, bound, reason FROM staleness_bounds ORDER BY t")]
    out["max_lag_kl"] = db.execute("SELECT MAX(value) FROM scalars WHERE name = ?",
                                   [names.AIPO_KL_BEHAVIOUR]).fetchone()[0]
    out["min_ess"] = db.execute("SELECT MIN(value) FROM scalars WHERE name = ?", [names.AIPO_ESS]).fetchone()[0]
    db.close()
    return out


def targets(results: dict[str, dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for name, runs in results.items():
        if "auto" not in runs or len(runs) < 2:
            continue
        auto = runs["auto"]
        fixed = {b: r for b, r in runs.items() if b != "auto"}
        best = max(fixed, key=lambda b: fixed[b]["acc"])
        se = math.hypot(auto["acc_se"], fixed[best]["acc_se"])
        row = {"best_fixed": best, "acc_gap": auto["acc"] - fixed[best]["acc"], "se_of_gap": se,
               "acc_within_noise": auto["acc"] >= fixed[best]["acc"] - 2 * se}
        if "1" in fixed:
            row["step_ratio_vs_bound_1"] = auto["median_step_s"] / fixed["1"]["median_step_s"]
            row["as_fast_as_bound_1"] = row["step_ratio_vs_bound_1"] <= 1.05
        out[name] = row
    return out


def main() -> None:
    parser = async_vs_sync.launch_parser(__doc__.splitlines()[0], "runs/bench-adaptive-staleness")
    parser.add_argument("--reward-latency-s", type=float, default=0.01, help="the slow case's wait per sample")
    parser.add_argument("--hurt-lr-factor", type=float, default=10.0, help="the hurt case's lr, times the default")
    parser.add_argument("--cases", nargs="+", default=["gen_fast", "gen_slow", "hurt"])
    parser.add_argument("--bounds", nargs="+", default=["1", "4", "auto"], help="run only these of each case's bounds")
    args = parser.parse_args()
    async_vs_sync.warm_policy(args)
    t0 = time.time()
    results: dict[str, dict[str, dict]] = {}
    for name in args.cases:
        case = cases(args)[name]
        results[name] = {b: summarise(launch(name, b, case, args), args.eval_size)
                         for b in case["bounds"] if b in args.bounds}
        for b, r in results[name].items():
            print(f"{name:9} {b:>5}: acc {r['acc']:.3f} +- {r['acc_se']:.3f}  step {r['median_step_s']:.3f} s  "
                  f"mean lag {r['mean_staleness']:.2f}  dropped {r['dropped_stale']}  "
                  f"changes {[(c['step'], c['to']) for c in r['bound_changes']]}", file=sys.stderr)
    result = {"cases": results, "targets": targets(results), "steps": args.steps, "eval_size": args.eval_size,
              "reward_latency_s": args.reward_latency_s, "hurt_lr_factor": args.hurt_lr_factor,
              "seconds": time.time() - t0}
    print(json.dumps(result["targets"], indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
