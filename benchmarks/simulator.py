"""The simulator (``llamarl.app.sim``) against measured runs of the real app on this machine.

    python benchmarks/simulator.py --json out.json [--policy DIR] [--steps 10]
    python benchmarks/simulator.py --json out.json --reuse runs/bench-simulator/manifest.json

Runs one calibration configuration and CONFIGS (sync and async, 1 or 2 generators,
staleness 0 to 3, group sizes 4 and 8, inline scoring or a reward executor, a slow
reward) through TorchX on the local scheduler, short runs of the tiny warm-started
policy; fits the simulator's cost models from the calibration run's metrics database
only (``llamarl.app.sim.calibrate.from_run``), predicts every other configuration's median
step time and idle fractions, and compares them with what each run measured (steps after
the first). The one thing a prediction is told beyond its configuration is the slow
reward's pause per sample, a known constant the calibration run never saw.

Writes ``configs`` (``name``, ``measured_step_s``, ``predicted_step_s``, ``error``,
``measured_idle``, ``predicted_idle``) and the async/sync ratios, measured and predicted,
for each pair of configurations that differ only in the staleness bound. On this shared
machine a prediction also needs the other programs' load while the run ran: ``host_load``
(read from the run's CPU seconds, ``calibrate.host_load``) and ``predicted_at_run_load_s``,
the same costs at that load (``predicted_step_s`` uses the calibration run's). ``--reuse``
takes the run directories of an earlier invocation (its ``manifest.json``) and only
predicts again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState

if not __package__:  # `python benchmarks/simulator.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import apps  # noqa: E402
from llamarl.app.sim import calibrate, engine  # noqa: E402

SLOW_PAUSE_S = 0.02
SLOW_REWARD = f"benchmarks.sim_reward:Pause(seconds={SLOW_PAUSE_S})"


@dataclass(frozen=True)
class Case:
    """One configuration of the app: its component options and trainer flags."""

    name: str
    max_staleness: int
    generators: int = 1
    reward_executors: int = 0
    group_size: int = 4
    slow_reward: bool = False
    extra: tuple[str, ...] = field(default=())

    def options(self, args: argparse.Namespace) -> list[str]:
        return ["--num_generators", str(self.generators), "--num_reward", str(self.reward_executors),
                "--steps", str(args.steps), "--max_staleness", str(self.max_staleness),
                "--runs_dir", args.runs_dir, "--threads", "1", "--policy", args.policy,
                "--rewards", SLOW_REWARD if self.slow_reward else "math_verifier"]

    def flags(self, args: argparse.Namespace) -> list[str]:
        return ["--eval-every", str(args.steps), "--eval-size", "20", "--prompts-per-step", str(args.prompts),
                "--group-size", str(self.group_size), "--gen-batch-prompts", str(args.gen_batch),
                "--max-new-tokens", str(args.max_new_tokens), *self.extra]


# Batches of 5 prompts against steps of 16: the budget cuts every fourth batch to 1, so the
# calibration sees batch shapes far apart (30 and 6 rows), which tells the generators'
# per-decode-step cost from their per-token cost (24 and 36 rows could not).
CALIBRATION = Case("calibrate-async2-rew1", max_staleness=2, reward_executors=1, group_size=6,
                   extra=("--gen-batch-prompts", "5"))
CONFIGS = [
    Case("sync-g1", 0),
    Case("async1-g1", 1),
    Case("async3-g1", 3),
    Case("sync-g2", 0, generators=2),
    Case("async1-g2", 1, generators=2),
    Case("sync-G8", 0, group_size=8),
    Case("async1-G8", 1, group_size=8),
    Case("sync-rew1", 0, reward_executors=1),
    Case("async2-rew1", 2, reward_executors=1),
    Case("sync-slowrew1", 0, reward_executors=1, slow_reward=True),
    Case("async1-slowrew1", 1, reward_executors=1, slow_reward=True),
]


def launch(case: Case, args: argparse.Namespace) -> Path:
    """Runs ``case``; its run directory. The machine's load average before and after goes to
    ``<runs_dir>/loads.json``: the context of every measured figure on a shared machine."""
    loads_file = Path(args.runs_dir) / "loads.json"
    loads = json.loads(loads_file.read_text()) if loads_file.exists() else {}
    before = os.getloadavg()[0]
    with get_runner() as runner:
        t0 = time.time()
        handle = apps.start(runner, case.options(args), case.flags(args), log_dir=f"{args.runs_dir}/torchx-logs")
        app_id = handle.rsplit("/", 1)[-1]
        state = apps.wait(runner, handle, args.timeout_s).state
        if state != AppState.SUCCEEDED:
            raise RuntimeError(f"{case.name} ended {state}: see {args.runs_dir}/torchx-logs")
    print(f"{case.name}: finished in {time.time() - t0:.0f} s ({app_id})", file=sys.stderr)
    loads[case.name] = [before, os.getloadavg()[0]]
    loads_file.write_text(json.dumps(loads, indent=2))
    return Path(args.runs_dir) / app_id


def predict(fit: calibrate.Calibration, case: Case, args: argparse.Namespace,
            host_load: float | None = None) -> engine.Report:
    """The simulator's report for ``case`` from the calibration's cost models, on the
    calibration run's host load unless ``host_load`` says another."""
    cfg = fit.loop(steps=40, prompts_per_step=args.prompts, group_size=case.group_size,
                   max_staleness=case.max_staleness, generators=case.generators,
                   reward_executors=case.reward_executors, gen_batch_prompts=args.gen_batch,
                   extra_reward_s_per_rollout=SLOW_PAUSE_S if case.slow_reward else 0.0,
                   **({} if host_load is None else {"host_load": host_load}))
    return engine.simulate(cfg, seed=0)


def compare(manifest: dict[str, str], args: argparse.Namespace) -> dict:
    loads_file = Path(args.runs_dir) / "loads.json"
    loads = json.loads(loads_file.read_text()) if loads_file.exists() else {}
    fit = calibrate.from_run(manifest[CALIBRATION.name])
    rows = []
    for case in CONFIGS:
        measured = calibrate.measured(manifest[case.name])
        report = predict(fit, case, args)
        load = calibrate.host_load(manifest[case.name])
        at_load = predict(fit, case, args, host_load=load)
        rows.append({"name": case.name, "measured_step_s": measured.median_step_s,
                     "predicted_step_s": report.median_step_s,
                     "error": report.median_step_s / measured.median_step_s - 1,
                     "host_load": load, "predicted_at_run_load_s": at_load.median_step_s,
                     "error_at_run_load": at_load.median_step_s / measured.median_step_s - 1,
                     "measured_idle": measured.idle, "predicted_idle": report.idle,
                     "measured_mean_staleness": measured.mean_staleness,
                     "predicted_mean_staleness": report.mean_staleness, "run_dir": manifest[case.name],
                     "load_before_after": loads.get(case.name)})
    by_name = {r["name"]: r for r in rows}
    ratios = []
    for case in CONFIGS:
        if case.max_staleness == 0:
            continue
        twin = next((c for c in CONFIGS if c.max_staleness == 0 and c.generators == case.generators
                     and c.group_size == case.group_size and c.reward_executors == case.reward_executors
                     and c.slow_reward == case.slow_reward), None)
        if twin is None:
            continue
        a, s = by_name[case.name], by_name[twin.name]
        m, p = a["measured_step_s"] / s["measured_step_s"], a["predicted_step_s"] / s["predicted_step_s"]
        pl = a["predicted_at_run_load_s"] / s["predicted_at_run_load_s"]
        ratios.append({"async": case.name, "sync": twin.name, "measured": m, "predicted": p, "diff": p - m,
                       "predicted_at_run_load": pl, "diff_at_run_load": pl - m})
    return {"calibration": {"run_dir": manifest[CALIBRATION.name], "config": CALIBRATION.name,
                            "fit": fit.summary(), "load_before_after": loads.get(CALIBRATION.name)},
            "configs": rows, "async_sync_ratios": ratios,
            "within_10pct": sum(abs(r["error"]) <= 0.10 for r in rows),
            "ratios_within_0.1": sum(abs(r["diff"]) <= 0.1 for r in ratios),
            "within_10pct_at_run_load": sum(abs(r["error_at_run_load"]) <= 0.10 for r in rows),
            "ratios_within_0.1_at_run_load": sum(abs(r["diff_at_run_load"]) <= 0.1 for r in ratios),
            "settings": {k: getattr(args, k) for k in ("steps", "prompts", "gen_batch", "max_new_tokens", "policy")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--gen-batch", type=int, default=4, help="prompts per generator batch")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--policy", default="warmstart")
    parser.add_argument("--runs-dir", default="runs/bench-simulator")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--reuse", default="", help="a manifest.json of an earlier invocation: predict only")
    parser.add_argument("--only", default="", help="comma-separated config names to launch (with --reuse: the rest reused)")
    args = parser.parse_args()
    manifest: dict[str, str] = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    todo = [c for c in [CALIBRATION, *CONFIGS]
            if (not args.only and c.name not in manifest) or c.name in args.only.split(",")]
    if todo:
        if args.policy == "warmstart":
            from llamarl.app.rl.warmstart import ensure_warmstart
            args.policy = str(ensure_warmstart().resolve())
        Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
        for case in todo:
            try:
                manifest[case.name] = str(launch(case, args))
            except RuntimeError as e:  # under a heavy load a role's heartbeat can lapse: once more
                print(f"{e}; launching it once more", file=sys.stderr)
                manifest[case.name] = str(launch(case, args))
            (Path(args.runs_dir) / "manifest.json").write_text(json.dumps(manifest, indent=2))
    result = compare(manifest, args)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"calibrated on {CALIBRATION.name}; median step time (s) and idle fraction, measured / predicted")
    print(f"{'config':18}{'measured':>10}{'predicted':>10}{'error':>8}{'host load':>10}{'at it':>8}{'error':>8}"
          "   idle (measured / predicted)")
    for r in result["configs"]:
        idle = "  ".join(f"{k} {r['measured_idle'].get(k, 0):.2f}/{r['predicted_idle'].get(k, 0):.2f}"
                         for k in sorted(r["measured_idle"]))
        load = r["load_before_after"]
        load = f"   load average {load[0]:.0f}-{load[1]:.0f}" if load else ""
        print(f"{r['name']:18}{r['measured_step_s']:10.2f}{r['predicted_step_s']:10.2f}{r['error']:+8.0%}"
              f"{r['host_load']:10.2f}{r['predicted_at_run_load_s']:8.2f}{r['error_at_run_load']:+8.0%}   {idle}{load}")
    for r in result["async_sync_ratios"]:
        print(f"async/sync {r['async']} / {r['sync']}: measured {r['measured']:.2f}, predicted {r['predicted']:.2f}"
              f" ({r['predicted_at_run_load']:.2f} at each run's host load)")
    n, k = len(result["configs"]), len(result["async_sync_ratios"])
    print(f"{result['within_10pct']}/{n} step times within 10 %, {result['ratios_within_0.1']}/{k} ratios within 0.1; "
          f"at each run's host load: {result['within_10pct_at_run_load']}/{n}, "
          f"{result['ratios_within_0.1_at_run_load']}/{k}; wrote {args.json}")


if __name__ == "__main__":
    main()
