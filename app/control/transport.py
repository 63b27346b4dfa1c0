"""Control and data plane: bounded queues and control keys over the control store.

Everything here rides on the one ``torch.distributed.TCPStore`` hosted by trainer
replica 0 (see docs/architecture.md, "Planes"), and every message is an authenticated
frame of ``llamarl.app.control.frames``:

- ``StoreQueue``: a FIFO over the store's ``queue_push``/``queue_pop`` with backpressure
  (``push`` waits while the queue holds ``maxlen`` messages) and waits that always end:
  by a timeout, or by ``should_stop`` becoming true. A frame that does not decode is
  dropped and reported, never fatal.
- ``Control``: the policy version, the stop flag, membership, heartbeats and failure
  flags, under the key names of ``llamarl.app.names``.

Why no blocking ``queue_pop``: the store's blocking pop uses the connection's timeout,
logs a warning on every expiry and cannot be interrupted, so waits here poll the
non-blocking calls with short, growing sleeps.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from llamarl.app import names
from llamarl.app.control.frames import MAX_FRAME_BYTES, AuthenticationError, check_secret, decode, encode
from llamarl.app.control.signed import CONTROLLER, Record, SignedStore

__all__ = ["BAD_TAG", "EVERY_INTERFACE", "MALFORMED_FRAME", "AppGone", "Backoff", "Control", "OnReject",
           "StoreQueue", "Stopped", "connect_store", "host_store", "store_client_host"]

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


EVERY_INTERFACE = "0.0.0.0"
"""``--store-bind`` value for torch's own listener, on every interface of the host
(the behaviour before binding: needs a network nobody else reaches)."""


RESOLVE_TIMEOUT_S = 60.0
"""How long the controller retries resolving ``--store-bind``: a pod's own DNS name
(Kubernetes) may appear a little after the pod starts."""


def host_store(port: int, world_size: int | None = None, timeout_s: float = 300.0,
               bind: str = "127.0.0.1", resolve_timeout_s: float = RESOLVE_TIMEOUT_S) -> dist.TCPStore:
    """Host the control store (trainer replica 0), listening on ``bind`` only: an address
    or a host name (its first IPv4 address, else its first), or ``EVERY_INTERFACE``.
    ``port=0`` picks a free port: read ``.port``.

    Why a socket of our own: torch's TCPStore server ignores its host argument and listens
    on every interface (libuv backend, torch 2.13: measured in tests/test_signed_control.py);
    it takes an already bound socket as ``master_listen_fd``, which then is the only one.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if _every_interface(bind):
        return dist.TCPStore(EVERY_INTERFACE, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    sock = _listening_socket(bind, port, resolve_timeout_s)
    address, bound_port = sock.getsockname()[:2]
    fd = sock.detach()  # the store's server owns the socket from here
    try:
        return dist.TCPStore(address, bound_port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _listening_socket(bind: str, port: int, resolve_timeout_s: float = RESOLVE_TIMEOUT_S) -> socket.socket:
    deadline = time.monotonic() + resolve_timeout_s
    while True:
        try:
            infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
            break
        except socket.gaierror as e:
            if e.errno == socket.EAI_NONAME and time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            raise OSError(f"--store-bind {bind!r} does not resolve on this host ({e.strerror}); "
                          f"name an address of this host, or 0.0.0.0 for every interface") from None
    family, _, _, _, sockaddr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def store_client_host(bind: str, host: str = "") -> str:
    """Where trainer ranks > 0 reach the store: at ``host`` (trainer replica 0's host, for
    ranks on other nodes), or, when that is empty or a loopback name (ranks on replica 0's
    own node, which may see its name as ``localhost``), where it listens."""
    if host and host != "localhost" and not host.startswith(("127.", "::1", "[::1]")):
        return host
    return "127.0.0.1" if _every_interface(bind) else bind


def _every_interface(bind: str) -> bool:
    return bind in (EVERY_INTERFACE, "::", "*")


GIVE_UP_POLL_S = 0.5
"""While a role waits for the store, how often ``give_up`` is asked whether the app is
already known to be gone (its trainer failed before it could host the store)."""


FIRST_WAIT_NOTE_S = 5.0
CLIENT_END_GRACE_S = 5.0
WAIT_NOTE_EVERY_S = 30.0


def connect_store(addr: str, timeout_s: float = 300.0,
                  give_up: Callable[[], str | None] | None = None, *, app_id: str = "",
                  say: Callable[[str], None] | None = None) -> dist.TCPStore:
    """Connect to the control store at ``"host:port"``; the client retries until ``timeout_s``.
    ``give_up``: asked every ``GIVE_UP_POLL_S`` meanwhile; a message from it ends the wait
    at once (the app is gone, the message says why). ``say``: told what this waits for and
    where after ``FIRST_WAIT_NOTE_S``, then every ``WAIT_NOTE_EVERY_S`` (a role started
    alone, or before its trainer, says so instead of staying silent for minutes). The client runs in a thread of its
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
    next_note = t0 + FIRST_WAIT_NOTE_S
    while client.is_alive() and time.monotonic() - t0 < timeout_s + GIVE_UP_POLL_S:
        client.join(GIVE_UP_POLL_S)
        if client.is_alive() and give_up is not None and (reason := give_up()):
            raise AppGone(reason)
        if client.is_alive() and say is not None and time.monotonic() >= next_note:
            waited = time.monotonic() - t0
            say(f"waiting {waited:.0f} s for the control store at {host}:{port}"
                + (f" of app {app_id}" if app_id else "")
                + f" (trainer replica 0 hosts it; giving up after {timeout_s:g} s)")
            next_note += WAIT_NOTE_EVERY_S
    # The client gives up at its own timeout, about now: an interpreter that exits while it
    # is still inside TCPStore's C++ can abort (SIGABRT) instead of printing the error below.
    client.join(CLIENT_END_GRACE_S)
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


class Control:
    """Policy version, stop flag, membership, heartbeats and failures in the control store,
    every one a signed record (``llamarl.app.control.signed``): a value that is not this app's is ignored.

    Heartbeats are records each member rewrites every second; the observer (the trainer)
    times how long since it last saw a member's record counter move, with its own clock,
    so host clock skew does not matter. A dead peer shows up either as a stale heartbeat
    (``dead_members``) or as an explicit failure record (``failures``), which
    ``mark_failed`` also turns into a stop.
    """

    def __init__(self, signed: SignedStore) -> None:
        self.signed, self.store = signed, signed.store
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (record counter, local time seen)

    # policy version -----------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The controller's policy version (kept: published again if someone overwrites it)."""
        self.signed.put(names.VERSION_KEY, int(version), keep=True)

    def version(self) -> int:
        value = self.signed.get(names.VERSION_KEY, writers=(CONTROLLER,), default=0)
        return value if isinstance(value, int) else 0

    # stop ---------------------------------------------------------------------------
    def request_stop(self, reason: str, *, finished: bool = False) -> None:
        """Ask every role to stop; the first authentic reason stays. ``finished``: the
        controller ends a run that did all its steps (the only stop the roles exit 0 on)."""
        if self._stop() is None:
            # Kept: written again by this process if someone overwrites it, for the roles
            # that have not read it yet.
            self.signed.put(names.STOP_KEY, {"reason": reason or "stop requested", "finished": finished},
                            keep=True)

    def _stop(self) -> dict | None:
        value = self.signed.get(names.STOP_KEY, writers=_may_stop)
        return value if isinstance(value, dict) and isinstance(value.get("reason"), str) else None

    def stop_reason(self) -> str | None:
        stop = self._stop()
        return stop["reason"] if stop is not None else None

    def stop_finished(self) -> bool:
        """Whether the stop is the controller's "every step done" (not a user's, not a failure's)."""
        rec = self.signed.record(names.STOP_KEY, writers=_may_stop)
        return (rec is not None and rec.writer == CONTROLLER and isinstance(rec.value, dict)
                and rec.value.get("finished") is True)

    def stopped(self) -> bool:
        """For ``should_stop=`` arguments: one store round trip while nothing changed."""
        return self._stop() is not None

    # membership and health ------------------------------------------------------------
    def register(self, role: str, replica: int) -> None:
        member = names.member(role, replica)
        self.signed.put(names.heartbeat_key(member), {})  # first: the name then has its record
        self.signed.add_name(names.MEMBERS_KEY, member)

    def _heartbeats(self) -> dict[str, Record]:
        return self.signed.named_records(names.MEMBERS_KEY, names.heartbeat_key, lambda m: (m,))

    def members(self) -> list[str]:
        return sorted(self._heartbeats())

    def wait_for_members(self, expected: dict[str, int], timeout_s: float,
                         should_stop: Callable[[], bool] | None = None,
                         health: Callable[[], None] | None = None) -> list[str]:
        """Wait until replicas ``0..n-1`` of each role in ``expected`` have registered or
        been taken out of the run (``gone``: lost while others of their role survive);
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
            missing = [m for role, n in expected.items() for r in range(n)
                       if (m := names.member(role, r)) not in present]
            if missing:
                gone = self.gone()
                missing = [m for m in missing if m not in gone]
            if not missing:
                return sorted(present)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"llamarl members missing after {timeout_s:g} s: {', '.join(missing)} "
                    f"(expected {expected}; registered: {', '.join(sorted(present)) or 'none'})")
            _sleep_or_stop(backoff.next(), should_stop, "members to register")

    def heartbeat(self, role: str, replica: int) -> None:
        self.signed.put(names.heartbeat_key(names.member(role, replica)), {})

    def last_heartbeats(self) -> dict[str, float]:
        """Seconds since this observer last saw each member's heartbeat move, by member."""
        now = time.monotonic()
        ages: dict[str, float] = {}
        for member, rec in self._heartbeats().items():
            seen = self._seen.get(member)
            if seen is None or seen[0] != rec.n:
                self._seen[member] = seen = (rec.n, now)
            ages[member] = now - seen[1]
        return ages

    def dead_members(self, max_age_s: float) -> list[str]:
        """Members that failed explicitly or whose heartbeat has not moved for ``max_age_s``."""
        failed = set(self.failures())
        stale = {m for m, age in self.last_heartbeats().items() if age > max_age_s}
        return sorted(failed | stale)

    def mark_failed(self, role: str, replica: int, error: str) -> None:
        """``role/replica`` failed with ``error``: written by that member, or by the
        controller about a member it found lost."""
        member = names.member(role, replica)
        self.signed.put(names.failure_key(member), {"error": error[:4000]})
        self.signed.add_name(names.FAILED_KEY, member)
        self.request_stop(f"{member} failed: {error[:500]}")

    def failures(self) -> dict[str, str]:
        records = self.signed.named_records(names.FAILED_KEY, names.failure_key, _member_or_controller)
        return {m: str(rec.value.get("error", "")) if isinstance(rec.value, dict) else ""
                for m, rec in records.items()}

    # executors taken out of the run (llamarl.app.control.membership) ----------------------------------
    def mark_gone(self, member: str) -> None:
        """``member`` is lost and the run goes on without it (the controller decided)."""
        self.signed.put(names.gone_key(member), {})
        self.signed.add_name(names.GONE_KEY, member)

    def gone(self) -> set[str]:
        """Members the controller took out of the run: their silence is no failure. One
        that came back (a restart) is alive again: its heartbeat moves."""
        return set(self.signed.named_records(names.GONE_KEY, names.gone_key, lambda m: (CONTROLLER,)))

    # leaving ----------------------------------------------------------------------------
    def mark_exited(self, role: str, replica: int) -> None:
        """This member has read the stop and leaves (the controller waits for it)."""
        self.signed.put(names.exited_key(names.member(role, replica)), {})

    def exited(self, member: str) -> bool:
        return self.signed.record(names.exited_key(member), writers=(member,)) is not None


def _may_stop(writer: str) -> bool:
    """Any member of the app, or a user's ``python -m llamarl.app.roles.stop``."""
    return True


def _member_or_controller(member: str) -> tuple[str, ...]:
    return (member, CONTROLLER)
