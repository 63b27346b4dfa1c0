"""A rollout message that never arrives does not stall a synchronous run:
``llamarl.llamarl`` through TorchX's runner on local_cwd (``app_launch``), one group's
message popped off the ``rollouts`` queue mid-run by another client of the store (as
any local user could). Its slot goes overdue after ``--slot-deadline-s`` of the
trainer's waiting, is regenerated, and the run finishes every step, each slot once."""

from __future__ import annotations

import time

import pytest
from torchx.specs import AppState

from llamarl.app import names
from llamarl.app.control import frames
from llamarl.app.control.transport import connect_store
from app_launch import APP_TIMEOUT_S, SMALL, launch, rows
from test_survive_integration import assert_every_slot_trained_once

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 12  # the theft (after step 1) always lands long before the last step
DEADLINE_S = 5


def steal_one_rollout(store, secret: bytes, timeout_s: float = APP_TIMEOUT_S) -> int:
    """Pop one real group's message off the ``rollouts`` queue (racing the trainer's
    pipeline) and keep it: the slot it fills."""
    key, deadline = names.queue_key(names.ROLLOUTS), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            frame = store.queue_pop(key, block=False)
        except Exception:  # empty: the trainer was quicker this time
            continue
        msg = frames.decode(frame, secret)
        assert msg["kind"] == "rollout_group", msg
        return msg["slot"]
    pytest.fail(f"no rollout message to take in {timeout_s:g} s")


def test_a_lost_rollout_message_is_regenerated_and_a_synchronous_run_finishes(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=1, max_staleness=0,
                extra=[*SMALL, "--eval-every", "1000", "--slot-deadline-s", str(DEADLINE_S)]) as app:
        app.wait_for_log("trainer", f"step 1/{STEPS}", timeout_s=APP_TIMEOUT_S)
        store = connect_store(f"127.0.0.1:{app.store_port}", timeout_s=30)
        slot = steal_one_rollout(store, app.secret())
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        trainer_log = app.log("trainer")
        assert f"run finished: finished {STEPS} steps" in trainer_log, app.logs_tail()
        assert f"slot(s) {slot} overdue" in trainer_log
        db = app.db()
        steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
        assert steps == list(range(1, STEPS + 1))  # every step, once
        assert_every_slot_trained_once(db, STEPS)
        faults = dict(rows(db, f"SELECT name, MAX(value) FROM scalars WHERE name IN "
                               f"('{names.FAULTS_OVERDUE_GROUPS}', '{names.FAULTS_DUPLICATE_GROUPS}') GROUP BY name"))
        # The stolen group only: the groups the trainer had received meanwhile were never overdue.
        assert faults == {names.FAULTS_OVERDUE_GROUPS: 1.0, names.FAULTS_DUPLICATE_GROUPS: 0.0}, faults
        # Synchronous: every group trained at the version it was made with, the regenerated one too.
        assert rows(db, "SELECT COUNT(*) FROM staleness WHERE used = 1 AND staleness != 0") == [(0,)]
