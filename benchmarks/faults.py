"""How fast a fault ends the whole app: seconds from each injected fault to the app's exit.

    python benchmarks/faults.py --json benchmarks/results/faults.json

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
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState, is_terminal, parse_app_handle

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
         kill="app.reward .*--app-id {app_id} --replica 0"),
    Case("only_generator_sigkill_sync", "generator/0", ["--num_generators", "1", "--max_staleness", "0"],
         kill="app.generator .*--app-id {app_id} --replica 0"),
    Case("torchrun_agent_sigkill", "torchrun", ["--num_generators", "1"],
         kill="torch.distributed.run .*--app-id {app_id} "),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_log(log_dir: Path, app_id: str) -> str:
    paths = list(log_dir.glob(f"*/{app_id}/trainer/0/combined.log"))
    return paths[0].read_text(errors="replace") if paths else ""


def app_processes(app_id: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", app_id], capture_output=True, text=True).stdout.split()
    return [pid for pid in out if int(pid) != os.getpid()]


def run_case(case: Case, policy: str, work: Path, timeout_s: float) -> tuple[float, float]:
    """Seconds from the fault (the launch, for a start-up error) to the app's exit, as
    TorchX sees it, and to the moment no process of the app is left."""
    log_dir, runs_dir = work / "torchx-logs", work / "runs"
    args = ["--policy", policy, "--runs_dir", str(runs_dir), "--store_port", str(free_port()),
            "--steps", "60", "--threads", "1", *case.options,
            # Roles started by name find this interpreter's environment first.
            "--env", f"PATH={os.path.dirname(sys.executable)}", "--", *SMALL]
    with get_runner() as runner:
        t0 = time.monotonic()
        handle = runner.run_component("llamarl.llamarl", args, scheduler="local_cwd",
                                      cfg={"log_dir": str(log_dir)})
        app_id = parse_app_handle(handle).app_id
        try:
            if case.kill:
                while "step 1/" not in trainer_log(log_dir, app_id):
                    if time.monotonic() - t0 > timeout_s:
                        raise TimeoutError(f"{case.name}: no first step within {timeout_s:g} s")
                    time.sleep(0.2)
                pattern = case.kill.format(app_id=app_id)
                pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
                if len(pids) != 1:
                    raise RuntimeError(f"{case.name}: expected one process matching {pattern!r}, got {pids}")
                t0 = time.monotonic()
                os.kill(int(pids[0]), signal.SIGKILL)
            while not is_terminal((status := runner.status(handle)).state):
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{case.name}: the app did not end within {timeout_s:g} s")
                time.sleep(0.1)
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


def tiny_policy(out: Path) -> str:
    """A warm-started policy of a few steps: these runs time failures, not learning."""
    from app.warmstart import WarmStartConfig, warm_start

    warm_start(WarmStartConfig(out=str(out), steps=4, batch_size=8, train_size=64, eval_size=2),
               log=lambda _: None)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="", help="policy directory (default: a tiny warm start)")
    parser.add_argument("--repeats", type=int, default=1, help="launches per case")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up on a launch after this long")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    wanted = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="llamarl-faults-") as tmp:
        policy = args.policy or tiny_policy(Path(tmp) / "policy")
        details = {c.name: [run_case(c, policy, Path(tmp), args.timeout_s) for _ in range(args.repeats)]
                   for c in CASES if c.name in wanted}
    result = {
        "what": "seconds from an injected fault (start-up errors: the launch) to the app's exit as "
                "TorchX sees it (app_exit_s) and to no process of the app left (no_process_s); "
                "local_cwd, one torch thread per process",
        "machine": f"{os.cpu_count()} CPU cores, shared with other test runs",
        "app_exit_s": {name: round(statistics.median(e for e, _ in v), 1) for name, v in details.items()},
        "no_process_s": {name: round(statistics.median(g for _, g in v), 1) for name, v in details.items()},
        "details": {name: [[round(e, 1), round(g, 1)] for e, g in v] for name, v in details.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
