"""Read-only access to run directories for the dashboard and notebooks.

A run directory (``runs/<run-id>/``) holds ``config.json``, ``metrics.db`` (schema in
``llamarl.app.metrics.events``) and ``logs/``. This module only reads it: the database is opened
through a ``mode=ro`` URI, so a dashboard can never disturb a run that is still being
written (the writer uses WAL, so readers see committed steps as they land).

Every query aggregates in SQL and returns a small ``pandas.DataFrame``: a run of hours
holds millions of rows, and the page must stay responsive while it refreshes every
few seconds. Times in results are seconds since the run started (``t``), so runs line
up when compared side by side.

Failures are typed: everything that can go wrong with a run directory raises a
``RunError`` subclass whose message can be shown to a person as is::

    from llamarl.dashboard.data import list_runs, open_run
    for info in list_runs("runs"):
        print(info.run_id, info.status, info.message)
    with open_run("runs/my-run") as run:
        df = run.scalar_series(["gen/tokens_per_s", "train/tokens_per_s"])

Why one module of ~600 lines: it is the one reader of one schema (``llamarl.app.metrics.events``), and
every query beside the others means a schema change is read and changed in one place;
the run listing, the typed errors and the ``Run`` queries share its connection handling.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import pandas as pd

from llamarl.app import names
from llamarl.app.metrics.events import COLUMNS, DB_NAME, LAST_CHECKPOINT, RESUMED, SCHEMA_VERSION, TABLES

CONFIG_NAME = "config.json"
# A run whose database changed this recently is shown as live and refreshed.
LIVE_WITHIN_S = 60.0
# Default number of points per plotted series; buckets are sized to stay under it.
MAX_POINTS = 600
# How many of each table's newest rows are searched for the newest event time.
TAIL_ROWS = 5000
_UNSET = object()
# weight_sync rows of a sender (a trainer rank: ``trainer/<rank>``; ``trainer`` in runs
# from before the sharded sync) rather than a receiver.
_SENDER = "(receiver = 'trainer' OR receiver LIKE 'trainer/%')"


# --------------------------------------------------------------------------- errors


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
                           started_at=run.started_at, updated_at=last or _db_mtime(path),
                           config=run.config, live=run.is_live())
    except RunError as err:
        status: RunStatus = {RunNotFound: "missing", NoMetricsYet: "no metrics",
                             CorruptDatabase: "corrupt", SchemaMismatch: "old schema"}.get(type(err), "error")
        return RunInfo(run_id=path.name, path=path, status=status, message=str(err),
                       updated_at=_db_mtime(path), config=_read_config_json(path))
    except (OSError, ValueError, TypeError, sqlite3.Error) as err:
        # Whatever else is wrong with one run is its own status: it never hides the others.
        return RunInfo(run_id=path.name, path=path, status="error",
                       message=f"run {path.name!r}: cannot read {path / DB_NAME}: {type(err).__name__}: {err}",
                       config=_read_config_json(path))


def _db_mtime(path: Path) -> float | None:
    times = [p.stat().st_mtime for p in (path / DB_NAME, path / f"{DB_NAME}-wal") if p.exists()]
    return max(times) if times else None


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads((path / CONFIG_NAME).read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- opening


def open_run(path: str | Path) -> "Run":
    """Opens ``path``'s metrics database read-only and checks its schema.

    Raises ``RunNotFound``, ``NoMetricsYet``, ``CorruptDatabase`` or ``SchemaMismatch``.
    """
    path = Path(path)
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
        meta = _check_schema(db, path.name)
    except BaseException:
        db.close()
        raise
    return Run(path, db, meta)


def _check_schema(db: sqlite3.Connection, name: str) -> dict[str, str]:
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
    missing = [t for t in TABLES.values() if t not in tables]
    if missing:
        raise SchemaMismatch(f"run {name!r}: {DB_NAME} lacks table(s) {', '.join(missing)} "
                             f"of schema {SCHEMA_VERSION}")
    for kind, table in TABLES.items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        lacking = [c for c in COLUMNS[kind] if c not in have]
        if lacking:
            raise SchemaMismatch(f"run {name!r}: table {table} lacks column(s) {', '.join(lacking)}")
    return meta


# --------------------------------------------------------------------------- results


@dataclass(kw_only=True)
class Headline:
    """The numbers on top of the page; ``None`` where the run has not recorded one yet."""

    step: int | None = None
    """Highest training step seen in any table."""
    gen_tokens_per_s: float | None = None
    """Generated tokens/s summed over generator replicas (mean over the last window)."""
    train_tokens_per_s: float | None = None
    """Trained tokens/s summed over trainer replicas (mean over the last window)."""
    idle_fraction: float | None = None
    """Idle share of all executors' recorded time in the last window."""
    mean_staleness: float | None = None
    """Mean staleness (versions) of rollouts the trainer used."""
    last_sync_s: float | None = None
    """Slowest receiver's seconds for the newest weight version."""
    last_sync_version: int | None = None
    """The newest weight version any receiver got."""
    last_sync_age_s: float | None = None
    """Seconds between the newest sync and the run's newest event."""
    elapsed_s: float | None = None
    """Seconds from the run's start to its newest event."""
    last_checkpoint_step: int | None = None
    """Step of the newest policy checkpoint the trainer saved."""
    last_checkpoint_path: str | None = None
    """Where that checkpoint is (a Hugging Face directory)."""


class Run:
    """A read-only view of one run's metrics; use as a context manager or call ``close``.

    Query methods raise ``CorruptDatabase`` if the file breaks while being read.
    """

    def __init__(self, path: Path, db: sqlite3.Connection, meta: dict[str, str]) -> None:
        self.path = path
        self.run_id = meta.get("run_id") or path.name
        self.meta = meta
        self._db = db
        self._last_time: Any = _UNSET
        self.config = self._load_config()
        self.started_at = _to_float(meta.get("started_at"))
        # Times are reported from the earliest of started_at and the first event, so a
        # clock skew between hosts never produces negative times.
        first = self._one("SELECT MIN(t) FROM (SELECT MIN(t) AS t FROM scalars UNION ALL "
                          "SELECT MIN(t0) FROM intervals UNION ALL SELECT MIN(t) FROM staleness "
                          "UNION ALL SELECT MIN(t) FROM weight_sync UNION ALL SELECT MIN(t) FROM rewards)")
        candidates = [x for x in (self.started_at, first) if x is not None]
        self.t0: float = min(candidates) if candidates else 0.0

    # ---- lifecycle

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    # ---- plumbing

    def _load_config(self) -> dict[str, Any]:
        try:
            value = json.loads(self.meta.get("config", ""))
            if isinstance(value, dict):
                return value
        except ValueError:
            pass
        return _read_config_json(self.path)

    def _frame(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> pd.DataFrame:
        try:
            cur = self._db.execute(sql, params)
            rows = cur.fetchall()
        except sqlite3.ProgrammingError:
            raise  # a bug here (a closed Run), not a broken file
        except sqlite3.DatabaseError as err:
            raise CorruptDatabase(f"run {self.path.name!r}: reading {DB_NAME} failed ({err})") from err
        return pd.DataFrame(rows, columns=[d[0] for d in cur.description])

    def _stride(self, table: str, column: str, max_points: int) -> tuple[int | None, int]:
        """The smallest value of an integer ``column`` and the stride that groups its range
        into at most ``max_points`` buckets (1 for an empty table)."""
        lo = self._one(f"SELECT MIN({column}) FROM {table}")
        hi = self._one(f"SELECT MAX({column}) FROM {table}")
        return lo, 1 if lo is None else max(1, math.ceil((hi - lo + 1) / max_points))

    def _one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        try:
            row = self._db.execute(sql, params).fetchone()
        except sqlite3.ProgrammingError:
            raise  # a bug here (a closed Run), not a broken file
        except sqlite3.DatabaseError as err:
            raise CorruptDatabase(f"run {self.path.name!r}: reading {DB_NAME} failed ({err})") from err
        return None if row is None else row[0]

    def _bucket(self, t_lo: float | None, t_hi: float | None, max_points: int) -> float:
        if t_lo is None or t_hi is None or t_hi <= t_lo:
            return 1.0
        # Slightly wider than span / max_points so the newest row falls in the last bucket
        # rather than opening bucket number max_points + 1.
        return (t_hi - t_lo) * (1 + 1e-9) / max(1, max_points)

    # ---- basics

    @property
    def max_staleness(self) -> int | None:
        """The bound on off-policy lag from the config (searched one level deep too)."""
        value = self.config.get("max_staleness")
        if value is None:
            for section in self.config.values():
                if isinstance(section, dict) and "max_staleness" in section:
                    value = section["max_staleness"]
                    break
        try:
            return None if value is None else int(value)
        except (TypeError, ValueError):
            return None

    def last_time(self) -> float | None:
        """Unix time of the newest event in any table.

        Looks at the newest ``TAIL_ROWS`` rows of each table (by rowid, an index lookup)
        rather than scanning hours of events: rows are appended roughly in time order, so
        the newest event is among them. Remembered per ``Run``; open a new one (the page
        does every refresh) to see later events.
        """
        if self._last_time is _UNSET:
            parts = " UNION ALL ".join(
                f"SELECT MAX({col}) AS t FROM {table} WHERE rowid > "
                f"(SELECT COALESCE(MAX(rowid), 0) FROM {table}) - {TAIL_ROWS}"
                for table, col in (("scalars", "t"), ("intervals", "t1"), ("staleness", "t"),
                                   ("weight_sync", "t"), ("rewards", "t")))
            value = self._one(f"SELECT MAX(t) FROM ({parts})")
            if value is not None and not isinstance(value, (int, float)):
                raise CorruptDatabase(f"run {self.path.name!r}: {DB_NAME} holds {value!r} where an event "
                                      "time (a number) belongs")
            self._last_time = value
        return self._last_time

    def is_live(self, now: float | None = None) -> bool:
        """Whether the run is still being written: no ``finished_at`` in meta and an event
        (or, before the first event, the database file) newer than ``LIVE_WITHIN_S``.

        Event times come from the executors' clocks; on one host, or hosts kept in sync by
        NTP, they compare with this machine's clock.
        """
        if "finished_at" in self.meta:
            return False
        newest = self.last_time() or _db_mtime(self.path)
        return newest is not None and (now or time.time()) - newest < LIVE_WITHIN_S

    def is_empty(self) -> bool:
        """True while the writer has written ``meta`` but no events."""
        return self.last_time() is None

    def counts(self) -> dict[str, int]:
        """Rows per table (for the page's footer and for tests)."""
        return {table: int(self._one(f"SELECT COUNT(*) FROM {table}")) for table in TABLES.values()}

    def scalar_names(self) -> list[str]:
        return list(self._frame("SELECT DISTINCT name FROM scalars ORDER BY name")["name"])

    # ---- scalars

    def scalar_series(self, names: Sequence[str] = (), *, prefix: str | None = None,
                      max_points: int = MAX_POINTS, since_s: float | None = None,
                      replicas: Literal["each", "sum", "mean"] = "each") -> pd.DataFrame:
        """Downsampled series of the scalars ``names``, or of every scalar whose name starts
        with ``prefix`` (``"queue/"``).

        One row per (name, role, replica, time bucket), buckets sized so each series has at
        most ``max_points`` rows. Columns: ``name, role, replica, t`` (mean time of the
        bucket, seconds since start), ``step`` (last in bucket), ``value`` (mean),
        ``min``, ``max``, ``n``. ``since_s`` keeps only rows at or after that time.
        ``replicas="sum"`` (or ``"mean"``) folds the replicas of a role into one series
        (``replica`` is then -1): the run's total generated tokens/s, say.
        """
        columns = ("name", "role", "replica", "t", "step", "value", "min", "max", "n")
        if prefix:
            # A range rather than LIKE, so the (name, t) index serves it.
            where, params = "name >= ? AND name < ?", [prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)]
        elif names:
            where, params = f"name IN ({', '.join('?' for _ in names)})", list(names)
        else:
            return _empty(*columns)
        if since_s is not None:
            where += " AND t >= ?"
            params.append(self.t0 + since_s)
        t_lo = self._one(f"SELECT MIN(t) FROM scalars WHERE {where}", params)
        t_hi = self._one(f"SELECT MAX(t) FROM scalars WHERE {where}", params)
        if t_lo is None:
            return _empty(*columns)
        bucket = self._bucket(t_lo, t_hi, max_points)
        per_replica = (
            f"SELECT name, role, replica, CAST((t - ?) / ? AS INTEGER) AS b, AVG(t) - ? AS t, "
            f"MAX(step) AS step, AVG(value) AS value, MIN(value) AS min, MAX(value) AS max, "
            f"COUNT(*) AS n FROM scalars WHERE {where} GROUP BY name, role, replica, b")
        params = [t_lo, bucket, self.t0, *params]
        if replicas == "each":
            sql = f"SELECT {', '.join(columns)} FROM ({per_replica}) ORDER BY name, role, replica, t"
        else:
            fold = "SUM" if replicas == "sum" else "AVG"
            sql = (f"SELECT name, role, -1 AS replica, AVG(t) AS t, MAX(step) AS step, "
                   f"{fold}(value) AS value, {fold}(min) AS min, {fold}(max) AS max, SUM(n) AS n "
                   f"FROM ({per_replica}) GROUP BY name, role, b ORDER BY name, role, t")
        return self._frame(sql, params)

    # ---- headline

    def headline(self, *, window_s: float = 30.0) -> Headline:
        """The numbers on top of the page, rates averaged over the last ``window_s``."""
        last = self.last_time()
        if last is None:
            return Headline()
        checkpoint = self.last_checkpoint()
        step = self._one("SELECT MAX(s) FROM (SELECT MAX(step) AS s FROM scalars UNION ALL "
                         "SELECT MAX(step) FROM staleness UNION ALL SELECT MAX(step) FROM rewards)")
        idle = self.idle_fractions(since_s=last - self.t0 - window_s)
        idle_fraction = None
        if not idle.empty and idle["total_s"].sum() > 0:
            idle_fraction = float(idle["idle_s"].sum() / idle["total_s"].sum())
        else:
            # Runs whose executors report only the scalar, not the intervals.
            idle_fraction = _to_float(self._one(
                "SELECT AVG(value) FROM scalars WHERE name = ? AND t >= ?",
                [names.IDLE_FRACTION, last - window_s]))
        sync = self._frame("SELECT version, MAX(seconds) AS seconds, MAX(t) AS t FROM weight_sync "
                           "WHERE version = (SELECT MAX(version) FROM weight_sync) GROUP BY version")
        h = Headline(
            step=None if step is None else int(step),
            gen_tokens_per_s=self._recent_rate(names.GEN_TOKENS_PER_S, window_s),
            train_tokens_per_s=self._recent_rate(names.TRAIN_TOKENS_PER_S, window_s),
            idle_fraction=idle_fraction,
            mean_staleness=_to_float(self._one("SELECT AVG(staleness) FROM staleness WHERE used = 1")),
            elapsed_s=last - self.t0,
            last_checkpoint_step=None if checkpoint is None else checkpoint[0],
            last_checkpoint_path=None if checkpoint is None else checkpoint[1],
        )
        if not sync.empty:
            h.last_sync_version = int(sync["version"].iloc[0])
            h.last_sync_s = float(sync["seconds"].iloc[0])
            h.last_sync_age_s = max(0.0, last - float(sync["t"].iloc[0]))
        return h

    def last_checkpoint(self) -> tuple[int, str] | None:
        """``(step, path)`` of the newest saved checkpoint, read now (the trainer rewrites
        it at every save); None before the first save or when the value is unreadable."""
        raw = self._one("SELECT value FROM meta WHERE key = ?", [LAST_CHECKPOINT])
        try:
            value = json.loads(raw)
            return int(value["step"]), str(value["path"])
        except (TypeError, ValueError, KeyError):
            return None

    def resumes(self) -> list[tuple[int, float]]:
        """``(step, seconds since start)`` of each time the run was resumed from a
        checkpoint (``meta.resumed``), read now; empty when never or unreadable."""
        raw = self._one("SELECT value FROM meta WHERE key = ?", [RESUMED])
        try:
            return [(int(r["step"]), float(r["t"]) - self.t0) for r in json.loads(raw)]
        except (TypeError, ValueError, KeyError):
            return []

    def _recent_rate(self, name: str, window_s: float) -> float | None:
        # Mean per replica over the window ending at that scalar's newest row, then summed:
        # two generators at 100 tok/s each are 200 tok/s for the run.
        return _to_float(self._one(
            "SELECT SUM(v) FROM (SELECT AVG(value) AS v FROM scalars WHERE name = ? AND t >= "
            "(SELECT MAX(t) FROM scalars WHERE name = ?) - ? GROUP BY role, replica)",
            [name, name, window_s]))

    # ---- executors

    def idle_fractions(self, *, since_s: float | None = None) -> pd.DataFrame:
        """Busy and idle seconds per executor replica (from the recorded intervals).

        Columns: ``role, replica, busy_s, idle_s, total_s, idle_fraction``. ``since_s``
        counts only the part of each interval after that time.
        """
        lo = self.t0 + since_s if since_s is not None else -math.inf
        return self._frame(
            "SELECT role, replica, "
            "SUM(CASE WHEN kind = 'busy' THEN t1 - MAX(t0, :lo) ELSE 0 END) AS busy_s, "
            "SUM(CASE WHEN kind = 'idle' THEN t1 - MAX(t0, :lo) ELSE 0 END) AS idle_s, "
            "SUM(t1 - MAX(t0, :lo)) AS total_s, "
            "SUM(CASE WHEN kind = 'idle' THEN t1 - MAX(t0, :lo) ELSE 0 END) "
            "  / NULLIF(SUM(t1 - MAX(t0, :lo)), 0) AS idle_fraction "
            "FROM intervals WHERE t1 > :lo GROUP BY role, replica ORDER BY role, replica",
            {"lo": lo})

    def idle_breakdown(self) -> pd.DataFrame:
        """Seconds per (role, kind, what): what each executor waited on or worked at."""
        return self._frame("SELECT role, kind, what, SUM(t1 - t0) AS seconds, COUNT(*) AS n "
                           "FROM intervals GROUP BY role, kind, what ORDER BY role, kind, seconds DESC")

    def time_span(self) -> tuple[float, float] | None:
        """(first, last) event time in seconds since start, or None for an empty run."""
        last = self.last_time()
        return None if last is None else (0.0, last - self.t0)

    def intervals(self, *, start_s: float | None = None, end_s: float | None = None,
                  max_rows: int = 3000, buckets: int = 400) -> pd.DataFrame:
        """Busy/idle intervals overlapping the window [start_s, end_s] (seconds since start).

        Columns: ``role, replica, t0, t1, busy_fraction, what, n``. While the window holds
        at most ``max_rows`` intervals they are returned as recorded (``busy_fraction`` 1
        or 0, ``n`` 1). Beyond that each executor's window is cut into ``buckets`` slices
        and every slice becomes one row whose ``busy_fraction`` is the busy share of the
        time recorded in it, so an hour of events still draws as a few thousand bars.
        """
        span = self.time_span()
        if span is None:
            return _empty("role", "replica", "t0", "t1", "busy_fraction", "what", "n")
        lo = self.t0 + (span[0] if start_s is None else start_s)
        hi = self.t0 + (span[1] if end_s is None else end_s)
        window = {"lo": lo, "hi": hi, "t0": self.t0}
        count = self._one("SELECT COUNT(*) FROM intervals WHERE t0 <= :hi AND t1 >= :lo", window)
        if count <= max_rows:
            return self._frame(
                "SELECT role, replica, MAX(t0, :lo) - :t0 AS t0, MIN(t1, :hi) - :t0 AS t1, "
                "CASE WHEN kind = 'busy' THEN 1.0 ELSE 0.0 END AS busy_fraction, what, 1 AS n "
                "FROM intervals WHERE t0 <= :hi AND t1 >= :lo ORDER BY role, replica, t0", window)
        # An interval is attributed to the slice it starts in; slices are short next to
        # the window, so the picture is right at the scale it is drawn.
        width = max((hi - lo) / max(1, buckets), 1e-9)
        return self._frame(
            "SELECT role, replica, :lo + b * :w - :t0 AS t0, :lo + (b + 1) * :w - :t0 AS t1, "
            "busy / NULLIF(total, 0) AS busy_fraction, "
            "printf('%d intervals, %.0f%% busy', n, 100.0 * busy / NULLIF(total, 0)) AS what, n "
            "FROM (SELECT role, replica, CAST((MAX(t0, :lo) - :lo) / :w AS INTEGER) AS b, "
            "  SUM(CASE WHEN kind = 'busy' THEN MIN(t1, :hi) - MAX(t0, :lo) ELSE 0 END) AS busy, "
            "  SUM(MIN(t1, :hi) - MAX(t0, :lo)) AS total, COUNT(*) AS n "
            "  FROM intervals WHERE t0 <= :hi AND t1 >= :lo GROUP BY role, replica, b) "
            "ORDER BY role, replica, t0", {**window, "w": width})

    # ---- staleness

    def staleness_histogram(self) -> pd.DataFrame:
        """Rollouts per staleness value. Columns: ``staleness, used, dropped``."""
        return self._frame("SELECT staleness, SUM(used) AS used, SUM(1 - used) AS dropped "
                           "FROM staleness GROUP BY staleness ORDER BY staleness")

    def staleness_by_step(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Per training step (grouped into strides past ``max_points`` steps): staleness of
        the rollouts consumed. Columns: ``step, t, mean, max, used, dropped``."""
        lo, stride = self._stride("staleness", "step", max_points)
        return self._frame(
            "SELECT MAX(step) AS step, AVG(t) - ? AS t, AVG(CASE WHEN used = 1 THEN staleness END) AS mean, "
            "MAX(staleness) AS max, SUM(used) AS used, SUM(1 - used) AS dropped "
            "FROM staleness GROUP BY (step - ?) / ? ORDER BY step", [self.t0, lo or 0, stride])

    # ---- weight sync

    def weight_sync(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Per weight version (grouped into strides past ``max_points`` versions), over the
        receivers (the generators; the senders' rows are ``weight_sync_by_sender``'s).

        Columns: ``version, t, receivers, bytes`` (payload of one receiver),
        ``total_bytes`` (all receivers), ``seconds_mean``, ``seconds_max``,
        ``gbytes_per_s`` (payload over the slowest receiver's time).
        """
        lo, stride = self._stride("weight_sync", "version", max_points)
        return self._frame(
            "SELECT MAX(version) AS version, AVG(t) - ? AS t, "
            "COUNT(DISTINCT receiver) AS receivers, MAX(bytes) AS bytes, "
            "SUM(bytes) / COUNT(DISTINCT version) AS total_bytes, "
            "AVG(seconds) AS seconds_mean, MAX(seconds) AS seconds_max, "
            "MAX(bytes) / NULLIF(MAX(seconds), 0) / 1e9 AS gbytes_per_s "
            f"FROM weight_sync WHERE NOT {_SENDER} GROUP BY (version - ?) / ? ORDER BY version",
            [self.t0, lo or 0, stride])

    def weight_sync_receivers(self) -> pd.DataFrame:
        """Per receiver: ``receiver, syncs, mean_s, max_s, bytes`` (total)."""
        return self._frame("SELECT receiver, COUNT(*) AS syncs, AVG(seconds) AS mean_s, "
                           "MAX(seconds) AS max_s, SUM(bytes) AS bytes FROM weight_sync "
                           f"WHERE NOT {_SENDER} GROUP BY receiver ORDER BY receiver")

    def weight_sync_senders(self) -> pd.DataFrame:
        """Per trainer rank that sends (its shard, with several ranks): ``sender, syncs,
        bytes_per_sync, mean_s, max_s, gbytes_per_s`` (its bytes over its mean time)."""
        return self._frame("SELECT receiver AS sender, COUNT(*) AS syncs, AVG(bytes) AS bytes_per_sync, "
                           "AVG(seconds) AS mean_s, MAX(seconds) AS max_s, "
                           "AVG(bytes) / NULLIF(AVG(seconds), 0) / 1e9 AS gbytes_per_s FROM weight_sync "
                           f"WHERE {_SENDER} GROUP BY receiver ORDER BY receiver")

    def weight_sync_by_sender(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Per version (strided as ``weight_sync``) and sender: ``version, sender, bytes, seconds``."""
        lo, stride = self._stride("weight_sync", "version", max_points)
        return self._frame(
            "SELECT MAX(version) AS version, receiver AS sender, AVG(bytes) AS bytes, AVG(seconds) AS seconds "
            f"FROM weight_sync WHERE {_SENDER} GROUP BY (version - ?) / ?, receiver ORDER BY version, receiver",
            [lo or 0, stride])

    # ---- rewards

    def rewards(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Reward per component over time, bucketed. Columns: ``component, t, step, mean,
        n`` (scored rollouts), ``quarantined`` (rollouts with no score)."""
        t_lo = self._one("SELECT MIN(t) FROM rewards")
        t_hi = self._one("SELECT MAX(t) FROM rewards")
        bucket = self._bucket(t_lo, t_hi, max_points)
        return self._frame(
            "SELECT component, AVG(t) - ? AS t, MAX(step) AS step, AVG(value) AS mean, "
            "COUNT(value) AS n, SUM(value IS NULL) AS quarantined FROM rewards "
            "GROUP BY component, CAST((t - ?) / ? AS INTEGER) ORDER BY component, t",
            [self.t0, t_lo or 0.0, bucket])

    def quarantine_reasons(self) -> pd.DataFrame:
        """Rollouts a reward component could not score: ``component, reason, n``."""
        return self._frame("SELECT component, COALESCE(reason, 'unknown') AS reason, COUNT(*) AS n "
                           "FROM rewards WHERE value IS NULL GROUP BY component, reason ORDER BY n DESC")

    # ---- security

    def security_counts(self) -> pd.DataFrame:
        """Every counter under ``security/`` (frames rejected by reason, weight versions
        refused...), whoever records it: ``name, role, replica, count``, the highest count
        each process reported (the counters only grow), largest first."""
        lo, hi = names.SECURITY_PREFIX, names.SECURITY_PREFIX[:-1] + chr(ord(names.SECURITY_PREFIX[-1]) + 1)
        return self._frame("SELECT name, role, replica, MAX(value) AS count FROM scalars "
                           "WHERE name >= ? AND name < ? GROUP BY name, role, replica "
                           "ORDER BY count DESC, name, role, replica", [lo, hi])

    # ---- queues

    def queue_depths(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Depth of each queue (scalars ``queue/<name>``) over time; ``queue`` column added."""
        df = self.scalar_series(prefix=names.QUEUE_PREFIX, max_points=max_points)
        df.insert(0, "queue", df["name"].astype(str).str.removeprefix(names.QUEUE_PREFIX))
        return df


def _to_float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _empty(*columns: str) -> pd.DataFrame:
    return pd.DataFrame(columns=list(columns))
