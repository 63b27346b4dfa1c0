"""The built-in Python tool: the model's code runs in a separate, limited process.

Each run is a fresh ``python -I`` (isolated: no user site, no environment variables read)
in a scratch directory of its own, deleted afterwards, with:

- resource limits set before the code runs (``resource.setrlimit``, inherited by anything
  it forks): CPU seconds (``RLIMIT_CPU``: SIGXCPU, then SIGKILL), address space
  (``RLIMIT_AS``: a ``MemoryError`` in Python), size of any file it writes
  (``RLIMIT_FSIZE``) and no core files;
- its own process group (``start_new_session``), killed as a whole (SIGKILL) at the
  wall-clock deadline, and when its output passes ``output_bytes`` (read as it comes, so
  printing 100 MB costs the cap, not 100 MB of memory here);
- when unprivileged user namespaces work (``unshare --user --map-root-user --net --pid``,
  probed once): no network (a network namespace with only a down loopback) and a PID
  namespace whose first process dies with the run, taking every process in it along, even
  one that left the process group with ``setsid``.

Why these and not a sandbox package: they are the standard library and util-linux, which
every Linux host has, and they cover what the issue names (time, memory, output, children,
network). Where namespaces are not available (some containers forbid them), the network is
NOT isolated and a child that calls ``setsid`` can outlive the deadline: ``namespaces()``
says which, and the generator logs it once. It is not a security boundary against a
hostile kernel exploit (no seccomp filter); it contains the code a policy writes.

Each run's outcome is counted by reason in ``PythonSandbox.counts``: ``ok``, ``error`` (the
code raised or exited non-zero), ``timeout``, ``cpu_limit``, ``memory_limit``,
``output_limit``, ``killed`` (another signal).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from llamarl.app.errors import check_at_least

UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")


@functools.cache
def namespaces() -> bool:
    """Whether runs get their own network and PID namespaces here (probed once)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(kw_only=True, frozen=True)
class SandboxLimits:
    """The limits of one run."""

    cpu_s: int = 5
    """CPU seconds per process."""
    memory_mb: int = 512
    """Address space per process, MiB."""
    wall_s: float = 10.0
    """Wall-clock deadline of the run; the process group is killed at it."""
    output_bytes: int = 16_384
    """Bytes of stdout and stderr together kept; past them the run is killed."""
    file_mb: int = 16
    """Largest file the code may write, MiB."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "cpu_s", "memory_mb", "output_bytes", "file_mb")
        check_at_least(self, 0, "wall_s", strict=True)


@dataclass(frozen=True)
class RunResult:
    output: str
    """stdout then stderr, cut at the output limit."""
    reason: str
    """``ok``, ``error``, ``timeout``, ``cpu_limit``, ``memory_limit``, ``output_limit`` or ``killed``."""
    returncode: int | None


CPU_EXIT = 86
"""The exit status of a run that used up its CPU seconds (SIGXCPU; the hard limit, a
second later, is SIGKILL). An exit status, not the signal itself: under ``unshare`` the
signal does not reach this process intact."""

# Runs first in the sandbox's interpreter: the limits, then the model's code as __main__.
# Set in the process itself rather than by a preexec_fn, which is unsafe with threads (the
# generator has several); soft = hard, so the code cannot raise them again.
PRELUDE = """import os, resource, runpy, signal, sys
cpu, mem, fsize = map(int, sys.argv[1:4])
signal.signal(signal.SIGXCPU, lambda *_: os._exit(%d))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
for kind, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(kind, (value, value))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
""" % CPU_EXIT


class _Reader(threading.Thread):
    """Reads a pipe into a capped buffer; ``over`` is set once the cap is passed."""

    def __init__(self, pipe, budget: list[int], over: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pipe, self.budget, self.over, self.chunks = pipe, budget, over, []

    def run(self) -> None:
        while chunk := self.pipe.read1(65536):
            keep = chunk[: max(0, self.budget[0])]
            self.budget[0] -= len(chunk)
            if keep:
                self.chunks.append(keep)
            if self.budget[0] < 0:
                self.over.set()

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


@dataclass
class PythonSandbox:
    """Runs Python code under ``limits``; ``counts`` its outcomes by reason."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    counts: Counter[str] = field(default_factory=Counter)

    def run(self, code: str) -> RunResult:
        scratch = tempfile.mkdtemp(prefix="llamarl-sandbox-")
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            lim = self.limits
            cmd = [sys.executable, "-I", "-c", PRELUDE, str(lim.cpu_s), str(lim.memory_mb << 20), str(lim.file_mb << 20)]
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
            proc = subprocess.Popen([*UNSHARE, *cmd] if namespaces() else cmd, cwd=scratch, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            budget, over = [self.limits.output_bytes], threading.Event()
            readers = [_Reader(proc.stdout, budget, over), _Reader(proc.stderr, budget, over)]
            for r in readers:
                r.start()
            reason = self._wait(proc, over)
            for r in readers:
                r.join(timeout=5)
            output = readers[0].text() + readers[1].text()
            if reason is None:
                reason = self._exit_reason(proc.returncode, output)
            self.counts[reason] += 1
            return RunResult(output=output, reason=reason, returncode=proc.returncode)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _wait(self, proc: subprocess.Popen, over: threading.Event) -> str | None:
        """Waits for the run's end, its deadline or its output cap; kills the group at
        the latter two and names them."""
        deadline = time.monotonic() + self.limits.wall_s
        while proc.poll() is None:
            if over.is_set() or time.monotonic() >= deadline:
                reason = "output_limit" if over.is_set() else "timeout"
                _kill_group(proc)
                return reason
            over.wait(0.02)
        # The leader ended: whatever it left behind in its group goes too.
        _kill_group(proc)
        return "output_limit" if over.is_set() else None

    @staticmethod
    def _exit_reason(returncode: int, output: str) -> str:
        if returncode == 0:
            return "ok"
        if returncode == CPU_EXIT:
            return "cpu_limit"
        if "MemoryError" in output:
            return "memory_limit"
        return "killed" if returncode < 0 else "error"

    def tool(self):
        """The ``python`` tool: runs ``code`` here and returns its output; a run that
        failed a limit raises (the model is told, the call counted as a failed one)."""
        sandbox = self

        def python(code: str) -> str:
            """Run a Python program in a sandbox and return what it prints.

            Args:
                code: the program; print the results you need
            """
            result = sandbox.run(code)
            if result.reason in ("ok", "error"):
                return result.output
            raise RuntimeError(f"the program was stopped ({result.reason}); output so far: {result.output[:500]}")

        return python


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes exit
        pass


__all__ = ["PythonSandbox", "RunResult", "SandboxLimits", "namespaces"]
