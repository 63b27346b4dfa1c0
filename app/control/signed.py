"""Signed values in the control store: every key that steers a run.

A ``TCPStore`` authenticates nobody: whoever reaches its port may set, append to, add to
or delete any key. So every value a role acts on is a *record*: one frame of
``llamarl.app.control.frames`` (HMAC-SHA256 under the app's secret, no second scheme) around::

    {"key": <the store key it was written for>, "writer": <role/replica, or "user">,
     "n": <the writer's counter>, "value": <JSON>}

- ``key`` inside the tag: a record copied to another key is refused;
- ``writer``: who wrote it; each reader says whose records it takes for a key;
- ``n``: strictly increasing per writing process (nanoseconds since the epoch, bumped
  when equal, so a restarted writer continues above its earlier records as long as its
  host's clock has not gone back): a reader refuses a record older than the newest it
  accepted from that writer for that key, i.e. a replay.

A refused record is ignored: the reader keeps the newest record it accepted, counts the
refusal once per distinct bad value under ``security/rejected_writes/<kind>`` and logs the
first one of each key. It never stops, pauses or redirects the run by itself.

The store's atomic operations compute values nobody signs (``add``, ``append``,
``compare_set`` of a bare number), so the keys that used them are redesigned:

- a counter one writer owns (a heartbeat, the groups a trainer rank dropped) is a record
  that writer rewrites; a heartbeat "moves" when its ``n`` grows;
- a list (members, failed, gone) is an unsigned list of names, only a hint of which
  records to read (appended as ``;name;`` so that bytes someone appended before cannot
  run into a name), and a signed record per name;
- the generators' shared slot counter stays a compare-and-set, of signed records;
- a generator process's incarnation (the first half of its group ids; an ``add`` before)
  is drawn at random and registered as a record of its own (``llamarl.app.control.incarnations``).

What this cannot do: stop someone who can reach the port from deleting or overwriting
keys (a denial of service; records the controller published once are re-published by
``SignedStore.reassert``), or from popping queue messages. Replays are caught per
reader: one that never saw the newer record of a key accepts an older authentic one
(records of an earlier attempt of the same app id, a SLURM requeue that keeps the
secret file, are authentic too). The store must listen only where the roles need it
(``llamarl.app.control.transport.host_store``).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch.distributed as dist

from llamarl.app.control import frames
from llamarl.app import names

log = logging.getLogger("llamarl")

__all__ = ["CONTROLLER", "USER", "Record", "SignedStore", "WriteRejections", "key_kind"]

CONTROLLER = "trainer/0"
"""The writer of everything the controller publishes (config, version, roster...)."""
USER = "user"
"""The writer of a stop requested with ``python -m llamarl.app.roles.stop``; accepted for the stop key only."""

_KINDS = {
    "stop": "stop", "failure": "failure", "failed": "failure", "heartbeat": "heartbeat",
    "members": "membership", "gone": "membership", "gone_list": "membership", "exited": "membership", "data_checked": "membership",
    "version": "version", "config": "config", "policy_path": "config", "data": "config",
    "resume": "config", "slots_done": "config", "app_id": "config",
    "weight_digest": "weights", "groups_reserved": "slots", "groups_dropped": "slots", "held": "held", "queue": "lost_slots",
    "incarnation": "incarnation",
}


def key_kind(key: str) -> str:
    """The metric kind of a store key: ``llamarl/heartbeat/generator/0`` -> ``heartbeat``;
    the weight plane's keys are all ``weights``."""
    if key.startswith(names.WEIGHT_PLANE_PREFIX + "/") or key == names.WEIGHT_PLANE_PREFIX:
        return "weights"
    first = key.removeprefix("llamarl/").split("/", 1)[0]
    return _KINDS.get(first, "other")


MAX_REMEMBERED = 65536
"""Distinct refused values remembered (so that one read again is not counted again)."""


class WriteRejections:
    """Refused records of one process, by kind; the first refusal at each key is logged."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.counts: Counter[str] = Counter()
        self._seen: set[tuple[str, bytes]] = set()  # (key, digest of the refused value)
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str, raw: bytes, why: str) -> None:
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        with self._lock:
            if (key, digest) in self._seen:  # the same bad value read again: one write
                return
            if len(self._seen) >= MAX_REMEMBERED:  # a flood of distinct values: memory stays bounded
                self._seen.clear()
            self._seen.add((key, digest))
            self.counts[key_kind(key)] += 1
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.warning("%s: ignored a write to control key %r that is not this app's (%s); further "
                        "ones at this key are only counted", self.where, key, why)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {names.rejected_write_metric(k): float(n) for k, n in self.counts.items()}


@dataclass(frozen=True)
class Record:
    """An accepted record: who wrote it, its counter and its value."""

    raw: bytes
    writer: str
    n: int
    value: Any


class _Counter:
    """This process's record counter: nanoseconds since the epoch, strictly increasing."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last


_COUNTER = _Counter()

Writers = Collection[str] | Callable[[str], bool] | None
"""Whose records a reader takes: names, a test, or ``None``: any member of the app."""


def _allowed(writers: Writers, writer: str) -> bool:
    if writers is None:
        return writer != USER
    if callable(writers):
        return writers(writer)
    return writer in writers


class _ReaderState:
    """What one process accepted, by full key (prefixes included): shared by a
    ``SignedStore``, its clones and its prefixed views."""

    def __init__(self) -> None:
        self.accepted: dict[str, Record] = {}
        self.newest: dict[str, dict[str, int]] = {}  # key -> writer -> newest n accepted
        self.kept: dict[str, bytes] = {}  # records this process published, to reassert
        self.lock = threading.Lock()
        # Held across a kept record's write and each reassert: a reassert between the
        # write and its bookkeeping would put the previous record back.
        self.publishing = threading.Lock()


class SignedStore:
    """Signed reads and writes of control keys over one store connection.

    ``writer`` is this process's member id (``role/replica``); ``rejections`` counts what
    its reads refused. ``store`` stays available for the unsigned parts (queues, whose
    frames carry their own tag, and the list hints).
    """

    def __init__(self, store: dist.Store, secret: bytes, writer: str,
                 rejections: WriteRejections | None = None) -> None:
        frames.check_secret(secret)
        self.store, self.secret, self.writer = store, secret, writer
        self.rejections = rejections or WriteRejections(writer)
        self.prefix = ""  # of every key this view names, in the root store
        self._root = store  # the unprefixed store, where kept records are reasserted
        self._state = _ReaderState()

    def _view(self, store: dist.Store, root: dist.Store, prefix: str) -> "SignedStore":
        view = SignedStore(store, self.secret, self.writer, self.rejections)
        view.prefix, view._root, view._state = prefix, root, self._state
        return view

    def clone(self, timeout: datetime.timedelta | None = None) -> "SignedStore":
        """The same reader state and counts over a new connection (for another thread);
        ``timeout``: that connection's own timeout for blocking calls."""
        if not isinstance(self._root, dist.TCPStore):
            return self
        root = self._root.clone()
        if timeout is not None:
            root.set_timeout(timeout)
        store = dist.PrefixStore(self.prefix.rstrip("/"), root) if self.prefix else root
        return self._view(store, root, self.prefix)

    def prefixed(self, prefix: str) -> "SignedStore":
        """The same over ``PrefixStore(prefix, store)``; records are signed for the full key."""
        return self._view(dist.PrefixStore(prefix, self.store), self._root, f"{self.prefix}{prefix}/")

    # --- writing -------------------------------------------------------------------------
    def seal(self, key: str, value: Any, n: int | None = None) -> bytes:
        """The signed record of ``value`` for ``key`` (to ``set`` or ``queue_push`` it)."""
        return frames.encode({"key": self.prefix + key, "writer": self.writer,
                              "n": _COUNTER.next() if n is None else n, "value": value}, self.secret)

    def put(self, key: str, value: Any, *, keep: bool = False) -> bytes:
        """Write ``value`` (JSON) to ``key``, signed. ``keep``: a value published once that
        ``reassert`` writes again if anyone overwrites or deletes it (and that this write
        first checks: a value someone else wrote over the last one is counted)."""
        n = _COUNTER.next()
        raw = self.seal(key, value, n)
        if not keep:
            self.store.set(key, raw)
            self._accept(key, raw, self.writer, n, value)
            return raw
        with self._state.publishing:
            self._check_kept(self.prefix + key)
            self.store.set(key, raw)
            self._accept(key, raw, self.writer, n, value)
            with self._state.lock:
                self._state.kept[self.prefix + key] = raw
        return raw

    def compare_set(self, key: str, expected: bytes, value: Any) -> tuple[bool, bytes]:
        """Replace the raw value ``expected`` (b"" when absent) by ``value``, signed, if the
        key still holds it; ``(won, value now)``."""
        n = _COUNTER.next()
        raw = self.seal(key, value, n)
        now = self.store.compare_set(key, expected, raw)
        if now == raw:
            self._accept(key, raw, self.writer, n, value)
        return now == raw, now

    def keep_plain(self, key: str) -> None:
        """Also reassert the (unsigned) value ``key`` holds now (none: nothing to keep)."""
        if not self.store.check([key]):
            return
        raw = self.store.get(key)
        with self._state.lock:
            self._state.kept[self.prefix + key] = raw

    def _check_kept(self, full: str) -> bool:
        """Whether the kept record of ``full`` is still in the store (counted when not)."""
        with self._state.lock:
            raw = self._state.kept.get(full)
        if raw is None:
            return True
        now = self._root.get(full) if self._root.check([full]) else b""
        if now != raw and now:
            self.rejections(full, now, "overwrote a value published here")
        return now == raw

    def forget(self, key: str) -> None:
        """Drop what this process holds for ``key``: no longer reasserted, nor remembered
        as accepted (for keys read once, e.g. the weight plane's per-sync ones: memory stays
        bounded over a long run)."""
        full = self.prefix + key
        with self._state.publishing, self._state.lock:
            self._state.kept.pop(full, None)
            self._state.accepted.pop(full, None)
            self._state.newest.pop(full, None)

    def reassert(self) -> list[str]:
        """Publish again each kept record (of this process, whatever the view) that was
        overwritten or deleted; their full keys."""
        fixed = []
        with self._state.publishing:
            with self._state.lock:
                kept = dict(self._state.kept)
            for key, raw in kept.items():
                if not self._check_kept(key):
                    self._root.set(key, raw)
                    fixed.append(key)
        return fixed

    # --- reading -------------------------------------------------------------------------
    def open(self, key: str, raw: bytes, writers: Writers = None, *, once: bool = False) -> Record | None:
        """The record ``raw`` read at ``key`` if it is authentic, meant for ``key``, by an
        allowed writer and not older than the newest accepted from that writer; else
        ``None`` (counted). ``once``: a queue item, which is taken once: the newest record
        seen again is a replay too (a key's value is read again and again)."""
        full = self.prefix + key
        accepted = self._state.accepted.get(full)
        if accepted is not None and accepted.raw == raw and not once:
            return accepted
        try:
            msg = frames.decode(raw, self.secret)
            rec_key, writer, n = msg["key"], msg["writer"], msg["n"]
        except (frames.AuthenticationError, ValueError, KeyError, TypeError) as e:
            self.rejections(full, raw, f"not signed with the app's secret: {str(e)[:120]}")
            return None
        if rec_key != full:
            self.rejections(full, raw, f"a record signed for key {str(rec_key)[:80]!r}")
            return None
        if not isinstance(writer, str) or not isinstance(n, int) or not _allowed(writers, writer):
            self.rejections(full, raw, f"written by {str(writer)[:40]!r}, who may not write it")
            return None
        with self._state.lock:
            newest = self._state.newest.get(full, {}).get(writer, -1)
        if n <= newest:
            if not once and self._superseded(key, raw):
                # Not a replay: this read lost a race with another thread of this process
                # (clones share the reader state), which read and accepted a newer value.
                return self.last(key)
            self.rejections(full, raw, f"a replay: counter {n} of {writer}, newest seen {newest}")
            return None
        return self._accept(key, raw, writer, n, msg.get("value"))

    def _superseded(self, key: str, raw: bytes) -> bool:
        """Whether the store now holds another value of ``key`` than ``raw`` (read before it)."""
        return self.store.check([key]) and self.store.get(key) != raw

    def _accept(self, key: str, raw: bytes, writer: str, n: int, value: Any) -> Record:
        rec, full = Record(raw, writer, n, value), self.prefix + key
        with self._state.lock:
            self._state.accepted[full] = rec
            by_writer = self._state.newest.setdefault(full, {})
            by_writer[writer] = max(n, by_writer.get(writer, -1))
        return rec

    def record(self, key: str, writers: Writers = None) -> Record | None:
        """The newest accepted record of ``key``: the store's value when it is authentic,
        else the last one accepted here (a forged or deleted value changes nothing)."""
        if self.store.check([key]):
            rec = self.open(key, self.store.get(key), writers)
            if rec is not None:
                return rec
        return self.last(key)

    def last(self, key: str) -> Record | None:
        """The newest record of ``key`` accepted here, without asking the store."""
        return self._state.accepted.get(self.prefix + key)

    def settled(self, keys: list[str], writers: list[Writers]) -> list[Record] | None:
        """The records of keys each written once (``writers[i]`` may write ``keys[i]``),
        once every one has an authentic record, else ``None``: one round trip while any
        is missing, two once all are there (a forged value is counted and waited past)."""
        recs = [self.last(key) for key in keys]
        pending = [i for i, rec in enumerate(recs) if rec is None]
        if not pending:
            return recs  # type: ignore[return-value]
        if not self.store.check([keys[i] for i in pending]):
            return None
        for i, raw in zip(pending, self.store.multi_get([keys[i] for i in pending])):
            recs[i] = self.open(keys[i], raw, writers[i])
        return recs if all(rec is not None for rec in recs) else None  # type: ignore[return-value]

    def get(self, key: str, writers: Writers = None, default: Any = None) -> Any:
        rec = self.record(key, writers)
        return rec.value if rec is not None else default

    def wait(self, key: str, timeout_s: float, what: str, *, writers: Writers = None,
             should_stop: Callable[[], bool] | None = None, poll_s: float = 0.05) -> Any:
        """The value of ``key`` once an authentic record is there; ``TimeoutError`` naming
        ``what`` after ``timeout_s``; ``llamarl.app.control.transport.Stopped`` once ``should_stop()``."""
        from llamarl.app.control.transport import Stopped  # transport imports this module

        deadline = time.monotonic() + timeout_s
        while (rec := self.record(key, writers)) is None:
            if should_stop is not None and should_stop():
                raise Stopped(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.writer}: no {what} after {timeout_s:g} s")
            time.sleep(poll_s)
        return rec.value

    # --- lists of names ----------------------------------------------------------------------
    def add_name(self, list_key: str, name: str) -> None:
        """Append ``name`` to an unsigned list of names (the record says whether it counts)."""
        self.store.append(list_key, f";{name};")

    def names_in(self, list_key: str) -> list[str]:
        """The well-formed ``role/replica`` names of a list, in order, once each."""
        if not self.store.check([list_key]):
            return []
        out = []
        for item in self.store.get(list_key).decode(errors="replace").split(";"):
            role, sep, replica = item.partition("/")
            if sep and role and replica.isdigit() and item not in out:
                out.append(item)
        return out

    def named_records(self, list_key: str, record_key: Callable[[str], str],
                      writers: Callable[[str], Writers]) -> dict[str, Record]:
        """The names of a list that have an authentic record, with it. A name without any
        record is counted once (someone appended it); a bad record is counted as such."""
        listed = self.names_in(list_key)
        keys = [record_key(name) for name in listed]
        # One round trip for all records in the usual case (``multi_get`` would wait for
        # a key that is missing: a name someone appended without its record).
        raws = self.store.multi_get(keys) if keys and self.store.check(keys) else [None] * len(keys)
        out = {}
        for name, key, raw in zip(listed, keys, raws):
            rec = self.open(key, raw, writers(name)) if raw is not None else self.record(key, writers(name))
            rec = rec or self.last(key)
            if rec is None:
                if not self.store.check([key]):
                    self.rejections(self.prefix + list_key, name.encode(), f"{name!r} has no signed record")
                continue
            out[name] = rec
        return out
