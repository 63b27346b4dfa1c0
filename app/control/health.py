"""Whether the app is still whole, and how a failure is reported once it is not.

- ``check_health``: the trainer's test that every other role is alive (it raises naming
  the first role that failed, or whose heartbeat stood still for ``HEARTBEAT_TIMEOUT_S``).
  The trainer calls it between steps and, through the rollout stream's ``health`` hook,
  while it waits for rollouts: a dead producer is noticed while the trainer is blocked.
- ``write_error_file``: the cause in TorchElastic's error-file format at
  ``$TORCHELASTIC_ERROR_FILE``, which TorchX schedulers read back as the app's
  structured error (``torchx run`` prints it last when the app fails).
- ``enable_crash_reports`` and ``watch_parent``: an interpreter crash leaves a Python
  traceback; a trainer rank whose torchrun agent is gone does not outlive it.
- ``sibling_failure``: what the store cannot say. Under TorchX's local scheduler every
  replica of the app has a directory of its own beside the others' (its error file and
  its ``stderr.log``): a role that failed before it reached the store, or crashed, is
  found and named there, and so is one killed before it registered
  (``vanished_before_registering``: the lock it held from its first line, ``llamarl.app.control.replica_lock``,
  is free; ``llamarl.app.control.membership`` takes it out, or fails the run if it was the last of its
  role). Other schedulers end the whole job when one role fails, and keep no such shared
  directory; there this finds nothing.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from llamarl.app.errors import ConfigError
from llamarl.app.control.replica_lock import ERROR_FILE_ENV, REPLICA_ERROR_FILE_ENV, sibling_replica_dirs  # noqa: F401 (read as health.*)
from llamarl.app.control.replica_lock import released as lock_released

if TYPE_CHECKING:  # a type only: the trainer's launcher reads this module without torch
    from llamarl.app.control.transport import Control

log = logging.getLogger("llamarl")

FAILED_RANK_LINE = "torchrun: rank {rank} failed first, exit code {exitcode}"
"""What ``llamarl.app.roles.torchrun`` prints to stderr when a rank failed;
``llamarl.app.roles.launch`` reads the rank back from it."""

HEARTBEAT_TIMEOUT_S = 10.0
"""A member whose heartbeat (one per ``runtime.HEARTBEAT_S``) has not moved for this long
is gone: long enough for a loaded 2-core machine, short enough to end the app in seconds."""
CRASH_LOG_TAIL_BYTES = 64 * 1024
"""How much of a sibling's ``stderr.log`` is read for a faulthandler report."""
ORPHAN_GRACE_S = 30.0
"""A rank whose parent died exits at the latest this long after it noticed."""


class AppFailed(RuntimeError):
    """Another member of the app failed or is gone; the message names it and its cause."""


def check_health(control: Control, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """``AppFailed`` naming the first member that reported a failure, or every member
    whose heartbeat has not moved for ``timeout_s``; nothing when all are alive.
    Executors the controller took out of the run (``llamarl.app.control.membership``: a lost generator
    or reward executor while others of its role survive) are not counted as silent."""
    failures = control.failures()
    if failures:
        who, err = next(iter(failures.items()))
        raise AppFailed(f"{who} failed: {err}")
    if (failed := sibling_failure()) is not None:  # failed before it reached the store
        raise AppFailed(failed)
    gone = control.gone()
    stale = sorted(m for m, age in control.last_heartbeats().items() if age > timeout_s and m not in gone)
    if stale:
        crashes = [c for m in stale if (c := sibling_crash(m)) is not None]
        raise AppFailed("; ".join(crashes) if crashes else
                        f"no heartbeat for {timeout_s:g} s from {', '.join(stale)}: the process is gone "
                        "(killed, out of memory, or its node was lost)")


PEER_ERROR_HINTS = ("connection", "peer", "broken pipe", "timed out", "timeout", "weight group", "weight sync")
"""Words of an error that a vanished peer causes (gloo's "Connection reset by peer"...)."""


def blame_peer(control: Control, error: BaseException,
               wait_s: float = HEARTBEAT_TIMEOUT_S + 1.0) -> AppFailed | None:
    """For an error that a dead peer may have caused (a collective or a socket failing),
    the peer to blame: ``check_health`` is asked until ``wait_s`` passes, long enough for
    a killed process's heartbeat to go stale. ``None``: no member is gone, ``error`` is
    its own cause."""
    if not any(hint in str(error).lower() for hint in PEER_ERROR_HINTS):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            check_health(control)
        except AppFailed as e:
            return e
        except Exception:  # the store itself is gone: nothing to learn from it
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def write_error_file(message: str, exitcode: int = 1) -> None:
    """The failure's cause where the scheduler reads it (``$TORCHELASTIC_ERROR_FILE``,
    when set): the same JSON that ``torch.distributed.elastic``'s ``@record`` writes."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    # Outside an exception handler format_exc() is "NoneType: None", which `torchx run`
    # prints under the cause of every failed app, as if it were an error of its own.
    callstack = traceback.format_exc() if sys.exc_info()[1] is not None else ""
    data = {"message": {"message": message, "errorCode": exitcode,
                        "extraInfo": {"py_callstack": callstack,
                                      "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as e:
        log.warning("could not write the error file %s: %s", path, e)


@contextmanager
def reported(*, stops: bool = False) -> Iterator[None]:
    """Around a role's ``main``: the cause of its own failure (an exception) goes to the
    scheduler's error file. A role that stops because another failed (``SystemExit``
    naming it) writes none, unless ``stops``: TorchX shows the earliest error file of the
    app, which must be the failed role's, not a bystander's that happened to exit first.
    The trainer's ranks pass ``stops=True``: their error file is torchrun's, which
    ``llamarl.app.roles.launch`` prints as the app's cause once torchrun has ended. A refusal
    (``errors.ConfigError``: a bad flag, dataset, policy directory, device) ends the role
    with its one line and exit code 1, without a traceback."""
    try:
        yield
    except SystemExit as e:
        if stops and isinstance(e.code, str):
            write_error_file(e.code)
        raise
    except ConfigError as e:
        # A refused flag or input: the message is the whole story. Its traceback would
        # bury it under some 20 lines in the terminal (`torchx run` shows every role's
        # stderr), so the role ends on that one line (SystemExit prints it, exit code 1).
        write_error_file(f"{type(e).__name__}: {e}")
        raise SystemExit(f"{type(e).__name__}: {e}") from None
    except Exception as e:
        write_error_file(f"{type(e).__name__}: {e}")
        raise


def read_error_file(path: str) -> str | None:
    """The message of a TorchElastic error file, or ``None`` if there is none."""
    try:
        with open(path) as f:
            return str(json.load(f)["message"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


CRASH_DIR_ENV = "LLAMARL_CRASH_DIR"
"""Set by ``llamarl.app.roles.launch``: the trainer ranks write their crash reports there, for the
launcher to name the crash in the app's cause."""
_crash_files: list = []  # open for the process's life: faulthandler writes on a fatal signal


def enable_crash_reports(member: str) -> None:
    """On SIGSEGV, SIGABRT, SIGFPE, SIGBUS or SIGILL, write every thread's Python stack
    before the process dies: to ``$LLAMARL_CRASH_DIR/<role>-<replica>.txt`` when set,
    else to stderr (the role's log then names the function that crashed)."""
    crash_dir = os.environ.get(CRASH_DIR_ENV)
    if not crash_dir:
        faulthandler.enable(all_threads=True)
        return
    f = open(os.path.join(crash_dir, member.replace("/", "-") + ".txt"), "w")
    _crash_files.append(f)
    faulthandler.enable(file=f, all_threads=True)


def describe_crash(member: str, report: str) -> str:
    """One line from a faulthandler report: what killed ``member``, and the innermost
    Python function of the thread that crashed (user code, often: a reward, a model)."""
    fatal = next((line.removeprefix("Fatal Python error: ").strip() for line in report.splitlines()
                  if line.startswith("Fatal Python error:")), "a fatal signal")
    where = ""
    current = report.split("Current thread", 1)
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', current[1] if len(current) > 1 else report)
    if frames:
        path, line, function = frames[0]
        where = f" in {function} ({path}:{line})"
    return f"{member} crashed ({fatal}){where}"


def watch_parent(on_orphaned: Callable[[int], None]) -> threading.Thread:
    """A daemon thread that notices when this process's parent dies (it is re-parented),
    calls ``on_orphaned(old_parent_pid)`` to fail the run cleanly, and ends the process
    ``ORPHAN_GRACE_S`` later if it is still there (stuck in a collective, say)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("parent process %d (the torchrun agent) is gone: stopping", parent)
        try:
            on_orphaned(parent)
        except Exception as e:  # the store may be gone with it
            log.error("could not report it: %s", e)
        time.sleep(ORPHAN_GRACE_S)
        log.error("still running %g s after the parent died: exiting", ORPHAN_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name="parent-watch")
    thread.start()
    return thread


def sibling_failure(role: str | None = None) -> str | None:
    """The cause another replica of this app (of ``role``, when given) wrote to its error
    file (it failed), or ``None``. Roles that merely stopped write none (``reported``)."""
    for member, d in sibling_replica_dirs().items():
        if role is not None and member.split("/")[0] != role:
            continue
        message = read_error_file(str(d / "error.json"))
        if message is not None:  # llamarl.app.roles.launch's already says "trainer failed: ..."
            return f"{member} failed: {message.removeprefix(member.split('/')[0] + ' failed: ')}"
    return None


def vanished_before_registering(registered: set[str]) -> list[str]:
    """Replicas of this app (local layout) not in ``registered`` whose process took its
    ``llamarl.app.control.replica_lock`` and has ended: killed before they reached the store, they
    wrote no error file and never had a heartbeat to go still."""
    return [m for m, d in sibling_replica_dirs().items() if m not in registered and lock_released(d)]


def sibling_crash(member: str) -> str | None:
    """``describe_crash`` of ``member``'s faulthandler report in its ``stderr.log``, or ``None``."""
    tail = _stderr_tail(member)
    report = tail[tail.rfind("Fatal Python error:"):] if "Fatal Python error:" in tail else None
    return describe_crash(member, report) if report else None


def describe_vanished(member: str) -> str:
    """Why ``member`` ended before it registered: its crash, else the last line of its
    ``stderr.log`` beside the likely causes (a process that exits before its first log
    line, an argument error say, writes no error file either)."""
    if (crash := sibling_crash(member)) is not None:
        return crash
    last = next((line.strip() for line in reversed(_stderr_tail(member).splitlines()) if line.strip()), "")
    return (f"{member} ended before it registered with the trainer (killed, out of memory, or its node was "
            f"lost{f'; the last line of its stderr: {last[:300]!r}' if last else ''})")


def _stderr_tail(member: str) -> str:
    """The last ``CRASH_LOG_TAIL_BYTES`` of a sibling's ``stderr.log`` ("" if none)."""
    d = sibling_replica_dirs().get(member)
    if d is None:
        return ""
    try:
        with open(d / "stderr.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - CRASH_LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
