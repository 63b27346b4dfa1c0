"""Read-only access to run directories for the dashboard and notebooks.

A run directory (``runs/<run-id>/``) holds ``config.json``, ``metrics.db`` (schema in
``llamarl.app.metrics.events``) and ``logs/``. This module only reads it: the database is opened
through a ``mode=ro`` URI, so a dashboard can never disturb a run that is still being
written (the writer uses WAL, so readers see committed steps as they land).

Failures are typed: everything that can go wrong with a run directory raises a
``RunError`` subclass whose message can be shown to a person as is::

    from llamarl.dashboard.data import list_runs, open_run
    for info in list_runs("runs"):
        print(info.run_id, info.status, info.message)
    with open_run("runs/my-run") as run:
        df = run.scalar_series(["gen/tokens_per_s", "train/tokens_per_s"])

This module lists runs (``list_runs``, for the page's picker) and opens one
(``open_run``); it is the one import the page and a notebook need. Behind it, one reader
of one schema (``llamarl.app.metrics.events``) in two modules: ``database`` opens the file,
checks its schema and types its errors; ``run`` holds ``Run``'s queries, what the page plots.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llamarl.app.metrics.events import DB_NAME
from llamarl.dashboard.database import (CONFIG_NAME, CorruptDatabase, NoMetricsYet, RunError, RunNotFound,
                                        SchemaMismatch, connect, db_mtime, read_config_json)
from llamarl.dashboard.run import LIVE_WITHIN_S, MAX_POINTS, Headline, Run

__all__ = ["CONFIG_NAME", "LIVE_WITHIN_S", "MAX_POINTS", "CorruptDatabase", "Headline", "NoMetricsYet", "Run",
           "RunError", "RunInfo", "RunNotFound", "SchemaMismatch", "list_runs", "open_run"]


# --------------------------------------------------------------------------- run listing


RunStatus = Literal["ok", "empty", "no metrics", "missing", "corrupt", "old schema", "error"]


@dataclass(kw_only=True)
class RunInfo:
    """One entry of ``list_runs``: enough to label a run in a picker without plotting it."""

    run_id: str
    """Directory name (the run id the app writes into ``meta.run_id``)."""
    path: Path
    """The run directory."""
    status: RunStatus
    """``ok`` when the run has events; otherwise why it cannot be shown (see ``message``)."""
    message: str = ""
    """Human explanation for a status other than ``ok``."""
    started_at: float | None = None
    """Unix time the writer opened the database (``meta.started_at``)."""
    updated_at: float | None = None
    """Unix time of the newest event, else of the database file (for ordering)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's configuration (``meta.config``, else ``config.json``)."""

    live: bool = False
    """Whether the run is still being written (see ``Run.is_live``)."""

    @property
    def label(self) -> str:
        tags = {"ok": [], "empty": ["no events yet"]}.get(self.status, [self.status])
        if self.live:
            tags.append("live")
        return self.run_id + "".join(f" · {t}" for t in tags)


def list_runs(root: str | Path) -> list[RunInfo]:
    """Every subdirectory of ``root`` as a ``RunInfo``, newest first.

    Never raises for a bad run: its status and message say what is wrong with it, so
    the picker can still list it. Raises ``RunNotFound`` if ``root`` itself is missing.
    """
    root = Path(root)
    if not root.is_dir():
        raise RunNotFound(f"runs directory {str(root)!r} does not exist; start a run or pass --runs DIR")
    infos = [_run_info(p) for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    return sorted(infos, key=lambda i: -(i.updated_at or i.started_at or 0.0))


def _run_info(path: Path) -> RunInfo:
    try:
        with open_run(path) as run:
            last = run.last_time()
            empty = last is None
            return RunInfo(run_id=path.name, path=path, status="empty" if empty else "ok",
                           message="no events recorded yet" if empty else "",
                           started_at=run.started_at, updated_at=last or db_mtime(path),
                           config=run.config, live=run.is_live())
    except RunError as err:
        status: RunStatus = {RunNotFound: "missing", NoMetricsYet: "no metrics",
                             CorruptDatabase: "corrupt", SchemaMismatch: "old schema"}.get(type(err), "error")
        return RunInfo(run_id=path.name, path=path, status=status, message=str(err),
                       updated_at=db_mtime(path), config=read_config_json(path))
    except (OSError, ValueError, TypeError, sqlite3.Error) as err:
        # Whatever else is wrong with one run is its own status: it never hides the others.
        return RunInfo(run_id=path.name, path=path, status="error",
                       message=f"run {path.name!r}: cannot read {path / DB_NAME}: {type(err).__name__}: {err}",
                       config=read_config_json(path))


def open_run(path: str | Path) -> Run:
    """Opens ``path``'s metrics database read-only and checks its schema.

    Raises ``RunNotFound``, ``NoMetricsYet``, ``CorruptDatabase`` or ``SchemaMismatch``.
    """
    path = Path(path)
    db, meta = connect(path)
    return Run(path, db, meta)
