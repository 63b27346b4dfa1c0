"""What every executor of the distributed app does around its own work: reach the
control store, register, beat its heart, report metrics, fail loudly and exit cleanly.

Entry points stay thin: ``with Runtime.join(...) as rt: work(rt)``. On an exception the
runtime marks the role failed (which asks every other role to stop, naming it) and
re-raises, so the process exits non-zero; on a stop requested by someone else the work
loop raises ``Stopped`` and the role acknowledges, then exits 0 if the controller ended a
run that did all its steps, non-zero otherwise (a user's stop, a failure). Every control
value it reads or writes is a signed record (``llamarl.app.control.signed``).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import threading
import time
import traceback
import typing
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from llamarl.app import cli
from llamarl.app import errors
from llamarl.app import devices
from llamarl.app.control import frames
from llamarl.app.control import health
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.control import transport
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.control.signed import CONTROLLER, SignedStore, WriteRejections
from llamarl.app.control.transport import Control, StoreQueue

log = logging.getLogger("llamarl")

METRICS_PER_MESSAGE = 256
"""Events per metrics message: a few tens of kB, far below the frame limit."""

# Queue sizes. Bounds keep memory flat whatever the relative speeds.
METRICS_MAXLEN = 4096
GROUPS_MAXLEN = 256  # rollout groups per queue; the staleness budget usually binds first
HEARTBEAT_S = 1.0
STOP_CHECK_S = 0.05  # how stale a "keep going" answer of should_stop may be
APP_ID_TIMEOUT_S = 10.0  # the trainer publishes the app id right after hosting the store
STOP_ACK_TIMEOUT_S = 60.0  # trainer replica 0 keeps the store up this long for roles to read the stop


def role_arguments(role: str, description: str, prog: str) -> argparse.ArgumentParser:
    """The flags every non-trainer role takes: where the store is and who it is."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--store-addr", required=True,
                        help="host:port of the control store (trainer replica 0); port 0: derived from --app-id")
    parser.add_argument("--app-id", default="",
                        help="the app this role belongs to: a control store of another app is refused")
    parser.add_argument("--replica", type=int, required=True, help=f"this {role}'s index, 0-based")
    parser.add_argument("--connect-timeout-s", type=float, default=300.0, help="wait for the control store")
    parser.add_argument("--config-timeout-s", type=float, default=900.0,
                        help="wait for the trainer's config (it may be warm-starting the policy)")
    parser.add_argument("--device", choices=typing.get_args(devices.DeviceChoice), default="auto",
                        help=f"where this {role} computes (llamarl.app.devices): 'auto' is cuda:0 of the GPUs it sees "
                             "when CUDA is available, else the CPU; 'cpu' forces the CPU (the TorchX component "
                             "passes it to a role given no GPU); 'cuda' requires a GPU")
    cli.add_secret_argument(parser)
    return parser


def join_role(role: str, args: argparse.Namespace) -> "Runtime":
    """Log as ``role/replica``, reach the control store of this app and register there."""
    setup_logging(role, args.replica)
    host, sep, port = args.store_addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"control store address must be 'host:port', got {args.store_addr!r}")
    addr = f"{host}:{names.store_port(int(port), args.app_id)}"
    secret = frames.read_secret(args.secret_file)
    store = connect_app_store(addr, args.app_id, args.connect_timeout_s)
    return Runtime.join(role, args.replica, store, secret)


def host_app_store(port: int, app_id: str, bind: str = "127.0.0.1") -> dist.TCPStore:
    """Trainer replica 0: host the control store, listening on ``bind`` only, and publish
    the app id on it, first thing, so that every role can be told why the run ends,
    whatever goes wrong next. The app id is plain text: it tells a role that reached
    another app's store (whose records it cannot read) which app that is; the controller
    writes it again if anyone changes it (``Runtime``'s heartbeat thread)."""
    try:
        store = transport.host_store(port, bind=bind)
    except (dist.DistError, RuntimeError, OSError) as e:
        # A refusal (one line, no traceback): the port or the address is the user's to change.
        raise errors.ConfigError(
            f"cannot host the control store on port {port} ({bind}): {e}. Another app or process uses "
            "the port (give this app another --store_port, or leave it 0: derived from the app id), "
            "or --store_bind names no address of this host") from None
    store.set(names.APP_ID_KEY, app_id)
    return store


def connect_app_store(addr: str, app_id: str, timeout_s: float,
                      check_timeout_s: float = APP_ID_TIMEOUT_S) -> dist.TCPStore:
    """Reach the control store at ``addr`` and check that it is this app's: another app's
    store (two apps on one port) is refused before this role registers there."""
    try:
        store = transport.connect_store(addr, timeout_s, give_up=health.sibling_failure, app_id=app_id,
                                        say=log.warning)
    except transport.AppGone as e:  # a bystander: the failed role's cause is the app's
        log.error("stopping: %s", e)
        raise SystemExit(f"stopping: {e}") from None
    if not app_id:  # started by hand, without --app-id: nothing to check against
        return store
    deadline = time.monotonic() + check_timeout_s
    theirs = None
    # Until the deadline: a value someone else wrote is put right by the controller.
    while theirs != app_id:
        if time.monotonic() > deadline:
            break
        if store.check([names.APP_ID_KEY]):
            theirs = store.get(names.APP_ID_KEY).decode(errors="replace")
        if theirs != app_id:
            time.sleep(0.05)
    if theirs is None:
        raise ConnectionError(f"the store at {addr} publishes no llamarl app id after "
                              f"{check_timeout_s:g} s: it is not this app's control store")
    if theirs != app_id:
        raise ConnectionError(
            f"the control store at {addr} belongs to app {theirs!r}, not to this app ({app_id!r}): "
            "two apps use one store port; give each its own --store_port, or leave it 0 "
            "(derived from the app id)")
    return store


def log_to_run_dir(run_dir: str, role: str, replica: int) -> None:
    """Also write this process's log to ``<run_dir>/logs/<role>-<replica>.log``. A role
    on another host without the run directory's file system keeps its scheduler log only."""
    try:
        path = Path(run_dir) / "logs" / f"{role}-{replica}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as e:
        log.warning("not logging to the run directory %s: %s", run_dir, e)
        return
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)


def setup_logging(role: str, replica: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"%(asctime)s {role}/{replica} %(levelname)s %(message)s")


@dataclass
class Runtime:
    role: str
    replica: int
    store: dist.TCPStore
    control: Control
    secret: bytes
    _beating: threading.Event = field(default_factory=threading.Event)
    _pending_metrics: list[dict[str, Any]] = field(default_factory=list)
    _batch_stream: int = field(default_factory=lambda: secrets.randbits(62))  # this process's batches
    _batches_sent: int = 0
    _heart: threading.Thread | None = None
    _stop_seen: tuple[float, bool] = (float("-inf"), False)  # (monotonic time, stopped)
    failure_logged: bool = False
    """Set by a role that logged its own failure before ending (the trainer, at once):
    the exit then reports it without logging it a second time."""

    @classmethod
    def join(cls, role: str, replica: int, store: dist.TCPStore, secret: bytes) -> "Runtime":
        me = names.member(role, replica)
        signed = SignedStore(store, secret, me, WriteRejections(me))
        rt = cls(role=role, replica=replica, store=store, control=Control(signed), secret=secret)
        if me == CONTROLLER:  # the app id it published: written again if anyone changes it
            signed.keep_plain(names.APP_ID_KEY)
        rt.control.register(role, replica)
        rt._heart = threading.Thread(target=rt._heartbeat_loop, daemon=True, name="heartbeat")
        rt._heart.start()
        return rt

    def queue(self, name: str) -> StoreQueue:
        maxlen = METRICS_MAXLEN if name == names.METRICS else GROUPS_MAXLEN
        return StoreQueue(self.store, name, self.secret, maxlen)

    @property
    def signed(self) -> SignedStore:
        return self.control.signed

    def security_metrics(self) -> dict[str, float]:
        """Control-store writes this process ignored, by kind (``security/rejected_writes/*``)."""
        return self.signed.rejections.metrics()

    def _heartbeat_loop(self) -> None:
        # Its own connection: a beat never waits behind the work loop's store calls.
        control = Control(self.signed.clone())
        while not self._beating.wait(HEARTBEAT_S):
            try:
                control.heartbeat(self.role, self.replica)
                control.signed.reassert()  # the controller's published records, if overwritten
            except Exception:  # the store is gone: the work loop will find out and stop
                return

    def should_stop(self) -> bool:
        """Whether the run is ending: a store round trip at most every ``STOP_CHECK_S``
        (every poll loop of every thread asks; the answer is cached in between)."""
        checked_at, stopped = self._stop_seen
        if stopped or time.monotonic() - checked_at < STOP_CHECK_S:
            return stopped
        stopped = self.control.stopped()
        self._stop_seen = (time.monotonic(), stopped)  # one tuple: safe across threads
        return stopped

    def wait_key(self, key: str, timeout_s: float, what: str) -> Any:
        """The value of the controller's signed record at ``key`` once it is there;
        ``TimeoutError`` naming ``what`` after ``timeout_s``, ``Stopped`` once the run is
        stopping."""
        return self.signed.wait(key, timeout_s, f"{what} from the trainer", writers=(CONTROLLER,),
                                should_stop=self.should_stop)

    def emit(self, events: list[dict[str, Any]], *, flush: bool = False) -> None:
        """Queue metric events for trainer replica 0 (sent in batches)."""
        self._pending_metrics.extend(events)
        if flush or len(self._pending_metrics) >= METRICS_PER_MESSAGE:
            self.flush_metrics()

    def take_metrics(self) -> list[dict[str, Any]]:
        """The events emitted here and not yet sent (for the writer's own process)."""
        batch, self._pending_metrics = self._pending_metrics, []
        return batch

    def flush_metrics(self) -> None:
        """Send the pending events in messages of at most ``METRICS_PER_MESSAGE``: however
        many a loop emitted at once, no message outgrows the frame limit (one that did
        would end the role)."""
        if not self._pending_metrics:
            return
        pending, self._pending_metrics = self._pending_metrics, []
        # Every role reads the config before it has anything to report.
        config = self.signed.last(names.CONFIG_KEY)
        attempt = config.value.get("attempt", "") if config is not None and isinstance(config.value, dict) else ""
        for start in range(0, len(pending), METRICS_PER_MESSAGE):
            msg = metrics.batch_message(pending[start:start + METRICS_PER_MESSAGE],
                                        sender=names.member(self.role, self.replica),
                                        stream=self._batch_stream, seq=self._batches_sent, attempt=str(attempt))
            self._batches_sent += 1
            self.queue(names.METRICS).push(msg, timeout_s=30.0, should_stop=None)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        store_gone = exc_type is not None and not self._store_alive()
        if exc_type is not None and not issubclass(exc_type, transport.Stopped) and not store_gone:
            error = "".join(traceback.format_exception_only(exc_type, exc)).strip()
            if not self.failure_logged:
                log.error("failed: %s", error)
            try:
                self.control.mark_failed(self.role, self.replica, error)
            except Exception:
                log.error("could not report the failure to the control store (gone)")
        elif exc_type is None:
            try:
                self.flush_metrics()
            except Exception as e:
                log.warning("could not flush metrics: %s", e)
        self._beating.set()
        # Joined, not abandoned: a thread frozen inside a store call while the interpreter
        # tears the store down aborts the process.
        self._heart.join(timeout=10.0)
        try:
            self.control.mark_exited(self.role, self.replica)
        except Exception:
            pass
        if store_gone:
            # The cause is the store's host, not this role's "Connection reset by peer".
            log.error("%s", exc)
            raise SystemExit(f"stopping: the control store is gone: trainer/0, which hosts it, has "
                             f"exited (its log says why); here: {exc_type.__name__}")
        if exc_type is not None and issubclass(exc_type, transport.Stopped):
            reason = self.control.stop_reason() or str(exc)
            if self.control.failures() or not self.control.stop_finished():
                # Another member failed, or the run was stopped before its last step (a
                # user's stop): this role ends non-zero too, naming the cause (in its log
                # file too, and as the process's last line). Only the controller's
                # "finished" is a clean exit.
                log.error("stopping: %s", reason)
                raise SystemExit(f"stopping: {reason}")
            log.info("stopping: %s", reason)
            return True
        return False

    def _store_alive(self) -> bool:
        try:
            self.control.stopped()
            return True
        except Exception:
            return False


def publish_config(store: SignedStore, trainer: TrainerConfig, gen: GeneratorConfig, *,
                   policy_path: str, run_dir: str) -> None:
    """Trainer replica 0: the run's configs, for every other role to read (``read_config``),
    so that no role can disagree with the trainer about a knob; and this attempt's token,
    drawn afresh at every start, fresh or resumed (``run_attempt``)."""
    store.put(names.CONFIG_KEY, {"trainer": cli.to_dict(trainer), "generator": cli.to_dict(gen),
                                 "run_dir": run_dir, "attempt": secrets.token_hex(16)}, keep=True)
    store.put(names.POLICY_KEY, policy_path, keep=True)


def read_config(rt: Runtime, timeout_s: float) -> tuple[TrainerConfig, GeneratorConfig, str]:
    """The trainer's configs and policy path; from then on this role also logs to
    ``<run_dir>/logs/<role>-<replica>.log`` (when the run directory is reachable here)."""
    raw = rt.wait_key(names.CONFIG_KEY, timeout_s, "run config")
    policy = rt.wait_key(names.POLICY_KEY, timeout_s, "policy path")
    log_to_run_dir(raw["run_dir"], rt.role, rt.replica)
    return TrainerConfig(**raw["trainer"]), GeneratorConfig(**raw["generator"]), policy


def run_attempt(rt: Runtime, timeout_s: float = 60.0) -> str:
    """This run attempt's token (``publish_config``): generator processes register their
    incarnations under it, and readers take groups only from those (``llamarl.app.control.incarnations``)."""
    return str(rt.wait_key(names.CONFIG_KEY, timeout_s, "run config")["attempt"])


def wait_for_exits(control: Control, members: list[str], timeout_s: float) -> list[str]:
    """Trainer replica 0 keeps the store up until every other member has acknowledged the
    stop (or the timeout passes); returns the members that never did."""
    deadline = time.monotonic() + timeout_s
    missing = list(members)
    while missing and time.monotonic() < deadline:
        missing = [m for m in missing if not control.exited(m)]
        time.sleep(0.05)
    return missing


def end_app(rt: Runtime, expected: list[str], reason: str, *, failed: bool) -> None:
    """Trainer replica 0: ask every role to stop (a failure names its cause), then keep the
    store up until each has acknowledged, has gone silent, or ``STOP_ACK_TIMEOUT_S`` passed.
    ``expected``: every member of the app, registered or not yet: one that starts after a
    failure at start-up must still find the store up and read why, instead of waiting
    minutes to connect to a store that is gone."""
    if failed:
        rt.control.mark_failed(rt.role, rt.replica, reason)
    else:
        rt.control.request_stop(reason, finished=True)
    me = names.member(rt.role, rt.replica)
    missing = sorted(set(expected + rt.control.members()) - {me})
    deadline = time.monotonic() + STOP_ACK_TIMEOUT_S
    while missing and time.monotonic() < deadline:
        missing = wait_for_exits(rt.control, missing, timeout_s=1.0)
        # A killed process never acknowledges: stop waiting once its heartbeat is still, or,
        # killed before it registered, once the lock it held is free (llamarl.app.control.replica_lock).
        dead = [m for m in rt.control.dead_members(max_age_s=health.HEARTBEAT_TIMEOUT_S) if m in missing]
        dead += [m for m in health.vanished_before_registering(set(rt.control.members()))
                 if m in missing and m not in dead]
        if dead:
            log.error("%s: no heartbeat and no stop acknowledged: the process is gone", ", ".join(dead))
            missing = [m for m in missing if m not in dead]
    if missing:
        log.warning("roles that did not acknowledge the stop within %g s: %s", STOP_ACK_TIMEOUT_S,
                    ", ".join(missing))
