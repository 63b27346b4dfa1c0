"""Launching the llamarl app through TorchX's runner on the local_llamarl scheduler, for the
integration tests: the benchmarks' launcher (``benchmarks.apps``) with a store port, runs
directory, log directory and secret file of the test's own, a deadline that fails the test
with the roles' logs, and a cancel in a ``finally``, so that no test can hang or leave
processes behind. The tiny policy the launches use is the ``tiny_policy`` fixture
(conftest.py).
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from torchx.runner import Runner, get_runner
from torchx.specs import AppState, is_terminal, parse_app_handle

from benchmarks import apps
from llamarl.app.names import free_port


STEPS = 4
PROMPTS_PER_STEP = 4
GROUP_SIZE = 4
# Small everything: each launch takes well under a minute on 2 cores.
SMALL = ["--eval-every", "2", "--eval-size", "20", "--prompts-per-step", str(PROMPTS_PER_STEP),
         "--group-size", str(GROUP_SIZE), "--gen-batch-prompts", "2", "--max-new-tokens", "16"]
APP_TIMEOUT_S = 300.0


@dataclass
class App:
    runner: Runner
    handle: str
    store_port: int
    runs_dir: Path
    log_dir: Path

    @property
    def app_id(self) -> str:
        return parse_app_handle(self.handle).app_id

    def log(self, role: str, replica: int = 0) -> str:
        (path,) = self.log_dir.glob(f"*/{self.app_id}/{role}/{replica}/combined.log")
        return path.read_text(errors="replace")

    secret_file: Path

    def secret(self) -> bytes:
        """The app's secret, from the private file its first role made: what a test needs
        to sign as a role would."""
        return bytes.fromhex(self.secret_file.read_text())

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.runs_dir / self.app_id / "metrics.db")

    def wait(self, timeout_s: float = APP_TIMEOUT_S) -> AppState:
        """The app's final state; fails the test (after a dump of the logs) on timeout."""
        try:
            return apps.wait(self.runner, self.handle, timeout_s).state
        except TimeoutError:
            pytest.fail(f"the app did not end within {timeout_s:g} s\n{self.logs_tail()}")

    def wait_for_log(self, role: str, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if text in self.log(role):
                    return
            except ValueError:  # the log file is not there yet
                pass
            status = self.runner.status(self.handle)
            if status is not None and is_terminal(status.state):
                break
            time.sleep(0.5)
        pytest.fail(f"{role} never logged {text!r}\n{self.logs_tail()}")

    def logs_tail(self, chars: int = 3000) -> str:
        paths = sorted(self.log_dir.glob(f"*/{self.app_id}/*/*/combined.log"))
        return "\n".join(f"--- {p.parent.parent.name}/{p.parent.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in paths)


@contextmanager
def launch(policy: Path, tmp_path: Path, *, steps: int = STEPS, num_generators: int = 2,
           num_reward: int = 0, max_staleness: int = 1, rewards: str = "math_verifier", nproc: int = 1,
           extra: list[str] = SMALL, options: Sequence[str] = (),
           env: dict[str, str] | None = None, store_port: int | None = None,
           runs_dir: Path | None = None) -> Iterator[App]:
    """``llamarl.llamarl`` on local_cwd; ``options`` are further component options,
    ``env`` further environment variables of every role, ``extra`` the trainer flags;
    a free store port and ``tmp_path/runs`` unless ``store_port`` and ``runs_dir`` say; the
    app's secret in ``tmp_path/secret`` (made by its first role), not in the repository's
    ``.llamarl/secrets``."""
    port = free_port() if store_port is None else store_port
    runs_dir, log_dir = runs_dir or tmp_path / "runs", tmp_path / "torchx-logs"
    secret_file = tmp_path / "secret"
    options = ["--policy", str(policy), "--runs_dir", str(runs_dir), "--store_port", str(port),
               "--secret_file", str(secret_file),
               "--steps", str(steps), "--num_generators", str(num_generators),
               "--num_reward", str(num_reward), "--max_staleness", str(max_staleness),
               "--rewards", rewards, "--nproc_per_node", str(nproc), *options]
    with get_runner() as runner:
        handle = apps.start(runner, options, extra, log_dir=log_dir, env=env)
        try:
            yield App(runner, handle, port, runs_dir, log_dir, secret_file)
        finally:
            runner.cancel(handle)  # a no-op once the app has ended


def rows(db: sqlite3.Connection, sql: str) -> list[tuple]:
    return db.execute(sql).fetchall()
