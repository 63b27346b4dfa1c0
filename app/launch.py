"""The trainer role's entry point: torchrun around ``app.trainer``, and the failure's
cause as the last line.

    python -m app.launch --nproc-per-node 2 --num-generators 2 --steps 30 ...

torchrun ends a failed run with its ``ChildFailedError`` banner, which names the exit code
of a worker, not why it failed. This wrapper gives torchrun its own error file, into
which torchrun copies the failed worker's (written by ``app.health.reported``), or,
for a worker killed by a fatal signal, reads its faulthandler report (which names the
function that crashed); it then prints that cause last and writes it to the scheduler's error file
(``$TORCHELASTIC_ERROR_FILE``), which ``torchx run`` prints when the app fails. A
torchrun that dies without a worker's cause (killed, say) is named as such.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from app import health


def torchrun_command(nproc_per_node: int, trainer_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(nproc_per_node), "-m", "app.trainer", *trainer_args]


def exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def crash_cause(crash_dir: Path) -> str | None:
    """A trainer rank that died of a fatal signal left no error file, but its faulthandler
    report: print the report (its Python stacks) and name the crash from it."""
    causes = []
    for report in sorted(crash_dir.glob("*.txt")):
        text = report.read_text(errors="replace")
        if text.strip():
            print(text, file=sys.stderr, flush=True)
            causes.append(health.describe_crash(report.stem.replace("-", "/", 1), text))
    return "; ".join(causes) or None


def run(nproc_per_node: int, trainer_args: list[str]) -> int:
    """torchrun's exit code; on a failure the cause is printed last and in the error file."""
    with tempfile.TemporaryDirectory(prefix="llamarl-launch-") as tmp:
        error_file, crash_dir = Path(tmp) / "error.json", Path(tmp) / "crashes"
        crash_dir.mkdir()
        env = {**os.environ, health.ERROR_FILE_ENV: str(error_file), health.CRASH_DIR_ENV: str(crash_dir)}
        proc = subprocess.Popen(torchrun_command(nproc_per_node, trainer_args), env=env)

        def forward(signum: int, _frame: object) -> None:
            # The scheduler's SIGTERM: torchrun stops its workers (they run in sessions of
            # their own, out of the reach of a signal to this process group).
            proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        returncode = proc.wait()
        if returncode == 0:
            return 0
        cause = health.read_error_file(str(error_file)) or crash_cause(crash_dir)
    if cause is None:
        cause = f"torchrun (its agent) ended without a worker's cause: {exit_description(returncode)}"
    message = f"trainer failed: {cause}"
    health.write_error_file(message, returncode)
    print(message, file=sys.stderr, flush=True)
    return returncode if returncode > 0 else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="trainer ranks (more than one: FSDP2, app.sharding)")
    args, trainer_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    sys.exit(run(args.nproc_per_node, trainer_args))


if __name__ == "__main__":
    main()
