"""Metrics schema, events and the run directory's SQLite writer.

Every executor turns what it measures into small JSON-able *events* (plain dicts);
they travel to trainer replica 0, the only process that opens ``metrics.db`` for
writing. The dashboard reads the same file through ``llamarl.dashboard.data`` and imports
nothing from ``app`` but this module, so it stays free of torch and process groups.

Tables (schema version ``SCHEMA_VERSION``):

- ``meta(key, value)``: ``schema_version``, ``run_id``, ``started_at``, ``config`` (JSON),
  ``finished_at`` once the run ended well, ``last_checkpoint`` (JSON ``{"step", "path"}``)
  once the trainer saved one, ``resumed`` (JSON list of ``{"step", "t"}``) once a run
  was resumed: where each resume restarted, and when.
- ``scalars(t, step, role, replica, name, value)``: every number over time: throughput
  (``gen/tokens_per_s``, ``train/tokens_per_s``, ...), learning (``loss``, ``reward/<c>``,
  ``eval/accuracy``, ``aipo/ratio_mean`` ...), queue depths (``queue/<name>``), idle
  fractions (``idle_fraction``).
- ``intervals(role, replica, kind, what, t0, t1)``: busy and idle intervals of each
  executor, for the timeline (``kind`` is ``busy`` or ``idle``).
- ``staleness(t, step, version, staleness, used)``: one row per consumed rollout;
  ``used`` is 0 for a rollout dropped for exceeding ``max_staleness``.
- ``weight_sync(t, version, receiver, bytes, seconds)``: one row per sync per receiver
  (``receiver`` is ``trainer`` for the sender's own view).
- ``rewards(t, step, component, value)``: the score of each reward component per
  rollout (``value`` NULL and ``reason`` set when the rollout was quarantined).
- ``staleness_bounds(t, step, previous, bound, reason)``: every change of the staleness
  bound under ``--max-staleness auto``, from the bound before it, with its reason (the
  bound in force at each step is the scalar ``staleness/bound``).

Times are Unix seconds (``time.time()``), so rows from different hosts line up.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from llamarl.app import names
from llamarl.app.errors import ConfigError

SCHEMA_VERSION = 1
DB_NAME = "metrics.db"
LAST_CHECKPOINT = "last_checkpoint"
"""Meta key (and ``config.json`` key) naming the newest saved checkpoint."""
RESUMED = "resumed"
"""Meta key: the steps a run was resumed at (JSON list of ``{"step", "t"}``)."""

EVENT_TYPES = ("scalar", "interval", "staleness", "weight_sync", "reward", "bound")

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS scalars (
    t REAL NOT NULL, step INTEGER, role TEXT NOT NULL, replica INTEGER NOT NULL,
    name TEXT NOT NULL, value REAL);
CREATE INDEX IF NOT EXISTS scalars_name_t ON scalars (name, t);
CREATE TABLE IF NOT EXISTS intervals (
    role TEXT NOT NULL, replica INTEGER NOT NULL, kind TEXT NOT NULL,
    what TEXT NOT NULL, t0 REAL NOT NULL, t1 REAL NOT NULL);
CREATE INDEX IF NOT EXISTS intervals_t0 ON intervals (t0);
CREATE TABLE IF NOT EXISTS staleness (
    t REAL NOT NULL, step INTEGER NOT NULL, version INTEGER NOT NULL,
    staleness INTEGER NOT NULL, used INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS staleness_step ON staleness (step);
CREATE TABLE IF NOT EXISTS weight_sync (
    t REAL NOT NULL, version INTEGER NOT NULL, receiver TEXT NOT NULL,
    bytes INTEGER NOT NULL, seconds REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rewards (
    t REAL NOT NULL, step INTEGER, component TEXT NOT NULL, value REAL, reason TEXT);
CREATE INDEX IF NOT EXISTS rewards_component_t ON rewards (component, t);
CREATE TABLE IF NOT EXISTS staleness_bounds (
    t REAL NOT NULL, step INTEGER NOT NULL, previous INTEGER NOT NULL, bound INTEGER NOT NULL,
    reason TEXT);
"""

# Column order of each event type's table; events are dicts with these keys plus "type".
COLUMNS: dict[str, tuple[str, ...]] = {
    "scalar": ("t", "step", "role", "replica", "name", "value"),
    "interval": ("role", "replica", "kind", "what", "t0", "t1"),
    "staleness": ("t", "step", "version", "staleness", "used"),
    "weight_sync": ("t", "version", "receiver", "bytes", "seconds"),
    "reward": ("t", "step", "component", "value", "reason"),
    "bound": ("t", "step", "previous", "bound", "reason"),
}
TABLES = {
    "scalar": "scalars",
    "interval": "intervals",
    "staleness": "staleness",
    "weight_sync": "weight_sync",
    "reward": "rewards",
    "bound": "staleness_bounds",
}

OPTIONAL_TABLES = ("staleness_bounds",)
"""Tables added within schema 1: a database written before them has none (its readers
read nothing from it)."""


def scalar(name: str, value: float, *, role: str, replica: int = 0, step: int | None = None,
           t: float | None = None) -> dict[str, Any]:
    return {"type": "scalar", "t": time.time() if t is None else t, "step": step,
            "role": role, "replica": replica, "name": name, "value": float(value)}


def scalars(values: dict[str, float], *, role: str, replica: int = 0,
            step: int | None = None) -> list[dict[str, Any]]:
    now = time.time()
    return [scalar(k, v, role=role, replica=replica, step=step, t=now) for k, v in values.items()]


def interval(kind: Literal["busy", "idle"], what: str, t0: float, t1: float, *, role: str,
             replica: int = 0) -> dict[str, Any]:
    return {"type": "interval", "role": role, "replica": replica, "kind": kind, "what": what,
            "t0": t0, "t1": t1}


def staleness(step: int, version: int, lag: int, used: bool) -> dict[str, Any]:
    return {"type": "staleness", "t": time.time(), "step": step, "version": version,
            "staleness": lag, "used": int(used)}


def bound_change(step: int, previous: int, bound: int, reason: str) -> dict[str, Any]:
    """The staleness bound set to ``bound`` (from ``previous``) after ``step``, and why."""
    return {"type": "bound", "t": time.time(), "step": step, "previous": previous, "bound": bound,
            "reason": reason}


def weight_sync(version: int, receiver: str, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"type": "weight_sync", "t": time.time(), "version": version, "receiver": receiver,
            "bytes": int(nbytes), "seconds": float(seconds)}


def reward(component: str, value: float | None, *, step: int | None = None,
           reason: str | None = None) -> dict[str, Any]:
    return {"type": "reward", "t": time.time(), "step": step, "component": component,
            "value": value, "reason": reason}


class MalformedEvents(ValueError):
    """A metrics batch from the queue breaks the event format; ``reason`` is one of the
    rejection reasons of ``llamarl.app.names`` (``missing_field``, ``wrong_type``, ``bad_value``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"malformed metrics batch: {reason}: {detail}")
        self.reason = reason


# What each column of an event may hold: a signed batch is still checked before it
# reaches SQLite, so one bad event cannot fail the writer (and with it the run).
_NUMBER, _INT, _TEXT = (int, float), (int,), (str,)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {  # column -> (types, may be None)
    "t": (_NUMBER, False), "t0": (_NUMBER, False), "t1": (_NUMBER, False), "seconds": (_NUMBER, False),
    "step": (_INT, True), "replica": (_INT, False), "version": (_INT, False),
    "staleness": (_INT, False), "used": (_INT, False), "bytes": (_INT, False),
    "previous": (_INT, False), "bound": (_INT, False),
    "role": (_TEXT, False), "kind": (_TEXT, False), "what": (_TEXT, False), "name": (_TEXT, False),
    "receiver": (_TEXT, False), "component": (_TEXT, False), "reason": (_TEXT, True),
}
_NULLABLE_VALUE = {"scalar": False, "reward": True}


def batch_message(events: list[dict[str, Any]], *, sender: str, stream: int, seq: int,
                  attempt: str) -> dict[str, Any]:
    """One batch of events for the ``metrics`` queue. ``sender`` (``role/replica``), a
    ``stream`` random per process and the batch's ``seq`` in it make its id: the trainer
    writes a batch once, however often it is pushed (``llamarl.app.control.seen_groups.SeenIds``).
    ``attempt``: the run attempt's token (``runtime.run_attempt``): the trainer writes
    only its own attempt's batches, so one captured before a resume is not written again."""
    return {"events": events, "from": sender, "stream": stream, "seq": seq, "attempt": attempt}


def checked_batch(msg: dict[str, Any]) -> tuple[tuple[str, int, str], int, list[dict[str, Any]]]:
    """``((sender, stream, attempt), seq, events)`` of one batch from the ``metrics``
    queue, every event's fields checked against their columns; ``MalformedEvents`` for
    the first thing that is not as ``batch_message`` makes it."""
    for key, kind in (("from", str), ("stream", int), ("seq", int), ("attempt", str)):
        if key not in msg:
            raise MalformedEvents(names.MISSING_FIELD, f"the batch has no {key!r}")
        if not isinstance(msg[key], kind) or isinstance(msg[key], bool):
            raise MalformedEvents(names.WRONG_TYPE, f"the batch's {key!r} is {type(msg[key]).__name__}")
    if msg["seq"] < 0:
        raise MalformedEvents(names.BAD_VALUE, "the batch's 'seq' is negative")
    return (msg["from"], msg["stream"], msg["attempt"]), msg["seq"], _checked_events(msg)


def _checked_events(msg: dict[str, Any]) -> list[dict[str, Any]]:
    events = msg.get("events")
    if not isinstance(events, list):
        raise MalformedEvents(names.MISSING_FIELD if events is None else names.WRONG_TYPE,
                              "'events' must be a list of events")
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("type") not in COLUMNS:
            raise MalformedEvents(names.BAD_VALUE, f"event {i} is not an event of a known type")
        for column in COLUMNS[ev["type"]]:
            if column not in ev:
                raise MalformedEvents(names.MISSING_FIELD, f"event {i} ({ev['type']}) has no {column!r}")
            value = ev[column]
            types, nullable = ((_NUMBER, _NULLABLE_VALUE[ev["type"]]) if column == "value"
                               else _FIELDS[column])
            if value is None and nullable:
                continue
            if not isinstance(value, types) or isinstance(value, bool):
                raise MalformedEvents(names.WRONG_TYPE, f"event {i} ({ev['type']}): {column!r} is "
                                      f"{type(value).__name__}")
    return events


def new_run_dir(runs_dir: str | Path, run_id: str, config: dict[str, Any]) -> Path:
    """``<runs_dir>/<run_id>/`` with ``config.json`` and ``logs/``; a name from the time
    when ``run_id`` is empty. An existing run directory is never overwritten."""
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S")
    if Path(runs_dir).exists() and not Path(runs_dir).is_dir():
        raise ConfigError(f"--runs-dir {runs_dir} is a file, not a directory: name a directory for the runs")
    path = Path(runs_dir) / run_id
    if (path / DB_NAME).exists():
        raise FileExistsError(f"run directory {path} already holds a run; pick another run id")
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return path


log = logging.getLogger("llamarl")

WRITE_BUSY_S = 1.0
"""How long one write waits for a lock another process holds on ``metrics.db`` before the
events are kept for the next write (a run must not stall, nor end, on its metrics)."""
CLOSE_BUSY_S = 30.0
"""How long the last write, at close, waits for such a lock."""
MAX_PENDING = 1_000_000
"""Events kept while the database stays locked; past this the oldest are dropped, counted."""


class MetricsWriter:
    """The single writer of ``<run_dir>/metrics.db`` (trainer replica 0 only).

    WAL mode lets the dashboard read while the run writes. Events are inserted in one
    transaction per ``write`` call; an event of unknown type raises rather than vanish.
    Another process holding a write lock on the database (an SQLite browser, a backup)
    never ends the run: the events wait in memory, it is said once (naming who holds the
    file open, where this machine tells), and the next write catches up.
    """

    def __init__(self, run_dir: str | Path, *, run_id: str, config: dict[str, Any]) -> None:
        self.path = Path(run_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending: list[tuple[str, tuple]] = []
        self._pending_meta: dict[str, str] = {}
        self._locked_since: float | None = None
        self.dropped = 0
        """Events dropped because the database stayed locked past ``MAX_PENDING`` of them."""
        self._db = sqlite3.connect(self.path, timeout=CLOSE_BUSY_S, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_DDL)
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [("schema_version", str(SCHEMA_VERSION)), ("run_id", run_id),
                 ("config", json.dumps(config, default=str))],
            )
            # A resumed run keeps its start: the dashboard's time axis spans both attempts.
            self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('started_at', ?)",
                             (repr(time.time()),))

    def resume_at(self, step: int, saved_at: float) -> None:
        """Continue this database from the checkpoint of ``step`` saved at Unix time
        ``saved_at``: events of later steps (and step-less ones after ``saved_at``) are
        deleted, since the resumed run records them again; ``finished_at`` is cleared and
        ``resumed`` gets the step. ``step=-1``, ``saved_at=0``: keep no event at all."""
        with self._db:
            for table in ("scalars", "rewards"):
                self._db.execute(f"DELETE FROM {table} WHERE step > ? OR (step IS NULL AND t > ?)",
                                 (step, saved_at))
            self._db.execute("DELETE FROM staleness WHERE step > ?", (step,))
            self._db.execute("DELETE FROM staleness_bounds WHERE step > ?", (step,))
            self._db.execute("DELETE FROM weight_sync WHERE version > ? OR t > ?", (step, saved_at))
            self._db.execute("DELETE FROM intervals WHERE t0 > ?", (saved_at,))
            self._db.execute("DELETE FROM meta WHERE key = 'finished_at'")
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (RESUMED,)).fetchone()
            resumed = json.loads(row[0]) if row else []
            resumed.append({"step": max(step, 0), "t": time.time()})
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (RESUMED, json.dumps(resumed)))

    def set_meta(self, key: str, value: str) -> None:
        self._pending_meta[key] = value
        self._flush(WRITE_BUSY_S)

    def write(self, events: Iterable[dict[str, Any]]) -> int:
        """Record ``events``; returns how many rows reached the database now (buffered ones
        included), 0 while another process holds it locked."""
        rows = []
        for ev in events:
            kind = ev.get("type")
            if kind not in COLUMNS:
                raise ValueError(f"unknown metrics event type {kind!r}; expected one of {EVENT_TYPES}")
            rows.append((kind, tuple(ev.get(c) for c in COLUMNS[kind])))
        self._pending.extend(rows)
        if len(self._pending) > MAX_PENDING:
            over = len(self._pending) - MAX_PENDING
            del self._pending[:over]
            self.dropped += over
        return self._flush(WRITE_BUSY_S)

    def _flush(self, busy_s: float) -> int:
        if not self._pending and not self._pending_meta:
            return 0
        rows: dict[str, list[tuple]] = {}
        for kind, row in self._pending:
            rows.setdefault(kind, []).append(row)
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_s * 1000)}")
        try:
            with self._db:
                for kind, batch in rows.items():
                    cols = COLUMNS[kind]
                    self._db.executemany(
                        f"INSERT INTO {TABLES[kind]} ({', '.join(cols)}) "
                        f"VALUES ({', '.join('?' for _ in cols)})", batch)
                self._db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                                     list(self._pending_meta.items()))
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if self._locked_since is None:
                self._locked_since = time.monotonic()
                log.warning("%s is locked by another process%s: keeping metrics in memory and writing them "
                            "once it lets go (the run goes on)", self.path, _holders(self.path))
            return 0
        n = len(self._pending)
        if self._locked_since is not None:
            log.warning("%s is writable again after %.0f s: wrote the %d events kept meanwhile%s", self.path,
                        time.monotonic() - self._locked_since, n,
                        f" ({self.dropped} of the oldest were dropped)" if self.dropped else "")
            self._locked_since = None
        self._pending.clear()
        self._pending_meta.clear()
        return n

    @property
    def pending(self) -> int:
        """Events waiting for the database (another process holds its lock)."""
        return len(self._pending)

    def close(self, *, finished: bool = True) -> None:
        """Write what is pending (waiting up to ``CLOSE_BUSY_S`` for a lock) and close the
        database; ``finished`` records ``finished_at`` so readers know the run is over (a
        crashed run leaves it unset)."""
        if finished:
            self._pending_meta["finished_at"] = repr(time.time())
        self._flush(CLOSE_BUSY_S)
        if self._pending or self._pending_meta:
            log.error("%s stayed locked by another process%s: %d metrics events were not written",
                      self.path, _holders(self.path), len(self._pending))
        self._db.close()


def _holders(path: Path) -> str:
    """`` (held open by pid P (name), ...)``: the other processes of this machine that have
    ``path`` open, as far as /proc shows (the same user's, or all for root); ``""`` if none
    can be seen."""
    found = []
    target = os.path.realpath(path)
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
                found.append(f"pid {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})")
        except OSError:  # gone, or not ours to look at
            continue
    return f" (held open by {', '.join(found)})" if found else ""


class Timeline:
    """Records the busy and idle intervals of one executor as ``interval`` events.

    ``with timeline.busy("generate"): ...`` and ``with timeline.idle("wait_rollouts"): ...``;
    ``drain()`` hands over the events recorded since the last call, and
    ``idle_fraction()`` the share of idle time among them.

    ``busy_ends`` runs at the end of every busy interval, before its end time is taken: a
    role on a GPU passes a stream synchronisation (``llamarl.app.devices.synchronize``), so a
    busy interval ends when the GPU has finished the kernels it launched, and the idle
    intervals between are GPU idle time. (This module stays free of torch: the dashboard
    imports it.)
    """

    def __init__(self, role: str, replica: int = 0, *, busy_ends: Callable[[], None] | None = None) -> None:
        self.role, self.replica, self.busy_ends = role, replica, busy_ends
        self._events: list[dict[str, Any]] = []

    def busy(self, what: str) -> "_Span":
        return _Span(self, "busy", what)

    def idle(self, what: str) -> "_Span":
        return _Span(self, "idle", what)

    def record(self, kind: Literal["busy", "idle"], what: str, t0: float, t1: float) -> None:
        self._events.append(interval(kind, what, t0, t1, role=self.role, replica=self.replica))

    def idle_fraction(self) -> float:
        total = sum(e["t1"] - e["t0"] for e in self._events)
        idle = sum(e["t1"] - e["t0"] for e in self._events if e["kind"] == "idle")
        return idle / total if total > 0 else 0.0

    def drain(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


class _Span:
    def __init__(self, timeline: Timeline, kind: Literal["busy", "idle"], what: str) -> None:
        self.timeline, self.kind, self.what = timeline, kind, what

    def __enter__(self) -> "_Span":
        self.t0 = time.time()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Not after an error: a failing sync would replace the error that ended the block.
        if self.kind == "busy" and self.timeline.busy_ends is not None and exc_type is None:
            self.timeline.busy_ends()
        self.timeline.record(self.kind, self.what, self.t0, time.time())
