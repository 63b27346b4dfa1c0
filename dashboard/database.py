"""One run's metrics database, read-only: opening it (a ``mode=ro`` URI, so the dashboard
never disturbs a run still being written), checking its schema against
``llamarl.app.metrics.events``, the typed errors a person is shown, and the SQL helpers every
query of ``llamarl.dashboard.run.Run`` goes through (a file that breaks while being read
becomes ``CorruptDatabase``, a closed connection stays the bug it is).
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any, Literal, Sequence

import pandas as pd

from llamarl.app.metrics.events import COLUMNS, DB_NAME, OPTIONAL_TABLES, SCHEMA_VERSION, TABLES

CONFIG_NAME = "config.json"


class RunError(Exception):
    """A run directory that cannot be shown; ``str(err)`` is meant for the page.

    ``level`` tells the page how to show it: ``info`` for a state that will fix itself
    (a run that has not written anything yet), ``error`` for one that will not.
    """

    level: Literal["info", "error"] = "error"


class RunNotFound(RunError):
    """The run directory does not exist."""


class NoMetricsYet(RunError):
    """The directory exists but holds no metrics database, or one with no tables yet."""

    level = "info"


class CorruptDatabase(RunError):
    """``metrics.db`` is not a readable SQLite database."""


class SchemaMismatch(RunError):
    """``metrics.db`` was written by an older schema (or is missing tables)."""


# --------------------------------------------------------------------------- opening


def connect(path: Path) -> tuple[sqlite3.Connection, dict[str, str]]:
    """``path``'s metrics database opened read-only, its schema checked, and its meta table.

    Raises ``RunNotFound``, ``NoMetricsYet``, ``CorruptDatabase`` or ``SchemaMismatch``.
    """
    if not path.is_dir():
        raise RunNotFound(f"run directory {str(path)!r} does not exist")
    db_path = path / DB_NAME
    if db_path.exists() and not db_path.is_file():
        raise CorruptDatabase(f"run {path.name!r}: {db_path} is not a file (a directory?)")
    if not db_path.is_file():
        raise NoMetricsYet(f"run {path.name!r} has no {DB_NAME} yet; it may still be starting")
    try:
        db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0,
                             check_same_thread=False)
    except sqlite3.Error as err:
        raise CorruptDatabase(f"cannot open {db_path}: {err}") from err
    try:
        meta = check_schema(db, path.name)
    except BaseException:
        db.close()
        raise
    return db, meta


def check_schema(db: sqlite3.Connection, name: str) -> dict[str, str]:
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        raise CorruptDatabase(f"run {name!r}: {DB_NAME} is not a readable SQLite database ({err})") from err
    if not tables:
        raise NoMetricsYet(f"run {name!r}: {DB_NAME} has no tables yet; the writer may still be starting")
    if "meta" not in tables:
        raise SchemaMismatch(f"run {name!r}: {DB_NAME} has no meta table; it was not written by "
                             f"llamarl's metrics writer (schema {SCHEMA_VERSION})")
    try:
        meta = {k: v for k, v in db.execute("SELECT key, value FROM meta")}
    except sqlite3.DatabaseError as err:
        raise CorruptDatabase(f"run {name!r}: cannot read the meta table ({err})") from err
    raw_version = meta.get("schema_version", "0")
    try:
        version = int(raw_version)
    except ValueError:
        raise SchemaMismatch(f"run {name!r}: schema_version {raw_version!r} is not a number") from None
    if version < SCHEMA_VERSION:
        raise SchemaMismatch(f"run {name!r} was written with metrics schema {version}; this dashboard "
                             f"reads schema {SCHEMA_VERSION}. Re-run it with the current code.")
    missing = [t for t in TABLES.values() if t not in tables and t not in OPTIONAL_TABLES]
    if missing:
        raise SchemaMismatch(f"run {name!r}: {DB_NAME} lacks table(s) {', '.join(missing)} "
                             f"of schema {SCHEMA_VERSION}")
    for kind, table in TABLES.items():
        if table not in tables:  # optional (checked above)
            continue
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        lacking = [c for c in COLUMNS[kind] if c not in have]
        if lacking:
            raise SchemaMismatch(f"run {name!r}: table {table} lacks column(s) {', '.join(lacking)}")
    return meta


# --------------------------------------------------------------------------- reading


class Reader:
    """The SQL of one open run: a DataFrame or one value per query, errors typed."""

    def __init__(self, db: sqlite3.Connection, run_name: str) -> None:
        self._db = db
        self._run_name = run_name

    def close(self) -> None:
        self._db.close()

    def frame(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> pd.DataFrame:
        columns, rows = self._rows(sql, params, all_rows=True)
        return pd.DataFrame(rows, columns=columns)

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """The first column of the first row; ``None`` for no row."""
        _, row = self._rows(sql, params, all_rows=False)
        return None if row is None else row[0]

    def stride(self, table: str, column: str, max_points: int) -> tuple[int | None, int]:
        """The smallest value of an integer ``column`` and the stride that groups its range
        into at most ``max_points`` buckets (1 for an empty table)."""
        lo = self.one(f"SELECT MIN({column}) FROM {table}")
        hi = self.one(f"SELECT MAX({column}) FROM {table}")
        return lo, 1 if lo is None else max(1, math.ceil((hi - lo + 1) / max_points))

    def _rows(self, sql: str, params: Sequence[Any] | dict[str, Any], *, all_rows: bool) -> tuple[list[str], Any]:
        """The column names and every row (``all_rows``) or the first; a file that breaks
        while being read is ``CorruptDatabase``."""
        try:
            cur = self._db.execute(sql, params)
            rows = cur.fetchall() if all_rows else cur.fetchone()
        except sqlite3.ProgrammingError:
            raise  # a bug here (a closed Run), not a broken file
        except sqlite3.DatabaseError as err:
            raise CorruptDatabase(f"run {self._run_name!r}: reading {DB_NAME} failed ({err})") from err
        return [d[0] for d in cur.description], rows


def bucket_width(t_lo: float | None, t_hi: float | None, max_points: int) -> float:
    """The width of time buckets that group ``t_lo`` .. ``t_hi`` into at most ``max_points``."""
    if t_lo is None or t_hi is None or t_hi <= t_lo:
        return 1.0
    # Slightly wider than span / max_points so the newest row falls in the last bucket
    # rather than opening bucket number max_points + 1.
    return (t_hi - t_lo) * (1 + 1e-9) / max(1, max_points)


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads((path / CONFIG_NAME).read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def db_mtime(path: Path) -> float | None:
    times = [p.stat().st_mtime for p in (path / DB_NAME, path / f"{DB_NAME}-wal") if p.exists()]
    return max(times) if times else None


def to_float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def empty(*columns: str) -> pd.DataFrame:
    return pd.DataFrame(columns=list(columns))
