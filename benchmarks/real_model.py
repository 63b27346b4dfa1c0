"""Does the real-model job teach SmolLM2-135M-Instruct? Held-out accuracy before and after
N steps, over seeds, and the same job synchronous (``max_staleness 0``) beside it.

    python benchmarks/real_model.py --sync-seeds --json benchmarks/results/real_model.json --extra --eval-samples 4
    python benchmarks/real_model.py --seeds 0 --sync-seeds 0 --steps 10 --json out.json   # one pair

Every run is the real-model job (the default job, ``torchx run``: SmolLM2-135M-Instruct on
the shipped GSM8K-format sample with its chat template and system prompt,
``components.llamarl.REAL_MODEL_JOB_ARGS``) with ``--steps N``, one torch thread per
process, the seed of the data order and of sampling set per run, and held-out accuracy
(100 problems) at step 0 and step N only. For each seed the asynchronous run
(``max_staleness 1``, the default) and, for ``--sync-seeds``, the synchronous one run back
to back, so that the machine's load falls on both alike.

``acc_start`` and ``acc_end`` are the policy's held-out accuracy: the share of right
answers among samples at the job's temperature (``--eval-samples`` per problem), the
distribution RL trains (pass@1 of samples, as DeepSeek-R1 reports its results), means
over the asynchronous seeds; ``acc_se`` is the standard error of the mean gain over them
(the spread of the gains, over sqrt(seeds)); ``acc_se_eval`` the binomial standard error
of one such accuracy (every sample counted), the floor that the held-out set puts under
any comparison. The target: ``acc_end - acc_start >= 3 * acc_se``. ``greedy`` holds the
same for greedy decoding. ``step_ratio`` is the synchronous median step time over the
asynchronous one, per seed and its median.

``--reuse OUT.json`` takes the runs of an earlier output for the seeds it has and this
invocation does not run (refused unless it ran the same steps, job flags and extras): a
long measurement can be finished in parts.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import sys
import time
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState

if not __package__:  # `python benchmarks/real_model.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import apps  # noqa: E402
from benchmarks.async_vs_sync import summarise  # noqa: E402
from llamarl.app import cli, names  # noqa: E402
from llamarl.app.config import GeneratorConfig, TrainerConfig  # noqa: E402
from llamarl.app.data import sources as data  # noqa: E402
from llamarl.components.llamarl import DEFAULT_STEPS, REAL_MODEL_JOB_ARGS, REAL_MODEL_POLICY  # noqa: E402

TARGET_SE = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="RL steps per run (the default job's)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                   help="seeds of the asynchronous runs (none: only --reuse's)")
    p.add_argument("--sync-seeds", type=int, nargs="*", default=[0, 1, 2],
                   help="seeds also run with --max-staleness 0 (none: skip the comparison)")
    p.add_argument("--runs-dir", default="runs/bench-real-model")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--reuse", type=Path, nargs="*", default=[],
                   help="earlier --json outputs whose runs stand in for seeds not run now")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more trainer flags for every run (after the real-model job's)")
    return p.parse_args(argv)


def run(seed: int, max_staleness: int, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    """One real-model job (``extra``: trainer flags after ``args.extra``); its summary
    (``benchmarks.async_vs_sync.summarise``) and minutes."""
    options = ["--policy", REAL_MODEL_POLICY, "--steps", str(args.steps), "--max_staleness", str(max_staleness),
               "--threads", "1", "--runs_dir", args.runs_dir]
    flags = ["--seed", str(seed), "--gen-seed", str(seed), "--eval-every", str(args.steps), *args.extra, *extra]
    mode = f"seed {seed} max_staleness {max_staleness}{''.join(' ' + a for a in extra)}"
    with get_runner() as runner:
        t0 = time.time()
        handle = apps.start(runner, options, flags, log_dir=f"{args.runs_dir}/torchx-logs")
        state = apps.wait(runner, handle, args.timeout_s).state
        if state != AppState.SUCCEEDED:
            raise RuntimeError(f"{mode}: the run ended {state}: see {args.runs_dir}/torchx-logs")
    minutes = (time.time() - t0) / 60
    out = {**summary(Path(args.runs_dir) / handle.rsplit("/", 1)[-1]), "minutes": minutes}
    print(f"{mode}: accuracy {out['sampled_start']:.3f} -> {out['sampled']:.3f} sampled, {out['acc_start']:.3f} -> "
          f"{out['acc']:.3f} greedy, median step {out['median_step_s']:.1f} s, {minutes:.1f} min",
          file=sys.stderr, flush=True)
    return out


def summary(run_dir: Path) -> dict:
    """``benchmarks.async_vs_sync.summarise`` (greedy accuracy at the first and last
    evaluation) and the sampled accuracy at both, and the share of the first and last
    step's completions with no readable answer."""
    out = summarise(run_dir)
    db = sqlite3.connect(f"file:{run_dir / 'metrics.db'}?mode=ro", uri=True)

    def first_last(name: str) -> tuple[float, float]:
        values = [v for (v,) in db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step", [name])]
        return values[0], values[-1]

    (out["sampled_start"], out["sampled"]) = first_last(names.eval_metric("sampled_accuracy"))
    (out["no_answer_first"], out["no_answer_last"]) = first_last(names.FRAC_NO_ANSWER)
    db.close()
    return out


def eval_precision(extra: list[str]) -> str:
    """The precision the runs' held-out evaluation samples at (``--eval-precision``)."""
    cfg, gen = cli.parse([*REAL_MODEL_JOB_ARGS, *extra], TrainerConfig, GeneratorConfig)
    return cfg.eval_at(gen)


def reused(paths: list[Path], args: argparse.Namespace) -> dict[int, dict]:
    """The runs of earlier outputs, by seed, summarised again from their metrics databases
    (which must still be there); refused unless they ran what this run runs (an output
    without ``eval_precision`` was evaluated in fp32, before ``--eval-precision``)."""
    runs: dict[int, dict] = {}
    for path in paths:
        earlier = json.loads(path.read_text())
        ran = (earlier["steps"], earlier["default_job_args"], earlier["extra"], earlier.get("eval_precision", "fp32"))
        now = (args.steps, list(REAL_MODEL_JOB_ARGS), args.extra, eval_precision(args.extra))
        if ran != now:
            raise SystemExit(f"--reuse {path}: it ran steps, job flags, extras and evaluation precision {ran}, "
                             f"this run {now}")
        for seed, modes in earlier["runs"].items():
            for mode, r in modes.items():
                if not (Path(r["run_dir"]) / "metrics.db").is_file():
                    raise SystemExit(f"--reuse {path}: seed {seed}'s {mode} run {r['run_dir']} has no metrics.db")
            runs[int(seed)] = {mode: {**r, **summary(Path(r["run_dir"]))} for mode, r in modes.items()}
    return runs


def gain(runs: list[dict], start: str, end: str) -> dict:
    """Mean ``start`` and ``end`` accuracy over ``runs``, the gain, the standard error of
    the mean gain and the gain in those."""
    gains = [r[end] - r[start] for r in runs]
    se = statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else float("nan")
    mean_gain = statistics.mean(gains)
    return {"start": statistics.mean(r[start] for r in runs), "end": statistics.mean(r[end] for r in runs),
            "gain": mean_gain, "se": se, "gain_in_se": mean_gain / se if se and se > 0 else None,
            "per_seed": [r[end] for r in runs]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.time()
    data.resolve_policy(REAL_MODEL_POLICY)  # converted once, outside every run's timing
    runs: dict[int, dict] = {}
    for seed in args.seeds:
        runs[seed] = {"async": run(seed, 1, args)}
        if seed in args.sync_seeds:
            runs[seed]["sync"] = run(seed, 0, args)
    runs = {**{s: r for s, r in reused(args.reuse, args).items() if s not in runs}, **runs}
    runs = dict(sorted(runs.items()))
    done = [r["async"] for r in runs.values()]
    policy, greedy = gain(done, "sampled_start", "sampled"), gain(done, "acc_start", "acc")
    flags = [*REAL_MODEL_JOB_ARGS, *args.extra]  # the last of a flag is the one the runs used

    def last(flag: str, default: int) -> int:
        return int(flags[len(flags) - flags[::-1].index(flag)]) if flag in flags else default

    eval_size, eval_samples = last("--eval-size", 0), last("--eval-samples", 1)
    pairs = [r for r in runs.values() if "sync" in r]
    ratios = [r["sync"]["median_step_s"] / r["async"]["median_step_s"] for r in pairs]
    result = {
        "acc_start": policy["start"], "acc_end": policy["end"], "gain": policy["gain"], "acc_se": policy["se"],
        "gain_in_se": policy["gain_in_se"],
        "acc_se_eval": math.sqrt(policy["end"] * (1 - policy["end"]) / (eval_size * eval_samples)),
        "eval_size": eval_size, "eval_samples": eval_samples,
        "greedy": {**greedy, "se_eval": math.sqrt(greedy["end"] * (1 - greedy["end"]) / eval_size)},
        "steps": args.steps, "minutes": statistics.mean(r["minutes"] for r in done),
        "minutes_all": (time.time() - t0) / 60,
        "minutes_runs": sum(r["minutes"] for modes in runs.values() for r in modes.values()),
        "step_ratio": statistics.median(ratios) if ratios else None, "step_ratios": ratios,
        "acc_end_sync": statistics.mean(r["sync"]["sampled"] for r in pairs) if pairs else None,
        "acc_end_async_same_seeds": statistics.mean(r["async"]["sampled"] for r in pairs) if pairs else None,
        "greedy_end_sync": statistics.mean(r["sync"]["acc"] for r in pairs) if pairs else None,
        "greedy_end_async_same_seeds": statistics.mean(r["async"]["acc"] for r in pairs) if pairs else None,
        "default_job_args": list(REAL_MODEL_JOB_ARGS), "extra": args.extra, "eval_precision": eval_precision(args.extra),
        "runs": {str(s): r for s, r in runs.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    for what, g in (("sampled (the policy)", policy), ("greedy", greedy)):
        print(f"held-out accuracy, {what}: {g['start']:.3f} -> {g['end']:.3f} over {len(done)} seeds, gain "
              f"{g['gain']:+.3f}, SE {g['se']:.3f} ({g['gain_in_se'] or float('nan'):.1f} SE; target >= {TARGET_SE:g})")
    print(f"{args.steps} steps, {result['minutes']:.1f} min a run")
    if ratios:
        print(f"sync/async median step time {result['step_ratio']:.2f}x; sampled accuracy sync "
              f"{result['acc_end_sync']:.3f}, async {result['acc_end_async_same_seeds']:.3f} "
              f"(eval SE {result['acc_se_eval']:.3f})")


if __name__ == "__main__":
    main()
