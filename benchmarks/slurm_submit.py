"""How long the llamarl app takes under SLURM, from ``torchx run -s slurm_llamarl`` to its first
RL step and to SUCCEEDED, on the cluster that answers (deploy/slurm/local-cluster.sh).

    deploy/slurm/local-cluster.sh up
    python -m llamarl.app.rl.warmstart --out /tmp/tiny-policy --steps 4 --batch-size 8 --train-size 64 --eval-size 2
    python benchmarks/slurm_submit.py --policy /tmp/tiny-policy --json benchmarks/results/slurm_submit.json

(A tiny warm start, as the tests use: this measures the deployment, not the learning.)

Each repeat submits the app (trainer, ``--generators`` generators, one reward executor) with
the torchx CLI from the repository, as the README does, into a fresh directory given as
``--image`` (its runs directory and logs land there), then polls the trainer's log for its
first step and ``torchx status`` (through the runner) for the end. Reported: the median
over the repeats of submit to RUNNING, to the first step and to SUCCEEDED; each repeat's
figures are in ``details``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState

from llamarl.app.names import free_port

REPO = Path(__file__).resolve().parents[1]


def one_run(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "slurm_llamarl", "llamarl.llamarl",
           "--image", str(workdir), "--policy", args.policy, "--runs_dir", str(workdir / "runs"),
           "--store_port", str(free_port()), "--steps", str(args.steps), "--num_generators", str(args.generators),
           "--num_reward", "1", "--", "--eval-every", str(args.steps), "--eval-size", "20"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"torchx run failed:\n{proc.stderr[-3000:]}")
    handle = proc.stdout.strip().splitlines()[-1]
    app_id = handle.rsplit("/", 1)[-1]
    trainer_log = workdir / f"slurm-{app_id}-trainer-0.out"
    times: dict[str, float] = {"submitted_s": time.monotonic() - t0}
    with get_runner() as runner:
        while True:
            elapsed = time.monotonic() - t0
            if elapsed > args.timeout_s:
                runner.cancel(handle)
                raise TimeoutError(f"{handle} did not end within {args.timeout_s} s")
            if "running_s" not in times and subprocess.run(
                    ["squeue", "-h", "-t", "RUNNING", "-j", app_id], capture_output=True, text=True).stdout.strip():
                times["running_s"] = elapsed
            if "first_step_s" not in times and trainer_log.is_file() and \
                    f"step 1/{args.steps}" in trainer_log.read_text(errors="replace"):
                times["first_step_s"] = elapsed
            status = runner.status(handle)
            if status is not None and status.is_terminal():
                if status.state != AppState.SUCCEEDED:
                    raise RuntimeError(f"{handle} ended {status.state}:\n{trainer_log.read_text()[-3000:]}")
                times["succeeded_s"] = elapsed
                return {k: round(v, 2) for k, v in times.items()}
            time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="tiny", help="policy: tiny (warm-started once, in checkpoints/), or a directory every node reads")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    load_before = os.getloadavg()[0]  # other work on the machine slows every figure
    details = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="llamarl-slurm-bench-") as tmp:
            details.append(one_run(args, Path(tmp)))
            print(details[-1], flush=True)
    medians = {k: statistics.median(d.get(k, float("nan")) for d in details) for k in details[0]}
    nodes = subprocess.run(["sinfo", "-h", "-o", "%D %c %m"], capture_output=True, text=True).stdout.split()
    result = {
        "benchmark": "slurm_submit",
        "config": {"steps": args.steps, "generators": args.generators, "reward_executors": 1,
                   "policy": args.policy, "repeats": args.repeats},
        "machine": {"platform": platform.platform(), "sinfo_nodes_cpus_mem": " ".join(nodes),
                    "load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0]},
        "median": medians,
        "details": details,
    }
    print(f"median over {args.repeats}: submit to RUNNING {medians.get('running_s')} s, to first step "
          f"{medians.get('first_step_s')} s, to SUCCEEDED {medians['succeeded_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
