"""Reward components in worker processes: a hung call is killed, a crash is contained.

Every component that does not run inline gets its own child process running ``serve``
(``python -c CHILD_MAIN``), started by ``subprocess`` and not by ``fork``: the trainer has
threads, gloo and maybe CUDA, which a forked child would inherit half-way.

The protocol, over the child's stdin and stdout:

1. parent -> child, once: the component, pickled, after its size as 8 big-endian bytes.
   A pipe from a parent to the child it started: trusted, nothing from the network.
2. child -> parent: the JSON line ``{"ready": pid}`` once the component is unpickled and
   its ``load()`` (if any) has returned, or ``{"error": "Type: message"}`` and exit 1.
3. parent -> child: one JSON line per request, ``[[prompt, completion, meta], ...]``.
4. child -> parent: JSON lines, each a list of ``[score, reason]`` pairs in sample order
   (``check_score`` runs in the child: a finite float and null, or null and a reason).
   A function component answers one line per sample, flushed at once, so the parent holds
   every sample to its own deadline; a batched component answers the batch in one line.

The parent never unpickles anything from the child. Each child leads a process group of
its own, and whatever its component starts (a server, a sandbox) is in it: closing or
killing a worker SIGKILLs the whole group, so nothing a reward started outlives it. On a
missed deadline the parent kills the child; on EOF (the child died) it reaps it; either way the next call gets a
fresh worker. The child exits on EOF on its stdin and, on Linux, when the parent dies
(``PR_SET_PDEATHSIG``). Its fds 0 and 1 are pointed at /dev/null and stderr, so a
component that prints or reads stdin cannot corrupt the protocol; stderr is the
parent's, so users see their prints and tracebacks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO, Callable

from llamarl.app.rewards.core import CRASHED, TIMEOUT, Sample, Score, call_batched, call_function

log = logging.getLogger(__name__)

MAX_START_FAILURES = 3
"""A worker that dies before it is ready this many times in a row is a configuration error."""
CLOSE_GRACE_S = 2.0
"""How long an idle worker gets to exit on EOF before it is killed."""
REAP_TIMEOUT_S = 10.0
"""How long to wait for a killed worker to be reaped (a process in the D state can take a while)."""
_PARENT_ENV = "LLAMARL_REWARD_WORKER_PARENT"
CHILD_MAIN = "import sys; from llamarl.app.rewards.worker import serve; sys.exit(serve())"
"""The child's program. Not ``-m llamarl.app.rewards.worker``: the package imports this module
before ``-m`` would run it, and runpy warns about that on every start."""


class RewardWorkerError(RuntimeError):
    """A component's worker process cannot start: a configuration error, not a bad sample."""


# ---- the child ----------------------------------------------------------------------------

def _send(out: BinaryIO, message: Any) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies, even in the middle of a hung call. The
    kernel delivers it when the parent *thread* that started the child ends, which is why
    the parent starts workers from one long-lived thread (``_Spawner``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
            print(f"reward worker: prctl(PR_SET_PDEATHSIG) failed, errno {ctypes.get_errno()}",
                  file=sys.stderr)
    if str(os.getppid()) != os.environ.get(_PARENT_ENV):
        os._exit(0)  # the parent died before prctl: nobody is left to serve


def serve() -> int:
    """The child's main loop (see the module docstring); returns its exit status."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Ctrl-C in a terminal reaches the whole process group; the parent decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()

    size = int.from_bytes(requests.read(8), "big")
    payload = requests.read(size)
    if len(payload) != size or size == 0:
        return 0  # the parent went away before sending the component
    try:
        # Not from the network: the parent (this process's own creator, same user, same
        # code) wrote it to this child's stdin pipe. The parent never unpickles anything.
        component = pickle.loads(payload)
        if callable(getattr(component, "load", None)):
            component.load()
    except BaseException as exc:
        traceback.print_exc()
        _send(replies, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(replies, {"ready": os.getpid()})
    batched = callable(getattr(component, "score_batch", None))
    for line in requests:
        samples = [Sample(prompt, completion, meta) for prompt, completion, meta in json.loads(line)]
        if batched:
            _send(replies, call_batched(component, samples))
        else:
            for s in samples:
                _send(replies, [call_function(component, s)])
    return 0


# ---- the parent -----------------------------------------------------------------------------

class _Spawner:
    """Starts every worker from one long-lived thread. ``PR_SET_PDEATHSIG`` fires when the
    thread that started a child ends, so a worker replaced from a short-lived thread (a
    pipeline's map thread, say) would be killed as soon as that thread returned."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward-worker-spawner", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.put((True, job()))
            except BaseException as exc:
                done.put((False, exc))

    def run(self, job: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((job, done))
        try:
            ok, value = done.get(timeout=timeout_s)
        except queue.Empty:
            raise RewardWorkerError(f"starting a reward worker process took over {timeout_s:g} s") from None
        if not ok:
            raise value
        return value


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner.pid != os.getpid():  # none yet, or we are a fork
            _spawner = _Spawner()
        spawner = _spawner
    # A process group of its own: what a component starts (a server, a sandbox, a shell) is
    # in it, and ends with the worker when the group is killed (``WorkerProcess.kill``).
    return spawner.run(lambda: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                                process_group=0))


def _child_env() -> dict[str, str]:
    """The parent's environment, and its ``sys.path`` as PYTHONPATH: the child imports the
    component's module the way the parent did (pytest's rootdir, ``syspath_prepend``...).
    A parent that uses torch passes on its thread count (``--threads``): a reward model
    in the child should not take every core of a machine the roles share."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), _PARENT_ENV: str(os.getpid())}
    if "torch" in sys.modules:
        env["OMP_NUM_THREADS"] = str(sys.modules["torch"].get_num_threads())
    return env


def _exited_unreaped(pid: int) -> bool:
    """True once child ``pid`` has exited; it stays a zombie (``WNOWAIT``) for the caller to reap."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


class _DiedBeforeReady(Exception):
    pass


class WorkerProcess:
    """The parent's handle on one component's worker. Not thread-safe: its composite
    serialises calls."""

    def __init__(self, name: str, payload: bytes, *, batched: bool, start_timeout_s: float) -> None:
        self.name, self.batched, self.start_timeout_s = name, batched, start_timeout_s
        self.owner = os.getpid()
        self.proc = _spawn([sys.executable, "-c", CHILD_MAIN], _child_env())
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        self._buffer = bytearray()
        self.in_call = False
        """True while a ``score`` has not returned: if that is still so at the next call, the
        last one was interrupted (Ctrl-C in the parent) and the pipe may hold its results."""
        try:
            self._write(len(payload).to_bytes(8, "big") + payload, self.started + start_timeout_s)
        except (OSError, TimeoutError):
            pass  # the child already died or hangs before reading: wait_ready says which

    # -- io with deadlines ----------------------------------------------------------------

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, event)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(math.ceil(remaining * 1000)):
            raise TimeoutError

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._in, view):]
            except BlockingIOError:
                self._wait(self._in, select.POLLOUT, deadline)

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line from the child; None on EOF; TimeoutError past ``deadline``."""
        while (end := self._buffer.find(b"\n")) < 0:
            self._wait(self._out, select.POLLIN, deadline)
            chunk = os.read(self._out, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        return line

    # -- life cycle -------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Return once the child has loaded its component. RewardWorkerError when it reports
        an error or is not ready within ``start_timeout_s``; _DiedBeforeReady when it died."""
        try:
            line = self._read_line(self.started + self.start_timeout_s)
        except TimeoutError:
            self.kill()
            raise RewardWorkerError(
                f"reward component {self.name!r}: its worker process was not ready after "
                f"{self.start_timeout_s:g} s (import and load()); raise start_timeout_s if "
                f"loading is this slow") from None
        message = json.loads(line) if line else {}
        if "error" in message:
            self.kill()
            raise RewardWorkerError(f"reward component {self.name!r} cannot start in its worker process: "
                                    f"{message['error']} (traceback above, on stderr)")
        if "ready" not in message:
            self.kill()
            raise _DiedBeforeReady(self.describe_exit())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def kill(self) -> None:
        """SIGKILL and reap. Only by the process that started it: a fork of the parent
        holds a copy of this handle, and must leave the parent's worker alone."""
        if os.getpid() != self.owner:
            return
        self._kill_group()
        try:
            self.proc.wait(REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("reward worker %d (%s) not reaped %g s after SIGKILL", self.pid, self.name, REAP_TIMEOUT_S)
        self._close_pipes()

    def close(self) -> None:
        """EOF on its stdin (the child exits when idle), then SIGKILL if it is still there."""
        if os.getpid() != self.owner:
            return
        self._close_pipes()
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self.proc.returncode is None and not _exited_unreaped(self.proc.pid):
            if time.monotonic() > deadline:
                self.kill()
                return
            time.sleep(0.02)
        if self.proc.returncode is None:
            # Exited, not yet reaped: its pid, hence its group's id, cannot be reused yet.
            self._kill_group()  # what the component started and left running
        self.proc.wait(REAP_TIMEOUT_S)

    def _kill_group(self) -> None:
        """SIGKILL to the worker's process group (the worker and what its component started).
        The group outlives its leader while members remain, so this works after a reap too."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nobody left in it
            pass

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    # -- scoring ------------------------------------------------------------------------------

    def score(self, samples: list[Sample], timeout_s: float) -> tuple[list[Score], str | None]:
        """Score ``samples``: ``(scores, None)``, or the scores received before the first
        failure and its reason, TIMEOUT or CRASHED; then this worker is gone. A function
        has ``timeout_s`` per sample, a batched component ``timeout_s`` for the batch."""
        try:
            request = json.dumps([[s.prompt, s.completion, s.meta] for s in samples]).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            raise TypeError(f"samples for reward component {self.name!r} must be JSON-able to reach its "
                            f"worker process (prompt, completion and meta): {exc}") from exc
        scores: list[Score] = []
        self.in_call = True
        try:
            deadline = time.monotonic() + timeout_s
            self._write(request, deadline)
            while len(scores) < len(samples):
                line = self._read_line(deadline)
                if line is None:
                    break
                scores += [(score, reason) for score, reason in json.loads(line)]
                if not self.batched:
                    deadline = time.monotonic() + timeout_s
            else:
                self.in_call = False
                return scores, None
        except TimeoutError:
            self.kill()
            log.warning("reward component %r ran past its %g s timeout; killed its worker process %d",
                        self.name, timeout_s, self.pid)
            return scores, TIMEOUT
        except (OSError, ValueError):  # EPIPE: it died before reading the request; a torn line
            pass
        self.kill()
        log.warning("reward component %r: its worker process %d died while scoring (%s); a new one starts",
                    self.name, self.pid, self.describe_exit())
        return scores, CRASHED


def start_workers(components: dict[str, tuple[bytes, bool]], start_timeout_s: float) -> dict[str, WorkerProcess]:
    """One ready worker per ``name -> (pickled component, batched)``. All start at once, so
    their imports and ``load()`` calls overlap. A worker that dies before it is ready is
    started again, ``MAX_START_FAILURES`` times in a row at most; then, or on an error in
    the child (import, unpickling, ``load()``), RewardWorkerError names the component."""
    def start(name: str) -> WorkerProcess:
        payload, batched = components[name]
        return WorkerProcess(name, payload, batched=batched, start_timeout_s=start_timeout_s)

    pending: dict[str, WorkerProcess] = {}
    ready: dict[str, WorkerProcess] = {}
    failures = dict.fromkeys(components, 0)
    try:
        for name in components:
            pending[name] = start(name)
        while pending:
            name, worker = next(iter(pending.items()))
            del pending[name]
            try:
                worker.wait_ready()
            except _DiedBeforeReady as exc:
                failures[name] += 1
                if failures[name] >= MAX_START_FAILURES:
                    raise RewardWorkerError(f"reward component {name!r}: its worker process died before it "
                                            f"was ready {failures[name]} times in a row ({exc}); see its "
                                            f"stderr above") from None
                log.warning("reward component %r: worker process died before it was ready (%s); starting "
                            "another", name, exc)
                pending[name] = start(name)
                continue
            ready[name] = worker
    except BaseException:
        for worker in (*ready.values(), *pending.values()):
            worker.kill()
        raise
    return ready

