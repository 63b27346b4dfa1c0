"""The control plane against someone without the app's secret, on a real app launched
through TorchX's runner on local_cwd (``app_launch``): forged control writes change
nothing and are counted, the run finishes all its steps; a user's signed stop ends it
early and non-zero; the store answers on loopback only; the secret is nowhere a user
other than the run's owner could read it.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from torchx.specs import AppState

from llamarl.app import names
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import connect_store
from app_launch import APP_TIMEOUT_S, App, launch, rows
from test_signed_control import non_loopback_address, reachable

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 40
"""Enough for the run to go on for seconds after the forged writes (a step of the tiny
policy can take 0.05 s): the controller finds an overwritten record it published at its
next heartbeat, up to a second later."""


def forge_control_writes(app: App) -> None:
    """What anyone who reaches the store's port can do without the secret: a stop (bare,
    and signed with another secret), a failure, membership (a member appended, one marked
    gone), the policy version, the slot counters, a lost slot, the weight plane's epoch,
    roster, sync announcements, presence and layout document, and the published config."""
    store = connect_store(f"127.0.0.1:{app.store_port}", timeout_s=30)
    outsider = SignedStore(store, bytes(32), "trainer/0")
    store.set(names.STOP_KEY, b"stop")
    store.set(names.STOP_KEY, outsider.seal(names.STOP_KEY, {"reason": "forged", "finished": True}))
    store.set(names.failure_key("generator/0"), b"forged failure")
    store.append(names.FAILED_KEY, ";generator/0;")
    store.append(names.MEMBERS_KEY, ";generator/9;")
    store.set(names.gone_key("generator/1"), b"gone")
    store.append(names.GONE_KEY, ";generator/1;")
    store.set(names.VERSION_KEY, b"1000")
    store.set(names.RESERVED_KEY, b"1000000")  # every slot taken: the generators would stall
    store.set(names.dropped_key("trainer/0"), b"1000000")  # or run far past the staleness bound
    store.queue_push(names.queue_key(names.LOST_SLOTS), b"3")
    store.set(f"{names.WEIGHT_PLANE_PREFIX}/{names.WEIGHT_EPOCH_KEY}", b"99")
    store.set(f"{names.WEIGHT_PLANE_PREFIX}/{names.weight_roster_key(2)}", b"[0]")  # "leave your group"
    # Inside the weight group: the next syncs' announcements (a generator would enter a
    # collective the trainer has not started), and a next epoch's presence and layout.
    group = names.weight_epoch_prefix(1, 0)
    for sync in range(1, STEPS + 20):
        store.set(f"{group}/{names.weight_sync_announce_key(sync)}", str(sync).encode())
    store.set(f"{names.weight_epoch_prefix(2, 0)}/{names.weight_rank_present_key(0)}", b"cuda:0")
    store.set(f"{names.weight_epoch_prefix(2, 0)}/{names.weight_layout_key(1, 0)}", b'{"params": []}')
    store.set(names.CONFIG_KEY, b'{"trainer": {}}')


def security_counts(db: sqlite3.Connection) -> dict[str, float]:
    """The rejected writes each process counted, summed over processes (last value each)."""
    per_process = rows(db, f"SELECT name, role, replica, max(value) FROM scalars WHERE name LIKE "
                           f"'{names.REJECTED_WRITES_PREFIX}%' GROUP BY name, role, replica")
    totals: dict[str, float] = {}
    for name, _, _, value in per_process:
        totals[name] = totals.get(name, 0.0) + value
    return totals


def test_forged_control_writes_change_nothing_and_are_counted(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=2) as app:
        app.wait_for_log("trainer", f"step 1/{STEPS}", timeout_s=APP_TIMEOUT_S)
        # Local: every role is on this host, so the store listens on loopback only.
        address = non_loopback_address()
        assert reachable("127.0.0.1", app.store_port)
        if address is not None:
            assert not reachable(address, app.store_port), f"the store answers on {address}"
        secret = app.secret().hex()
        command_lines = subprocess.run(["pgrep", "-af", app.app_id], capture_output=True, text=True).stdout
        assert app.app_id in command_lines and secret not in command_lines, "ps shows every command line"
        forge_control_writes(app)
        state = app.wait()
        assert state == AppState.SUCCEEDED, app.logs_tail()
        assert f"run finished: finished {STEPS} steps" in app.log("trainer")
        db = app.db()
        assert rows(db, "SELECT max(step) FROM scalars WHERE role = 'trainer'") == [(STEPS,)]
        counted = security_counts(db)
        for kind in ("stop", "failure", "membership", "version", "slots", "lost_slots", "weights", "config"):
            assert counted.get(names.rejected_write_metric(kind), 0) >= 1, (kind, counted)
        assert "ignored a write to control key 'llamarl/stop'" in app.log("generator", 0)
        assert f"ignored a write to control key '{names.weight_epoch_prefix(1, 0)}/syncs/" in app.log("generator", 0)
        # The secret is nowhere else: not in a log, the run's config or its metrics.
        run_dir = app.runs_dir / app.app_id
        texts = {p: p.read_text(errors="replace") for p in [*run_dir.glob("logs/*.log"), run_dir / "config.json"]}
        texts.update({p: p.read_text(errors="replace") for p in app.log_dir.glob("**/*.log")})
        assert len(texts) > 3
        for path, text in texts.items():
            assert secret not in text, path
        dump = "\n".join(db.iterdump())
        assert secret not in dump and secret.encode() not in (run_dir / "metrics.db").read_bytes()


def test_a_user_stop_ends_the_run_early_and_not_as_finished(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=10_000, num_generators=1) as app:
        app.wait_for_log("trainer", "step 1/10000", timeout_s=APP_TIMEOUT_S)
        stop = subprocess.run(
            [sys.executable, "-m", "llamarl.app.roles.stop", "--store-addr", f"localhost:{app.store_port}",
             "--app-id", app.app_id, "--reason", "enough", "--secret-file", str(app.secret_file)],
            capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert app.wait() == AppState.FAILED, app.logs_tail()
        status = app.runner.status(app.handle)
        assert "stopped by " in status.structured_error_msg and ": enough" in status.structured_error_msg
        for role in ("trainer", "generator"):
            tail = [line for line in app.log(role).splitlines() if line.strip()][-3:]
            assert any("stopped by " in line for line in tail), (role, app.logs_tail())
        assert rows(app.db(), "SELECT count(*) FROM meta WHERE key = 'finished_at'") == [(0,)]
