"""Kill the trainer mid-run and resume it: same prompts, same outcome, how fast.

    python benchmarks/resume.py --json benchmarks/results/resume.json

Through the real TorchX app on this machine, synchronous (``max_staleness=0``, one
generator: step s trains slots (s-1)*B .. s*B-1, so the prompt order is exact):

1. an uninterrupted run of ``--steps`` steps, checkpoints every ``--save-every``;
2. the same config and seed, the app killed (every process, as a node loss does) once the
   trainer has started step ``--kill-at``, then started again with ``--resume <run id>``.

Reports: the checkpoint the resume started from, whether both runs trained the same
prompts in the same order (a zero-weight reward records every prompt scored; regenerated
groups of the killed attempt are the resumed run's first), final held-out greedy accuracy
of each with its standard error, and the seconds from the kill to the resumed run's first
trained step (start-up of every role, the DCP load, the first generation included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState

if not __package__:  # `python benchmarks/resume.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import apps, record_prompts  # noqa: E402
from llamarl.app import names  # noqa: E402

def start(runner, args: argparse.Namespace, record: Path, *extra: str) -> str:
    options = ["--num_generators", "1", "--steps", str(args.steps), "--max_staleness", "0",
               "--runs_dir", args.runs_dir, "--threads", "1",
               "--policy", args.policy, "--rewards", f"math_verifier,{record_prompts.SPEC}"]
    flags = ["--eval-every", str(args.steps), "--eval-size", str(args.eval_size),
             "--prompts-per-step", str(args.prompts_per_step), "--save-every", str(args.save_every),
             "--seed", "0", *extra]
    return apps.start(runner, options, flags, log_dir=f"{args.runs_dir}/torchx-logs", env=record_prompts.env(record))


def step_times(db_path: Path) -> dict[int, float]:
    with sqlite3.connect(db_path) as db:
        return {int(s): t for s, t in db.execute(
            "SELECT step, t FROM scalars WHERE name = ?", (names.TRAIN_VERSION,))}


def final_accuracy(db_path: Path, step: int) -> float:
    with sqlite3.connect(db_path) as db:
        (acc,) = db.execute("SELECT value FROM scalars WHERE name = ? AND step = ?",
                            (names.EVAL_ACCURACY, step)).fetchone()
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=7, help="kill once the trainer works on this step")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--policy", default="tiny")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    args.runs_dir = str(work / "runs")
    B = args.prompts_per_step

    with get_runner() as runner:
        plain_record = work / "uninterrupted.jsonl"
        handle = start(runner, args, plain_record)
        assert apps.wait(runner, handle, args.timeout_s).state == AppState.SUCCEEDED, f"see {args.runs_dir}/torchx-logs"
        plain_dir = Path(args.runs_dir) / handle.rsplit("/", 1)[-1]
        print("uninterrupted run done", file=sys.stderr)

        killed_record, resumed_record = work / "killed.jsonl", work / "resumed.jsonl"
        handle = start(runner, args, killed_record)
        run_id = handle.rsplit("/", 1)[-1]
        run_dir = Path(args.runs_dir) / run_id
        deadline = time.time() + args.timeout_s
        # Killed as soon as step k-1 is recorded and its checkpoint saved: the trainer is
        # then in step k (or, steps being short, just past it).
        while (args.kill_at - 1) not in (step_times(run_dir / "metrics.db") if (run_dir / "metrics.db").exists() else {}) \
                or not (run_dir / "checkpoints" / f"step-{args.kill_at - 1 - (args.kill_at - 1) % args.save_every}").is_dir():
            if time.time() > deadline:
                raise TimeoutError("the run never reached the kill step")
            time.sleep(0.2)
        killed_at = time.time()
        runner.cancel(handle)
        recorded_at_kill = max(step_times(run_dir / "metrics.db"))
        apps.wait(runner, handle, 120)
        checkpoint = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
        handle = start(runner, args, resumed_record, "--resume", run_id)
        deadline = time.time() + args.timeout_s
        # The killed attempt may have recorded that step too; the resume deletes its row.
        while step_times(run_dir / "metrics.db").get(checkpoint + 1, 0.0) < killed_at:
            if time.time() > deadline:
                raise TimeoutError("the resumed run never trained")
            time.sleep(0.1)
        first_step_s = step_times(run_dir / "metrics.db")[checkpoint + 1] - killed_at
        assert apps.wait(runner, handle, args.timeout_s).state == AppState.SUCCEEDED, f"see {args.runs_dir}/torchx-logs"

    plain_order = record_prompts.groups(plain_record, args.group_size)[: args.steps * B]
    resumed_order = (record_prompts.groups(killed_record, args.group_size)[: checkpoint * B]
                     + record_prompts.groups(resumed_record, args.group_size)[: (args.steps - checkpoint) * B])
    acc_plain = final_accuracy(plain_dir / "metrics.db", args.steps)
    acc_resumed = final_accuracy(run_dir / "metrics.db", args.steps)
    se = math.sqrt(sum(a * (1 - a) for a in (acc_plain, acc_resumed)) / args.eval_size)
    result = {
        "steps": args.steps, "prompts_per_step": B, "group_size": args.group_size,
        "eval_size": args.eval_size, "killed_during_step": args.kill_at,
        "steps_recorded_when_killed": recorded_at_kill, "resumed_from_checkpoint": checkpoint,
        "same_prompt_order": plain_order == resumed_order, "prompts_compared": len(plain_order),
        "acc_uninterrupted": acc_plain, "acc_resumed": acc_resumed,
        "acc_difference": acc_resumed - acc_plain, "difference_se": se,
        "kill_to_first_resumed_step_s": first_step_s,
        "steps_recorded_once": sorted(step_times(run_dir / "metrics.db")) == list(range(1, args.steps + 1)),
        "machine": f"{os.cpu_count()} CPU cores",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
