"""Asynchronous against synchronous RL, side by side, through the real TorchX app.

    python benchmarks/async_vs_sync.py --json out.json
    python benchmarks/async_vs_sync.py --json out.json --trainer-ranks 2 --pairs 1   # FSDP2 trainer

Runs the default app config twice on this machine with the same resources (one
trainer, the same number of generators, one torch thread per process) and the same
number of trained samples (steps x prompts_per_step x group_size): once with
``max_staleness=0`` (the synchronous baseline: generate, train, sync) and once with
``max_staleness=1`` (generation of step N+1 overlaps training of step N). Reports the
median RL step time of each, the speedup, final held-out accuracy, and the idle
fraction of every role (from the busy/idle intervals in each run's metrics.db).

A shared 2-core machine is noisy (single runs of the same code ranged 1.2x-1.7x), so
the two modes run in ``--pairs`` alternating pairs (sync, async, sync, async, ...): each
pair gives one speedup, and every reported figure is the median over the pairs (each
pair's own figures are in ``details``).

``--trainer-ranks N`` runs the trainer as N ranks (``--nproc_per_node N``: the policy
sharded with FSDP2, each rank training on its share of every batch); the trained
samples stay the same, so its accuracy compares with a 1-rank run's.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from torchx.runner import get_runner
from torchx.specs import AppState

if not __package__:  # `python benchmarks/async_vs_sync.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import apps  # noqa: E402
from llamarl.app import names  # noqa: E402


def launch(mode: str, max_staleness: int | str, args: argparse.Namespace, extra: Sequence[str] = (),
           options: Sequence[str] = ()) -> Path:
    """The app with ``args``' steps, generators and policy; ``extra``: more trainer flags,
    ``options``: more component options."""
    options = ["--num_generators", str(args.generators), "--steps", str(args.steps),
               "--max_staleness", str(max_staleness), "--runs_dir", args.runs_dir, "--threads", "1",
               "--policy", args.policy, "--nproc_per_node", str(args.trainer_ranks), *options]
    flags = ["--eval-every", str(args.steps), "--eval-size", str(args.eval_size), *extra]
    with get_runner() as runner:
        t0 = time.time()
        handle = apps.start(runner, options, flags, log_dir=f"{args.runs_dir}/torchx-logs")
        app_id = handle.rsplit("/", 1)[-1]
        try:
            state = apps.wait(runner, handle, args.timeout_s).state
        except TimeoutError:
            raise TimeoutError(f"{mode} run did not finish within {args.timeout_s} s") from None
        if state != AppState.SUCCEEDED:
            raise RuntimeError(f"{mode} run ended {state}: see {args.runs_dir}/torchx-logs")
    print(f"{mode}: finished in {time.time() - t0:.0f} s", file=sys.stderr)
    return Path(args.runs_dir) / app_id


def summarise(run_dir: Path) -> dict:
    db = sqlite3.connect(f"file:{run_dir / 'metrics.db'}?mode=ro", uri=True)
    step_s = [v for (v,) in db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step",
                                       [names.TRAIN_STEP_S])]
    acc = db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step DESC LIMIT 1",
                     [names.EVAL_ACCURACY]).fetchone()
    acc0 = db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step LIMIT 1",
                      [names.EVAL_ACCURACY]).fetchone()
    # Idle fraction over the steady state: intervals after the first step began.
    t_first = db.execute("SELECT MIN(t0) FROM intervals WHERE role = 'trainer' AND what = 'train'").fetchone()[0]
    idle = {}
    for role, kind, total in db.execute(
            "SELECT role, kind, SUM(t1 - t0) FROM intervals WHERE t0 >= ? GROUP BY role, kind", (t_first,)):
        idle.setdefault(role, {})[kind] = total
    samples = db.execute("SELECT COUNT(*) FROM staleness WHERE used = 1").fetchone()[0]
    lags = [v for (v,) in db.execute("SELECT staleness FROM staleness WHERE used = 1")]
    db.close()
    return {
        "run_dir": str(run_dir),
        "median_step_s": statistics.median(step_s[1:] or step_s),  # step 1 includes start-up
        "acc_start": acc0[0], "acc": acc[0], "trained_samples": samples,
        "mean_staleness": sum(lags) / max(1, len(lags)),
        "idle": {role: kinds.get("idle", 0.0) / max(1e-9, sum(kinds.values())) for role, kinds in idle.items()},
    }


def launch_parser(description: str, runs_dir: str) -> argparse.ArgumentParser:
    """The options ``launch`` reads, and ``--json``: for this benchmark and the ones that
    launch their runs through it (``benchmarks/quantized.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--generators", type=int, default=1,
                        help="generator replicas in every run (the component's default)")
    parser.add_argument("--trainer-ranks", type=int, default=1,
                        help="trainer ranks in every run (more than one: the policy sharded with FSDP2)")
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--policy", default="tiny")
    parser.add_argument("--runs-dir", default=runs_dir)
    parser.add_argument("--timeout-s", type=float, default=1800)
    return parser


def warm_policy(args: argparse.Namespace) -> None:
    """``--policy tiny``: warm-started once up front, outside every run's timing."""
    if args.policy in ("tiny", "warmstart"):
        from llamarl.app.rl.warmstart import ensure_warmstart
        args.policy = str(ensure_warmstart().resolve())


def main() -> None:
    parser = launch_parser(__doc__.splitlines()[0], "runs/bench-async-vs-sync")
    parser.add_argument("--pairs", type=int, default=3, help="alternating sync/async pairs (medians reported)")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    warm_policy(args)
    pairs = [(summarise(launch("sync", 0, args)), summarise(launch("async", 1, args)))
             for _ in range(args.pairs)]

    def across_pairs(mode: int) -> dict:
        """One mode's figures: the median over the pairs of each."""
        runs = [p[mode] for p in pairs]
        roles = sorted({r for run in runs for r in run["idle"]})
        return {**{k: statistics.median(run[k] for run in runs) for k in ("median_step_s", "acc", "mean_staleness")},
                "trained_samples": runs[0]["trained_samples"],
                "idle": {r: statistics.median(run["idle"].get(r, 0.0) for run in runs) for r in roles}}

    speedups = [s["median_step_s"] / a["median_step_s"] for s, a in pairs]
    sync, async_ = across_pairs(0), across_pairs(1)
    result = {
        "sync_step_s": sync["median_step_s"], "async_step_s": async_["median_step_s"],
        "speedup": statistics.median(speedups), "pair_speedups": speedups,
        "acc_sync": sync["acc"], "acc_async": async_["acc"],
        "idle_sync": sync["idle"], "idle_async": async_["idle"],
        "details": {"pairs": [{"sync": s, "async": a} for s, a in pairs], "steps": args.steps,
                    "generators": args.generators, "eval_size": args.eval_size,
                    "trainer_ranks": args.trainer_ranks},
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"medians over {args.pairs} alternating pairs")
    print(f"{'':22}{'sync':>10}{'async':>10}")
    print(f"{'median step (s)':22}{sync['median_step_s']:10.2f}{async_['median_step_s']:10.2f}")
    print(f"{'held-out accuracy':22}{sync['acc']:10.3f}{async_['acc']:10.3f}")
    print(f"{'trained samples':22}{sync['trained_samples']:10d}{async_['trained_samples']:10d}")
    print(f"{'mean staleness':22}{sync['mean_staleness']:10.2f}{async_['mean_staleness']:10.2f}")
    for role in sorted(set(sync["idle"]) | set(async_["idle"])):
        print(f"{'idle ' + role:22}{sync['idle'].get(role, 0):10.2f}{async_['idle'].get(role, 0):10.2f}")
    print(f"speedup {result['speedup']:.2f}x (pairs: {', '.join(f'{x:.2f}x' for x in speedups)}); "
          f"wrote {args.json}")


if __name__ == "__main__":
    main()
