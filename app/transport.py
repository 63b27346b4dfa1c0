"""Control and data plane: bounded queues and control keys over the control store.

Everything here rides on the one ``torch.distributed.TCPStore`` hosted by trainer
replica 0 (see docs/architecture.md, "Planes"), and every message is an authenticated
frame of ``app.frames``:

- ``StoreQueue``: a FIFO over the store's ``queue_push``/``queue_pop`` with backpressure
  (``push`` waits while the queue holds ``maxlen`` messages) and waits that always end:
  by a timeout, or by ``should_stop`` becoming true. A frame that does not decode is
  dropped and reported, never fatal.
- ``Control``: the policy version, the stop flag, membership, heartbeats and failure
  flags, under the key names of ``app.names``.

Why no blocking ``queue_pop``: the store's blocking pop uses the connection's timeout,
logs a warning on every expiry and cannot be interrupted, so waits here poll the
non-blocking calls with short, growing sleeps.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from app import names
from app.frames import MAX_FRAME_BYTES, AuthenticationError, check_secret, decode, encode

__all__ = ["BAD_TAG", "MALFORMED_FRAME", "Backoff", "Control", "OnReject", "StoreQueue", "Stopped",
           "connect_store", "host_store", "AppGone"]

# Why a frame was dropped on receipt (see ``StoreQueue.pop_many``).
BAD_TAG, MALFORMED_FRAME = "bad_tag", "malformed_frame"
OnReject = Callable[[str, str], None]
"""``on_reject(reason, detail)``: told about each frame a queue dropped on receipt."""


HEALTH_CHECK_S = 0.5
"""How often a wait for other members asks ``health()`` whether they are still there."""


class AppGone(ConnectionError):
    """A role gave up waiting for the control store: the app is gone, the message says why."""


class Stopped(Exception):
    """A wait was cut short because ``should_stop()`` became true (the run is stopping)."""


# --------------------------------------------------------------------------- store


def host_store(port: int, world_size: int | None = None, timeout_s: float = 300.0,
               host: str = "0.0.0.0") -> dist.TCPStore:
    """Host the control store (trainer replica 0). ``port=0`` picks a free port: read ``.port``."""
    return dist.TCPStore(host, port, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


GIVE_UP_POLL_S = 0.5
"""While a role waits for the store, how often ``give_up`` is asked whether the app is
already known to be gone (its trainer failed before it could host the store)."""


def connect_store(addr: str, timeout_s: float = 300.0,
                  give_up: Callable[[], str | None] | None = None) -> dist.TCPStore:
    """Connect to the control store at ``"host:port"``; the client retries until ``timeout_s``.
    ``give_up``: asked every ``GIVE_UP_POLL_S`` meanwhile; a message from it ends the wait
    at once (the app is gone, the message says why). The client runs in a thread of its
    own because a port held by a program that is not a store accepts the connection and
    never answers: TCPStore then waits past its own timeout."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"control store address must be 'host:port', got {addr!r}")
    host = host.strip("[]")  # "[::1]:29500"
    t0 = time.monotonic()
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            outcome["store"] = dist.TCPStore(host, int(port), None, is_master=False,
                                             timeout=datetime.timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError, OSError) as e:
            outcome["error"] = e

    client = threading.Thread(target=attempt, daemon=True, name="store-connect")
    client.start()
    while client.is_alive() and time.monotonic() - t0 < timeout_s + GIVE_UP_POLL_S:
        client.join(GIVE_UP_POLL_S)
        if client.is_alive() and give_up is not None and (reason := give_up()):
            raise AppGone(reason)
    if "store" in outcome:
        return outcome["store"]
    raise ConnectionError(
        f"could not reach the llamarl control store at {host}:{port} after "
        f"{time.monotonic() - t0:.0f} s (timeout {timeout_s:g} s): trainer replica 0, which hosts "
        f"it, has not started, has already exited (its log says why), uses another port "
        f"(--store_port), or the port belongs to another program; {outcome.get('error', 'no answer')}") from None


def _sleep_or_stop(delay_s: float, should_stop: Callable[[], bool] | None, what: str) -> None:
    if should_stop is not None and should_stop():
        raise Stopped(f"stopped while waiting for {what}")
    time.sleep(delay_s)


class Backoff:
    """Poll delays: quick first checks for latency, then longer sleeps to spare the CPU."""

    def __init__(self, first_s: float = 0.0005, max_s: float = 0.01) -> None:
        self.delay_s, self.max_s = first_s, max_s

    def next(self) -> float:
        d = self.delay_s
        self.delay_s = min(self.delay_s * 2, self.max_s)
        return d


class StoreQueue:
    """A bounded FIFO of messages in the control store, shared by any number of processes.

    ``maxlen`` is a soft bound: producers check the length and then push, so with P
    producers racing the queue can hold up to ``maxlen + P - 1`` messages.
    """

    def __init__(self, store: dist.Store, name: str, secret: bytes, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"queue {name!r}: maxlen must be >= 1, got {maxlen}")
        check_secret(secret)
        self.store, self.name, self.secret, self.maxlen = store, name, secret, maxlen
        self.key = names.queue_key(name)

    def depth(self) -> int:
        return int(self.store.queue_len(self.key))

    def push(self, msg: dict[str, Any], timeout_s: float,
             should_stop: Callable[[], bool] | None = None) -> None:
        """Append ``msg``; waits while the queue is full, ``TimeoutError`` after ``timeout_s``."""
        frame = encode(msg, self.secret)
        if len(frame) > MAX_FRAME_BYTES:
            raise ValueError(f"queue {self.name!r}: a {len(frame)}-byte message exceeds the "
                             f"control store's limit of {MAX_FRAME_BYTES} bytes per value")
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while (depth := self.depth()) >= self.maxlen:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"queue {self.name!r} stayed full ({depth} of maxlen {self.maxlen} messages) "
                    f"for {timeout_s:g} s: its consumer is not keeping up or is gone")
            _sleep_or_stop(backoff.next(), should_stop, f"room in queue {self.name!r}")
        self.store.queue_push(self.key, frame)

    def pop(self, timeout_s: float, should_stop: Callable[[], bool] | None = None,
            on_reject: OnReject | None = None) -> dict[str, Any] | None:
        """The oldest message, or ``None`` if none arrived within ``timeout_s``."""
        got = self.pop_many(1, timeout_s, should_stop, on_reject)
        return got[0] if got else None

    def pop_many(self, max_n: int, timeout_s: float, should_stop: Callable[[], bool] | None = None,
                 on_reject: OnReject | None = None) -> list[dict[str, Any]]:
        """Wait up to ``timeout_s`` for one message, then take up to ``max_n`` without waiting.

        A frame that does not decode (a bad tag, a malformed frame) is handed to
        ``on_reject(reason, detail)`` and skipped; without ``on_reject`` it raises.
        """
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        out: list[dict[str, Any]] = []
        while len(out) < max_n:
            frame = self._try_pop()
            if frame is None:
                if out or time.monotonic() >= deadline:
                    return out
                _sleep_or_stop(backoff.next(), should_stop, f"a message on queue {self.name!r}")
                continue
            try:
                out.append(decode(frame, self.secret))
            except (AuthenticationError, ValueError) as e:
                if on_reject is None:
                    raise
                on_reject(BAD_TAG if isinstance(e, AuthenticationError) else MALFORMED_FRAME,
                          f"queue {self.name!r}: {e}")
        return out

    def _try_pop(self) -> bytes | None:
        try:
            return self.store.queue_pop(self.key, block=False)
        except dist.QueueEmptyError:
            return None


# --------------------------------------------------------------------------- control


def _split_list(raw: bytes) -> list[str]:
    return list(dict.fromkeys(m for m in raw.decode().split(";") if m))


class Control:
    """Policy version, stop flag, membership, heartbeats and failures in the control store.

    Heartbeats are counters, not timestamps: the observer (the trainer) times how long
    since it last saw each counter move with its own clock, so host clock skew does not
    matter. A dead peer shows up either as a stale heartbeat (``dead_members``) or as an
    explicit failure flag (``failures``), which ``mark_failed`` also turns into a stop.
    """

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (beat count, local time seen)

    def _get(self, key: str) -> bytes | None:
        # ``get`` blocks until the key exists, so ask first.
        return self.store.get(key) if self.store.check([key]) else None

    # policy version -----------------------------------------------------------------
    def set_version(self, version: int) -> None:
        self.store.set(names.VERSION_KEY, str(int(version)))

    def version(self) -> int:
        raw = self._get(names.VERSION_KEY)
        return int(raw) if raw is not None else 0

    # stop ---------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask every role to stop; the first reason given wins."""
        self.store.compare_set(names.STOP_KEY, "", reason or "stop requested")

    def stop_reason(self) -> str | None:
        raw = self._get(names.STOP_KEY)
        return raw.decode() if raw is not None else None

    def stopped(self) -> bool:
        """For ``should_stop=`` arguments: one store round trip."""
        return self.store.check([names.STOP_KEY])

    # membership and health ------------------------------------------------------------
    def register(self, role: str, replica: int) -> None:
        member = names.member(role, replica)
        self.store.add(names.heartbeat_key(member), 1)
        self.store.append(names.MEMBERS_KEY, member + ";")

    def members(self) -> list[str]:
        raw = self._get(names.MEMBERS_KEY)
        return _split_list(raw) if raw is not None else []

    def wait_for_members(self, expected: dict[str, int], timeout_s: float,
                         should_stop: Callable[[], bool] | None = None,
                         health: Callable[[], None] | None = None) -> list[str]:
        """Wait until replicas ``0..n-1`` of each role in ``expected`` have registered;
        ``health()`` (which raises when a member failed or went silent) is called about
        every ``HEALTH_CHECK_S`` meanwhile."""
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(first_s=0.005, max_s=0.1)
        next_check = time.monotonic()
        while True:
            if health is not None and time.monotonic() >= next_check:
                health()
                next_check = time.monotonic() + HEALTH_CHECK_S
            present = set(self.members())
            missing = [names.member(role, r) for role, n in expected.items() for r in range(n)
                       if names.member(role, r) not in present]
            if not missing:
                return sorted(present)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"llamarl members missing after {timeout_s:g} s: {', '.join(missing)} "
                    f"(expected {expected}; registered: {', '.join(sorted(present)) or 'none'})")
            _sleep_or_stop(backoff.next(), should_stop, "members to register")

    def heartbeat(self, role: str, replica: int) -> None:
        self.store.add(names.heartbeat_key(names.member(role, replica)), 1)

    def last_heartbeats(self) -> dict[str, float]:
        """Seconds since this observer last saw each member's heartbeat move, by member."""
        members = self.members()
        if not members:
            return {}
        counts = self.store.multi_get([names.heartbeat_key(m) for m in members])
        now = time.monotonic()
        ages: dict[str, float] = {}
        for member, raw in zip(members, counts):
            count = int(raw)
            seen = self._seen.get(member)
            if seen is None or seen[0] != count:
                self._seen[member] = seen = (count, now)
            ages[member] = now - seen[1]
        return ages

    def dead_members(self, max_age_s: float) -> list[str]:
        """Members that failed explicitly or whose heartbeat has not moved for ``max_age_s``."""
        failed = set(self.failures())
        stale = {m for m, age in self.last_heartbeats().items() if age > max_age_s}
        return sorted(failed | stale)

    def mark_failed(self, role: str, replica: int, error: str) -> None:
        member = names.member(role, replica)
        self.store.set(names.failure_key(member), error[:4000])
        self.store.append(names.FAILED_KEY, member + ";")
        self.request_stop(f"{member} failed: {error[:500]}")

    def failures(self) -> dict[str, str]:
        raw = self._get(names.FAILED_KEY)
        if raw is None:
            return {}
        members = _split_list(raw)
        errors = self.store.multi_get([names.failure_key(m) for m in members])
        return {m: e.decode(errors="replace") for m, e in zip(members, errors)}

    # executors taken out of the run (app.membership) ----------------------------------
    def mark_gone(self, member: str) -> None:
        """``member`` is lost and the run goes on without it (the controller decided)."""
        self.store.append(names.GONE_KEY, member + ";")

    def gone(self) -> set[str]:
        """Members the controller took out of the run: their silence is no failure. One
        that came back (a restart) is alive again: its heartbeat moves."""
        raw = self._get(names.GONE_KEY)
        return set(_split_list(raw)) if raw is not None else set()
