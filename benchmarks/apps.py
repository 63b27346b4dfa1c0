"""Launching the llamarl app on this machine through TorchX's runner, for the benchmarks
and the integration tests (tests/app_launch.py builds on it): a free store port, the
component's ``--env`` option, and a wait with a deadline that cancels the app when it
passes, so that no launch can hang or leave processes behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping, Sequence

from torchx.runner import Runner
from torchx.specs import AppStatus

from llamarl.app.names import free_port

COMPONENT, SCHEDULER = "llamarl.llamarl", "local_llamarl"


def component_env(env: Mapping[str, str] | None) -> list[str]:
    """The component's ``--env`` option for ``env`` (values without ``,`` or ``=``). PATH is
    not needed: llamarl's local scheduler puts this interpreter's directory first on every
    role's PATH, so the launches run as a user's ``.venv/bin/torchx run`` does."""
    return ["--env", ",".join(f"{k}={v}" for k, v in env.items())] if env else []


def start(runner: Runner, options: Sequence[str], trainer_flags: Sequence[str] = (), *,
          log_dir: str | Path, env: Mapping[str, str] | None = None,
          cfg: Mapping[str, object] | None = None) -> str:
    """Launches ``llamarl.llamarl`` with the component ``options`` (a free store port unless
    they name one), ``env`` for every role and ``trainer_flags`` after ``--``; TorchX's logs
    under ``log_dir``. Its app handle."""
    port = [] if "--store_port" in options else ["--store_port", str(free_port())]
    args = [*options, *port, *component_env(env), "--", *trainer_flags]
    return runner.run_component(COMPONENT, args, scheduler=SCHEDULER,
                                cfg={"log_dir": str(log_dir), **(cfg or {})})


def wait(runner: Runner, handle: str, timeout_s: float, poll_s: float = 1.0) -> AppStatus:
    """The app's final status (``.state``, and ``.structured_error_msg`` of a failure),
    seen within ``poll_s`` of its end; after ``timeout_s`` the app is cancelled and
    ``TimeoutError`` raised."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = runner.status(handle)
        if status is not None and status.is_terminal():
            return status
        time.sleep(poll_s)
    runner.cancel(handle)
    raise TimeoutError(f"{handle} did not end within {timeout_s:g} s")
