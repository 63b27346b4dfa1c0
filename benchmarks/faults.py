"""How fast a fault ends the whole app, and what a survivable one costs.

    python benchmarks/faults.py --json benchmarks/results/faults.json
    python benchmarks/faults.py --cases generator_lost --json benchmarks/results/faults_survive.json
    python benchmarks/faults.py --cases generator_lost_starting --json benchmarks/results/faults_starting.json

``generator_lost_starting`` (survivable too): two generators, 20 steps, generator 1 SIGKILLed
as soon as it holds its ``llamarl.app.control.replica_lock`` (its first line, before it can reach the
store); the run must finish every step with generator 0; reported: seconds from the kill
to the trainer's line that takes it out.

``generator_lost`` (a survivable fault): two generators, 60 steps, generator 1 SIGKILLed
once step 15 is logged. The run must finish every step, each once, and train exactly
steps x prompts x G rollouts; reported: the groups lost and regenerated, steps/s before
the kill and after the regroup, seconds from the kill to the weight plane's new epoch
(the trainer's log) and to the next training step (the metrics database; steps trained from
groups already queued count), and the longest gap between two steps after the kill (how
long the loss held training up).

Each case launches ``llamarl.llamarl`` through TorchX's runner on local_cwd (one torch
thread per process) and injects one fault:

- start-up errors (``--steps 0``, an unknown ``--rewards`` name): seconds from the
  launch to the app's exit, the whole app's life (roles start, the trainer refuses the
  flag, every role reads why and exits);
- a role killed mid-run (SIGKILL of the reward executor, of the only generator of a
  synchronous run, of the trainer's torchrun agent), once the trainer has logged its
  first step: seconds from the kill to the app's exit.

Two figures per case: the app's exit as TorchX sees it (every replica's process ended),
and the moment no process of the app is left (a trainer rank whose torchrun agent was
killed runs in a session of its own and exits on its own). Every case must end FAILED
with its cause in TorchX's error; the figures are medians over ``--repeats`` launches
(each launch's own pair is in ``details``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState, parse_app_handle

if not __package__:  # `python benchmarks/faults.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import apps  # noqa: E402
from llamarl.app.control import replica_lock  # noqa: E402

SMALL = ["--eval-every", "1000", "--eval-size", "20", "--prompts-per-step", "4", "--group-size", "4",
         "--gen-batch-prompts", "2", "--max-new-tokens", "16"]


@dataclass(frozen=True)
class Case:
    name: str
    cause: str
    """Text the app's error must hold."""
    options: list[str] = field(default_factory=list)
    """Component options beside the common ones."""
    kill: str = ""
    """``pgrep -f`` pattern (``{app_id}`` filled in) of the process to SIGKILL after step 1;
    empty: a start-up error, timed from the launch."""


CASES = [
    Case("steps_0", "steps must be >= 1", ["--steps", "0", "--num_generators", "2", "--num_reward", "1"]),
    Case("unknown_reward", "unknown reward", ["--rewards", "math_verifer", "--num_generators", "1"]),
    Case("reward_sigkill", "reward/0", ["--num_generators", "1", "--num_reward", "1"],
         kill="llamarl.app.roles.reward .*--app-id {app_id} --replica 0"),
    Case("only_generator_sigkill_sync", "generator/0", ["--num_generators", "1", "--max_staleness", "0"],
         kill="llamarl.app.roles.generator .*--app-id {app_id} --replica 0"),
    Case("torchrun_agent_sigkill", "torchrun", ["--num_generators", "1"],
         kill="llamarl.app.roles.torchrun .*--app-id {app_id} "),
]


def trainer_log(log_dir: Path, app_id: str) -> str:
    paths = list(log_dir.glob(f"*/{app_id}/trainer/0/combined.log"))
    return paths[0].read_text(errors="replace") if paths else ""


def app_processes(app_id: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", app_id], capture_output=True, text=True).stdout.split()
    return [pid for pid in out if int(pid) != os.getpid()]


def start_app(runner, policy: str, work: Path, options: list[str]) -> tuple[str, str]:
    """Launch ``llamarl.llamarl`` on local_llamarl with ``options``, logs under
    ``work/torchx-logs``, runs under ``work/runs``; its handle and app id."""
    handle = apps.start(runner, ["--policy", policy, "--runs_dir", str(work / "runs"), "--threads", "1", *options],
                        SMALL, log_dir=work / "torchx-logs")
    return handle, parse_app_handle(handle).app_id


def wait_for_step(log_dir: Path, app_id: str, step: int, deadline: float, what: str) -> None:
    """Until the trainer logs ``step``; ``TimeoutError`` at ``deadline`` (monotonic)."""
    while f"step {step}/" not in trainer_log(log_dir, app_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no step {step} in time")
        time.sleep(0.1)


def wait_for_lock(log_dir: Path, app_id: str, member: str, deadline: float, what: str) -> None:
    """Until ``member``'s process holds its lock (``llamarl.app.control.replica_lock``), the first thing
    it does: it is then importing torch, seconds from reaching the store."""
    while not list(log_dir.glob(f"*/{app_id}/{member}/{replica_lock.LOCK_NAME}")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {member} took no lock in time")
        time.sleep(0.01)


def kill_one(pattern: str, what: str) -> None:
    """SIGKILL the one process whose command line matches ``pattern``."""
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    if len(pids) != 1:
        raise RuntimeError(f"{what}: expected one process matching {pattern!r}, got {pids}")
    os.kill(int(pids[0]), signal.SIGKILL)


def wait_for_end(runner, handle: str, deadline: float, what: str):
    """The app's final status, seen within 0.1 s of its end; ``TimeoutError`` at
    ``deadline`` (monotonic)."""
    try:
        return apps.wait(runner, handle, deadline - time.monotonic(), poll_s=0.1)
    except TimeoutError:
        raise TimeoutError(f"{what}: the app did not end in time") from None


def run_case(case: Case, policy: str, work: Path, timeout_s: float) -> tuple[float, float]:
    """Seconds from the fault (the launch, for a start-up error) to the app's exit, as
    TorchX sees it, and to the moment no process of the app is left."""
    log_dir = work / "torchx-logs"
    with get_runner() as runner:
        t0 = time.monotonic()
        handle, app_id = start_app(runner, policy, work, ["--steps", "60", *case.options])
        try:
            if case.kill:
                wait_for_step(log_dir, app_id, 1, t0 + timeout_s, case.name)
                t0 = time.monotonic()
                kill_one(case.kill.format(app_id=app_id), case.name)
            status = wait_for_end(runner, handle, t0 + timeout_s, case.name)
            seconds = time.monotonic() - t0
            while app_processes(app_id):
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{case.name}: processes outlived the app: {app_processes(app_id)}")
                time.sleep(0.1)
            gone = time.monotonic() - t0
        finally:
            runner.cancel(handle)
    if status.state != AppState.FAILED or case.cause not in status.structured_error_msg:
        raise RuntimeError(f"{case.name}: ended {status.state} with error {status.structured_error_msg!r}")
    print(f"{case.name}: app exit {seconds:.1f} s, no process left {gone:.1f} s", file=sys.stderr)
    return seconds, gone


SURVIVE_STEPS, SURVIVE_KILL_AFTER = 60, 15
PROMPTS, GROUP = 4, 4  # SMALL's --prompts-per-step and --group-size


def _log_time(line: str) -> float:
    """``time.time()`` of a log line (``2026-12-05 07:10:33,683 trainer/0 ...``, local time)."""
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_losing_generator_1(policy: str, work: Path, steps: int, wait_to_kill, what: str, timeout_s: float):
    """Two generators, generator 1 SIGKILLed once ``wait_to_kill(log_dir, app_id,
    deadline)`` returns; the run must still finish its ``steps``. The app's status, its
    id, when the kill was (``time.time()``) and the trainer's log."""
    log_dir = work / "torchx-logs"
    with get_runner() as runner:
        t0 = time.monotonic()
        handle, app_id = start_app(runner, policy, work, ["--steps", str(steps), "--num_generators", "2"])
        try:
            wait_to_kill(log_dir, app_id, t0 + timeout_s)
            killed_at = time.time()
            kill_one(f"llamarl.app.roles.generator .*--app-id {app_id} --replica 1", what)
            status = wait_for_end(runner, handle, t0 + timeout_s, what)
        finally:
            runner.cancel(handle)
    log = trainer_log(log_dir, app_id)
    if f"finished {steps} steps" not in log:
        raise RuntimeError(f"{what}: the run did not finish (app {status.state}):\n{log[-3000:]}")
    return status, app_id, killed_at, log


def run_generator_lost(policy: str, work: Path, timeout_s: float) -> dict:
    """Two generators, generator 1 SIGKILLed after step ``SURVIVE_KILL_AFTER``: what the
    run trained and how long the loss held it up."""
    runs_dir = work / "runs"
    status, app_id, killed_at, log = run_losing_generator_1(
        policy, work, SURVIVE_STEPS, lambda log_dir, app_id, deadline: wait_for_step(
            log_dir, app_id, SURVIVE_KILL_AFTER, deadline, "generator_lost"), "generator_lost", timeout_s)
    regroup_line = next(line for line in log.splitlines() if "weight plane epoch 2:" in line)
    db = sqlite3.connect(runs_dir / app_id / "metrics.db")
    steps = db.execute("SELECT step, t FROM scalars WHERE name = 'train/version' ORDER BY t").fetchall()
    trained = db.execute("SELECT COUNT(*) FROM staleness WHERE used = 1").fetchone()[0]
    last = dict(db.execute("SELECT name, value FROM scalars WHERE step = ? AND name IN "
                           "('faults/lost_groups', 'faults/duplicate_groups', 'weights/regroups', "
                           "'members/generator')", (SURVIVE_STEPS,)).fetchall())
    regrouped_at = _log_time(regroup_line)
    before = [t for s, t in steps if t < killed_at]
    after = [t for s, t in steps if t > regrouped_at]
    next_step_at = min(t for _, t in steps if t > killed_at)
    times = [killed_at] + [t for _, t in steps if t > killed_at]
    stall = max(b - a for a, b in zip(times, times[1:]))
    rate = lambda ts: (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else float("nan")  # noqa: E731
    result = {
        "app_state": str(status.state),
        "steps_recorded": len(steps), "each_step_once": [s for s, _ in steps] == list(range(1, SURVIVE_STEPS + 1)),
        "rollouts_trained": trained, "rollouts_expected": SURVIVE_STEPS * PROMPTS * GROUP,
        "lost_groups_regenerated": int(last.get("faults/lost_groups", -1)),
        "duplicate_groups_dropped": int(last.get("faults/duplicate_groups", -1)),
        "weight_regroups": int(last.get("weights/regroups", -1)),
        "generators_at_end": int(last.get("members/generator", -1)),
        "steps_per_s_before": round(rate(before), 2), "steps_per_s_after": round(rate(after), 2),
        "kill_to_regroup_s": round(regrouped_at - killed_at, 1),
        "kill_to_next_step_s": round(next_step_at - killed_at, 1),
        "longest_step_gap_after_kill_s": round(stall, 1),
    }
    print(f"generator_lost: {result}", file=sys.stderr)
    return result


STARTING_STEPS = 20


def run_generator_lost_starting(policy: str, work: Path, timeout_s: float) -> dict:
    """Two generators, generator 1 SIGKILLed as soon as it holds its lock (its first line,
    before ``import torch``: it never reaches the store): the run must go on with
    generator 0 and finish every step; reported: seconds from the kill to the trainer's
    line that takes it out."""
    runs_dir = work / "runs"
    status, app_id, killed_at, log = run_losing_generator_1(
        policy, work, STARTING_STEPS, lambda log_dir, app_id, deadline: wait_for_lock(
            log_dir, app_id, "generator/1", deadline, "generator_lost_starting"), "generator_lost_starting", timeout_s)
    taken_out = next(line for line in log.splitlines() if "generator/1 is gone: ended before it registered" in line)
    first_line = next(line for line in log.splitlines() if " trainer/0 " in line)
    db = sqlite3.connect(runs_dir / app_id / "metrics.db")
    steps = [s for (s,) in db.execute("SELECT step FROM scalars WHERE name = 'train/version' ORDER BY t")]
    result = {
        "app_state": str(status.state),
        "each_step_once": steps == list(range(1, STARTING_STEPS + 1)),
        "rollouts_trained": db.execute("SELECT COUNT(*) FROM staleness WHERE used = 1").fetchone()[0],
        "rollouts_expected": STARTING_STEPS * PROMPTS * GROUP,
        "kill_to_taken_out_s": round(_log_time(taken_out) - killed_at, 1),
        "trainer_first_log_to_taken_out_s": round(_log_time(taken_out) - _log_time(first_line), 1),
    }
    print(f"generator_lost_starting: {result}", file=sys.stderr)
    return result


def tiny_policy(out: Path) -> str:
    """A warm-started policy of a few steps: these runs time failures, not learning."""
    from llamarl.app.rl.warmstart import WarmStartConfig, warm_start

    warm_start(WarmStartConfig(out=str(out), steps=4, batch_size=8, train_size=64, eval_size=2),
               log=lambda _: None)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="", help="policy directory (default: a tiny warm start)")
    parser.add_argument("--repeats", type=int, default=1, help="launches per case")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names; add generator_lost and generator_lost_starting "
                             "(not in the default) for the survivable cases")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up on a launch after this long")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    wanted = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="llamarl-faults-") as tmp:
        policy = args.policy or tiny_policy(Path(tmp) / "policy")
        details = {c.name: [run_case(c, policy, Path(tmp), args.timeout_s) for _ in range(args.repeats)]
                   for c in CASES if c.name in wanted}
        survived = [run_generator_lost(policy, Path(tmp) / f"lost-{i}", args.timeout_s)
                    for i in range(args.repeats)] if "generator_lost" in wanted else []
        starting = [run_generator_lost_starting(policy, Path(tmp) / f"starting-{i}", args.timeout_s)
                    for i in range(args.repeats)] if "generator_lost_starting" in wanted else []
    result: dict = {}
    if details:
        result.update({
            "what": "seconds from an injected fault (start-up errors: the launch) to the app's exit as "
                    "TorchX sees it (app_exit_s) and to no process of the app left (no_process_s); "
                    "local_cwd, one torch thread per process",
            "machine": f"{os.cpu_count()} CPU cores, shared with other test runs",
            "app_exit_s": {name: round(statistics.median(e for e, _ in v), 1) for name, v in details.items()},
            "no_process_s": {name: round(statistics.median(g for _, g in v), 1) for name, v in details.items()},
            "details": {name: [[round(e, 1), round(g, 1)] for e, g in v] for name, v in details.items()},
        })
    if survived:
        result["generator_lost"] = {
            "what": f"2 generators, {SURVIVE_STEPS} steps x {PROMPTS} prompts x G={GROUP}, generator 1 "
                    f"SIGKILLed after step {SURVIVE_KILL_AFTER}; local_cwd, one torch thread per process",
            "machine": f"{os.cpu_count()} CPU cores, shared with other test runs", "runs": survived}
    if starting:
        result["generator_lost_starting"] = {
            "what": f"2 generators, {STARTING_STEPS} steps x {PROMPTS} prompts x G={GROUP}, generator 1 SIGKILLed "
                    "as soon as it held its alive.lock (before it reached the store); local_cwd, one torch "
                    "thread per process",
            "machine": f"{os.cpu_count()} CPU cores, shared with other test runs", "runs": starting}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    main()
