"""``Run``: a read-only view of one run's metrics, the queries the dashboard's page plots.

Every query aggregates in SQL and returns a small ``pandas.DataFrame``: a run of hours
holds millions of rows, and the page must stay responsive while it refreshes every few
seconds. Times in results are seconds since the run started (``t``), so runs line up
when compared side by side. ``llamarl.dashboard.data.open_run`` makes one.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import pandas as pd

from llamarl.app import names
from llamarl.app.metrics.events import DB_NAME, LAST_CHECKPOINT, RESUMED, TABLES
from llamarl.dashboard.database import CorruptDatabase, Reader, bucket_width, db_mtime, empty, read_config_json, to_float

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
        self._sql = Reader(db, path.name)
        self._last_time: Any = _UNSET
        self.config = self._load_config()
        self.started_at = to_float(meta.get("started_at"))
        # Times are reported from the earliest of started_at and the first event, so a
        # clock skew between hosts never produces negative times.
        first = self._sql.one("SELECT MIN(t) FROM (SELECT MIN(t) AS t FROM scalars UNION ALL "
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
        self._sql.close()

    # ---- plumbing

    def _load_config(self) -> dict[str, Any]:
        try:
            value = json.loads(self.meta.get("config", ""))
            if isinstance(value, dict):
                return value
        except ValueError:
            pass
        return read_config_json(self.path)

    # ---- basics

    @property
    def max_staleness(self) -> int | None:
        """The bound on off-policy lag from the config (searched one level deep too); with
        ``auto`` (``auto_staleness``), the largest bound the run has set so far."""
        value = self.config.get("max_staleness")
        if value is None:
            for section in self.config.values():
                if isinstance(section, dict) and "max_staleness" in section:
                    value = section["max_staleness"]
                    break
        if value == "auto":
            value = self._sql.one("SELECT MAX(value) FROM scalars WHERE name = ?", [names.STALENESS_BOUND])
        try:
            return None if value is None else int(value)
        except (TypeError, ValueError):
            return None

    @property
    def auto_staleness(self) -> bool:
        return self.config.get("max_staleness") == "auto"

    def bound_changes(self) -> pd.DataFrame:
        """``--max-staleness auto``'s changes. Columns: ``step, t, previous, bound, reason``."""
        if not self._sql.one("SELECT COUNT(*) FROM sqlite_master WHERE name = 'staleness_bounds'"):
            return empty("step", "t", "previous", "bound", "reason")
        return self._sql.frame("SELECT step, t - ? AS t, previous, bound, reason FROM staleness_bounds "
                               "ORDER BY t", [self.t0])

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
            value = self._sql.one(f"SELECT MAX(t) FROM ({parts})")
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
        newest = self.last_time() or db_mtime(self.path)
        return newest is not None and (now or time.time()) - newest < LIVE_WITHIN_S

    def is_empty(self) -> bool:
        """True while the writer has written ``meta`` but no events."""
        return self.last_time() is None

    def counts(self) -> dict[str, int]:
        """Rows per table (for the page's footer and for tests)."""
        return {table: int(self._sql.one(f"SELECT COUNT(*) FROM {table}")) for table in TABLES.values()}

    def scalar_names(self) -> list[str]:
        return list(self._sql.frame("SELECT DISTINCT name FROM scalars ORDER BY name")["name"])

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
            return empty(*columns)
        if since_s is not None:
            where += " AND t >= ?"
            params.append(self.t0 + since_s)
        t_lo = self._sql.one(f"SELECT MIN(t) FROM scalars WHERE {where}", params)
        t_hi = self._sql.one(f"SELECT MAX(t) FROM scalars WHERE {where}", params)
        if t_lo is None:
            return empty(*columns)
        bucket = bucket_width(t_lo, t_hi, max_points)
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
        return self._sql.frame(sql, params)

    # ---- headline

    def headline(self, *, window_s: float = 30.0) -> Headline:
        """The numbers on top of the page, rates averaged over the last ``window_s``."""
        last = self.last_time()
        if last is None:
            return Headline()
        checkpoint = self.last_checkpoint()
        step = self._sql.one("SELECT MAX(s) FROM (SELECT MAX(step) AS s FROM scalars UNION ALL "
                         "SELECT MAX(step) FROM staleness UNION ALL SELECT MAX(step) FROM rewards)")
        idle = self.idle_fractions(since_s=last - self.t0 - window_s)
        idle_fraction = None
        if not idle.empty and idle["total_s"].sum() > 0:
            idle_fraction = float(idle["idle_s"].sum() / idle["total_s"].sum())
        else:
            # Runs whose executors report only the scalar, not the intervals.
            idle_fraction = to_float(self._sql.one(
                "SELECT AVG(value) FROM scalars WHERE name = ? AND t >= ?",
                [names.IDLE_FRACTION, last - window_s]))
        sync = self._sql.frame("SELECT version, MAX(seconds) AS seconds, MAX(t) AS t FROM weight_sync "
                           "WHERE version = (SELECT MAX(version) FROM weight_sync) GROUP BY version")
        h = Headline(
            step=None if step is None else int(step),
            gen_tokens_per_s=self._recent_rate(names.GEN_TOKENS_PER_S, window_s),
            train_tokens_per_s=self._recent_rate(names.TRAIN_TOKENS_PER_S, window_s),
            idle_fraction=idle_fraction,
            mean_staleness=to_float(self._sql.one("SELECT AVG(staleness) FROM staleness WHERE used = 1")),
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
        raw = self._sql.one("SELECT value FROM meta WHERE key = ?", [LAST_CHECKPOINT])
        try:
            value = json.loads(raw)
            return int(value["step"]), str(value["path"])
        except (TypeError, ValueError, KeyError):
            return None

    def resumes(self) -> list[tuple[int, float]]:
        """``(step, seconds since start)`` of each time the run was resumed from a
        checkpoint (``meta.resumed``), read now; empty when never or unreadable."""
        raw = self._sql.one("SELECT value FROM meta WHERE key = ?", [RESUMED])
        try:
            return [(int(r["step"]), float(r["t"]) - self.t0) for r in json.loads(raw)]
        except (TypeError, ValueError, KeyError):
            return []

    def _recent_rate(self, name: str, window_s: float) -> float | None:
        # Mean per replica over the window ending at that scalar's newest row, then summed:
        # two generators at 100 tok/s each are 200 tok/s for the run.
        return to_float(self._sql.one(
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
        return self._sql.frame(
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
        return self._sql.frame("SELECT role, kind, what, SUM(t1 - t0) AS seconds, COUNT(*) AS n "
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
            return empty("role", "replica", "t0", "t1", "busy_fraction", "what", "n")
        lo = self.t0 + (span[0] if start_s is None else start_s)
        hi = self.t0 + (span[1] if end_s is None else end_s)
        window = {"lo": lo, "hi": hi, "t0": self.t0}
        count = self._sql.one("SELECT COUNT(*) FROM intervals WHERE t0 <= :hi AND t1 >= :lo", window)
        if count <= max_rows:
            return self._sql.frame(
                "SELECT role, replica, MAX(t0, :lo) - :t0 AS t0, MIN(t1, :hi) - :t0 AS t1, "
                "CASE WHEN kind = 'busy' THEN 1.0 ELSE 0.0 END AS busy_fraction, what, 1 AS n "
                "FROM intervals WHERE t0 <= :hi AND t1 >= :lo ORDER BY role, replica, t0", window)
        # An interval is attributed to the slice it starts in; slices are short next to
        # the window, so the picture is right at the scale it is drawn.
        width = max((hi - lo) / max(1, buckets), 1e-9)
        return self._sql.frame(
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
        return self._sql.frame("SELECT staleness, SUM(used) AS used, SUM(1 - used) AS dropped "
                           "FROM staleness GROUP BY staleness ORDER BY staleness")

    def staleness_by_step(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Per training step (grouped into strides past ``max_points`` steps): staleness of
        the rollouts consumed. Columns: ``step, t, mean, max, used, dropped``."""
        lo, stride = self._sql.stride("staleness", "step", max_points)
        return self._sql.frame(
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
        lo, stride = self._sql.stride("weight_sync", "version", max_points)
        return self._sql.frame(
            "SELECT MAX(version) AS version, AVG(t) - ? AS t, "
            "COUNT(DISTINCT receiver) AS receivers, MAX(bytes) AS bytes, "
            "SUM(bytes) / COUNT(DISTINCT version) AS total_bytes, "
            "AVG(seconds) AS seconds_mean, MAX(seconds) AS seconds_max, "
            "MAX(bytes) / NULLIF(MAX(seconds), 0) / 1e9 AS gbytes_per_s "
            f"FROM weight_sync WHERE NOT {_SENDER} GROUP BY (version - ?) / ? ORDER BY version",
            [self.t0, lo or 0, stride])

    def weight_sync_receivers(self) -> pd.DataFrame:
        """Per receiver: ``receiver, syncs, mean_s, max_s, bytes`` (total)."""
        return self._sql.frame("SELECT receiver, COUNT(*) AS syncs, AVG(seconds) AS mean_s, "
                           "MAX(seconds) AS max_s, SUM(bytes) AS bytes FROM weight_sync "
                           f"WHERE NOT {_SENDER} GROUP BY receiver ORDER BY receiver")

    def weight_sync_senders(self) -> pd.DataFrame:
        """Per trainer rank that sends (its shard, with several ranks): ``sender, syncs,
        bytes_per_sync, mean_s, max_s, gbytes_per_s`` (its bytes over its mean time)."""
        return self._sql.frame("SELECT receiver AS sender, COUNT(*) AS syncs, AVG(bytes) AS bytes_per_sync, "
                           "AVG(seconds) AS mean_s, MAX(seconds) AS max_s, "
                           "AVG(bytes) / NULLIF(AVG(seconds), 0) / 1e9 AS gbytes_per_s FROM weight_sync "
                           f"WHERE {_SENDER} GROUP BY receiver ORDER BY receiver")

    def weight_sync_by_sender(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Per version (strided as ``weight_sync``) and sender: ``version, sender, bytes, seconds``."""
        lo, stride = self._sql.stride("weight_sync", "version", max_points)
        return self._sql.frame(
            "SELECT MAX(version) AS version, receiver AS sender, AVG(bytes) AS bytes, AVG(seconds) AS seconds "
            f"FROM weight_sync WHERE {_SENDER} GROUP BY (version - ?) / ?, receiver ORDER BY version, receiver",
            [lo or 0, stride])

    # ---- rewards

    def rewards(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Reward per component over time, bucketed. Columns: ``component, t, step, mean,
        n`` (scored rollouts), ``quarantined`` (rollouts with no score)."""
        t_lo = self._sql.one("SELECT MIN(t) FROM rewards")
        t_hi = self._sql.one("SELECT MAX(t) FROM rewards")
        bucket = bucket_width(t_lo, t_hi, max_points)
        return self._sql.frame(
            "SELECT component, AVG(t) - ? AS t, MAX(step) AS step, AVG(value) AS mean, "
            "COUNT(value) AS n, SUM(value IS NULL) AS quarantined FROM rewards "
            "GROUP BY component, CAST((t - ?) / ? AS INTEGER) ORDER BY component, t",
            [self.t0, t_lo or 0.0, bucket])

    def quarantine_reasons(self) -> pd.DataFrame:
        """Rollouts a reward component could not score: ``component, reason, n``."""
        return self._sql.frame("SELECT component, COALESCE(reason, 'unknown') AS reason, COUNT(*) AS n "
                           "FROM rewards WHERE value IS NULL GROUP BY component, reason ORDER BY n DESC")

    # ---- security

    def security_counts(self) -> pd.DataFrame:
        """Every counter under ``security/`` (frames rejected by reason, weight versions
        refused...), whoever records it: ``name, role, replica, count``, the highest count
        each process reported (the counters only grow), largest first."""
        lo, hi = names.SECURITY_PREFIX, names.SECURITY_PREFIX[:-1] + chr(ord(names.SECURITY_PREFIX[-1]) + 1)
        return self._sql.frame("SELECT name, role, replica, MAX(value) AS count FROM scalars "
                           "WHERE name >= ? AND name < ? GROUP BY name, role, replica "
                           "ORDER BY count DESC, name, role, replica", [lo, hi])

    # ---- queues

    def queue_depths(self, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
        """Depth of each queue (scalars ``queue/<name>``) over time; ``queue`` column added."""
        df = self.scalar_series(prefix=names.QUEUE_PREFIX, max_points=max_points)
        df.insert(0, "queue", df["name"].astype(str).str.removeprefix(names.QUEUE_PREFIX))
        return df
