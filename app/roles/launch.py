"""The trainer role's entry point: torchrun around ``llamarl.app.roles.trainer``, and the failure's
cause as the last line.

    python -m llamarl.app.roles.launch --nproc-per-node 2 --num-generators 2 --steps 30 ...
    python -m llamarl.app.roles.launch --nnodes 2 --node-rank K --rdzv-host HOST0 --nproc-per-node 2 ...

torchrun ends a failed run with its ``ChildFailedError`` banner, which names the exit code
of a worker, not why it failed; torchrun is run as ``llamarl.app.roles.torchrun`` (its agent as is),
which ends with one line naming that rank and code instead. This wrapper gives torchrun
its own error file, into
which torchrun copies the failed worker's (written by ``llamarl.app.control.health.reported``), or,
for a worker killed by a fatal signal, reads its faulthandler report (which names the
function that crashed), or, for a worker a signal ended with no Python error (SIGKILL:
by hand, the out-of-memory killer), that line, which names the rank and the signal; it then prints that cause last and writes it to the scheduler's error file
(``$TORCHELASTIC_ERROR_FILE``), which ``torchx run`` prints when the app fails. A
torchrun that dies without a worker's cause (killed, say) is named as such; one this
launcher was told to stop (SIGTERM, SIGINT: forwarded to torchrun) names the stop and ends
by that signal.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from llamarl.app import cli
from llamarl.app.control import health
from llamarl.app import names


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where this trainer replica's ranks sit among the trainer's nodes."""

    nnodes: int = 1
    """Trainer replicas (nodes), each running ``nproc_per_node`` ranks."""
    node_rank: int = 0
    """This replica's index: replica 0 holds global rank 0, the controller."""
    rdzv_host: str = "localhost"
    """Trainer replica 0's host: torchrun's rendezvous and the control store live there."""

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--nnodes must be >= 1 and 0 <= --node-rank < --nnodes, got node rank "
                             f"{self.node_rank} of {self.nnodes}")


def torchrun_command(nproc_per_node: int, trainer_args: list[str], nodes: Nodes = Nodes()) -> list[str]:
    """One node: a standalone torchrun. Several: a static rendezvous at trainer replica 0
    (``--node_rank`` is the replica index, so global rank 0, which hosts the control
    store, is on replica 0, where every other role looks for it; a dynamic c10d
    rendezvous orders nodes by host name and pid instead), and every rank is told
    replica 0's host to reach the control store there."""
    head = [sys.executable, "-m", "llamarl.app.roles.torchrun", "--nproc_per_node", str(nproc_per_node)]
    if nodes.nnodes == 1:
        return [*head, "--standalone", "--nnodes", "1", "-m", "llamarl.app.roles.trainer", *trainer_args]
    store = _store_arguments(trainer_args)
    port = names.rendezvous_port(store.store_port, store.app_id)
    return [*head, "--nnodes", str(nodes.nnodes), "--node_rank", str(nodes.node_rank),
            "--rdzv_backend", "static", "--rdzv_endpoint", f"{nodes.rdzv_host}:{port}",
            "-m", "llamarl.app.roles.trainer", *trainer_args, "--store-host", nodes.rdzv_host]


def _store_arguments(trainer_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    cli.add_store_arguments(parser)
    return parser.parse_known_args(trainer_args)[0]


def signal_stop_cause(signum: int) -> str:
    """Why the trainer stopped when this launcher was signalled: the scheduler cancelled
    the app, or (local scheduler) ``torchx run`` got Ctrl-C and terminates every role."""
    return (f"{signal.Signals(signum).name} received (Ctrl-C to `torchx run`, `torchx cancel`, or the "
            "scheduler ended the job); the run directory keeps what was recorded and checkpointed")


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


FAILED_RANK = re.compile(re.escape(health.FAILED_RANK_LINE).replace(r"\{rank\}", r"(\d+)")
                         .replace(r"\{exitcode\}", r"(-?\d+)"))
"""``llamarl.app.roles.torchrun``'s line naming the first failed rank and its exit code."""
STDERR_TAIL_BYTES = 64 * 1024
"""How much of torchrun's stderr is kept to read its last line from."""


def killed_rank_cause(torchrun_stderr: str) -> str | None:
    """A rank that a signal ended without a Python error (SIGKILL: by hand or by the
    out-of-memory killer) leaves neither an error file nor a faulthandler report; only
    ``llamarl.app.roles.torchrun``'s last line names it and the signal. ``None`` when it names no such rank."""
    found = list(FAILED_RANK.finditer(torchrun_stderr))
    if not found:
        return None
    rank, exitcode = int(found[-1][1]), int(found[-1][2])
    if exitcode >= 0:
        return None
    return (f"trainer/{rank} was {exit_description(exitcode)} with no Python error (killed by hand or by the "
            "out-of-memory killer, or its node was lost)")


class StderrTail(threading.Thread):
    """Copies a child's stderr to this process's as it comes, keeping the last
    ``STDERR_TAIL_BYTES`` to read a cause from once the child has ended."""

    def __init__(self, source: IO[bytes]) -> None:
        super().__init__(daemon=True, name="torchrun-stderr")
        self.source, self.tail = source, bytearray()
        self.last_read = time.monotonic()

    def run(self) -> None:
        out = sys.stderr.buffer
        for line in iter(self.source.readline, b""):
            out.write(line)
            out.flush()
            self.tail += line
            del self.tail[: max(0, len(self.tail) - STDERR_TAIL_BYTES)]
            self.last_read = time.monotonic()

    def text(self, quiet_s: float = 0.5, wait_s: float = 5.0) -> str:
        """The tail, once torchrun's last words are read (call it after torchrun ended):
        the pipe closed, or nothing more came for ``quiet_s`` since the call or the last
        line (a rank orphaned in a session of its own may hold the pipe open for
        seconds), or ``wait_s`` passed."""
        called = time.monotonic()
        deadline = called + wait_s
        while (self.is_alive() and time.monotonic() < deadline
               and time.monotonic() - max(self.last_read, called) < quiet_s):
            time.sleep(0.02)
        return bytes(self.tail).decode(errors="replace")


def run(nproc_per_node: int, trainer_args: list[str], nodes: Nodes = Nodes()) -> int:
    """torchrun's exit code; on a failure the cause is printed last and in the error file."""
    return supervise(torchrun_command(nproc_per_node, trainer_args, nodes))


def supervise(command: list[str]) -> int:
    """Run ``command`` (a torchrun) to its end; on a failure print its cause last and
    write it to the error file. Returns torchrun's exit code, or ``-N`` when this launcher
    was told to stop by signal N (``main`` then ends by that signal: a scheduler sees a
    stopped replica, SLURM's sacct ``0:15``, not a failed one). The cause, first found: the failed rank's error file
    (copied into torchrun's), its faulthandler report, ``llamarl.app.roles.torchrun``'s line naming a
    rank a signal killed, else torchrun's own end."""
    with tempfile.TemporaryDirectory(prefix="llamarl-launch-") as tmp:
        error_file, crash_dir = Path(tmp) / "error.json", Path(tmp) / "crashes"
        crash_dir.mkdir()
        env = {**os.environ, health.ERROR_FILE_ENV: str(error_file), health.CRASH_DIR_ENV: str(crash_dir),
               health.REPLICA_ERROR_FILE_ENV: os.environ.get(health.ERROR_FILE_ENV, "")}
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        stderr = StderrTail(proc.stderr)
        stderr.start()

        signalled: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            # The scheduler's SIGTERM (also what the local scheduler sends every role when
            # `torchx run` gets Ctrl-C): torchrun stops its workers (they run in sessions of
            # their own, out of the reach of a signal to this process group).
            signalled.append(signum)
            proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode, stopped_for = _wait_watching_trainer_nodes(proc)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if signalled:
            # Told to stop: not a failure of the trainer, whatever torchrun's own error
            # file says ("SignalException: Process N got signal: 15").
            message = f"trainer stopped: {signal_stop_cause(signalled[0])}"
            health.write_error_file(message, returncode if returncode > 0 else 1)
            print(message, file=sys.stderr, flush=True)
            return -signalled[0]
        if stopped_for is not None:
            # Another trainer node failed: its cause is the app's; this node merely
            # stopped (no error file, which would name it as a cause too).
            print(f"stopping: {stopped_for}", file=sys.stderr, flush=True)
            return 1
        if returncode == 0:
            return 0
        cause = (health.read_error_file(str(error_file)) or crash_cause(crash_dir)
                 or killed_rank_cause(stderr.text()))
    if cause is None:
        cause = f"torchrun (its agent) ended without a worker's cause: {exit_description(returncode)}"
    message = f"trainer failed: {cause}"
    health.write_error_file(message, returncode)
    print(message, file=sys.stderr, flush=True)
    return returncode if returncode > 0 else 1


SIBLING_POLL_S = 0.5
"""How often a trainer node looks for another trainer node's failure."""
STOP_GRACE_S = 10.0
"""How long torchrun gets to stop its ranks after a SIGTERM before it is killed."""


def _wait_watching_trainer_nodes(proc: subprocess.Popen) -> tuple[int, str | None]:
    """Wait for torchrun, watching the other trainer replicas (nodes) of this app
    (``health.sibling_failure``: their error files, in the local layout): when one has
    failed, stop torchrun (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and return its cause
    beside torchrun's exit code. Why: a node whose torchrun waits in the static
    rendezvous for a node that failed before it (a busy rendezvous port, a bad
    interpreter) has no rank yet, so nothing of the app reaches it; torchrun would wait
    out its rendezvous timeout (600 s) and keep the app alive that long. A trainer
    cannot lose a node and go on, so the whole run is watched, not only the rendezvous.
    With one node there is no other trainer replica: the watch finds nothing."""
    while True:
        try:
            return proc.wait(timeout=SIBLING_POLL_S), None
        except subprocess.TimeoutExpired:
            pass
        if (cause := health.sibling_failure("trainer")) is not None:
            break
    proc.terminate()
    try:
        return proc.wait(timeout=STOP_GRACE_S), cause
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), cause


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="trainer ranks on this node (more than one in all: FSDP2, llamarl.app.rl.sharding)")
    parser.add_argument("--nnodes", type=int, default=1, help="trainer replicas (nodes), each of --nproc-per-node ranks")
    parser.add_argument("--node-rank", type=int, default=0, help="this trainer replica's index")
    parser.add_argument("--rdzv-host", default="localhost",
                        help="trainer replica 0's host (the rendezvous and the control store)")
    args, trainer_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    nodes = Nodes(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_host=args.rdzv_host)
    code = run(args.nproc_per_node, trainer_args, nodes)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 1)


if __name__ == "__main__":
    main()
