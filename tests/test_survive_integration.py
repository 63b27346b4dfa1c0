"""Losing one of two generators is survivable: ``llamarl.llamarl`` through TorchX's
runner on local_cwd, generator 1 SIGKILLed mid-run. The run finishes every step, each
once, trains exactly the rollouts it should, and counts the groups it regenerated.
How fast it regroups is measured by ``benchmarks/faults.py``, not here."""

from __future__ import annotations

import re

import pytest
from torchx.specs import AppState

from llamarl.app import names
from app_launch import APP_TIMEOUT_S, GROUP_SIZE, PROMPTS_PER_STEP, SMALL, launch, rows
from test_failfast import app_processes, kill

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 60  # the kill (after step 4) always lands long before the last step


def assert_every_slot_trained_once(db, steps: int) -> None:
    """Steps 1..``steps`` trained a full batch each, none twice, with one exception: a
    group the dead executor passed on just before it died and its regenerated twin. The
    second to arrive is dropped and counted (``faults/duplicate_groups``); when it was in
    a batch, that step trains one group fewer (its slot is filled again later)."""
    trained = rows(db, f"SELECT COUNT(*) FROM staleness WHERE used = 1 AND step <= {steps}")[0][0]
    duplicates = rows(db, f"SELECT MAX(value) FROM scalars WHERE name = '{names.FAULTS_DUPLICATE_GROUPS}' "
                          f"AND step <= {steps}")[0][0] or 0
    expected = steps * PROMPTS_PER_STEP * GROUP_SIZE
    assert expected - int(duplicates) * GROUP_SIZE <= trained <= expected, (trained, expected, duplicates)


def test_a_killed_generator_is_survived_and_its_groups_regenerated(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=2,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", f"step 4/{STEPS}", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.generator .*--app-id {app.app_id} --replica 1")
        state = app.wait()
        trainer_log = app.log("trainer")
        # The killed replica exited non-zero, but the trainer finished the run: local_llamarl
        # calls the app SUCCEEDED and names the lost replica (torchx's own would say FAILED).
        assert state == AppState.SUCCEEDED, app.logs_tail()
        status = app.runner.status(app.handle)
        assert "lost on the way and survived: generator/1 (exit code -9)" in status.msg, status
        assert f"finished {STEPS} steps" in trainer_log, app.logs_tail()
        assert "generator/1 is gone" in trainer_log
        assert "weight plane epoch 2: generators [0]" in trainer_log
        db = app.db()
        steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
        assert steps == list(range(1, STEPS + 1))  # every step, once
        assert_every_slot_trained_once(db, STEPS)
        last = dict(rows(db, f"SELECT name, value FROM scalars WHERE step = {STEPS} AND name IN "
                             f"('{names.FAULTS_LOST_GROUPS}', '{names.members_metric('generator')}', "
                             f"'{names.WEIGHT_REGROUPS}')"))
        assert last[names.members_metric("generator")] == 1
        assert last[names.WEIGHT_REGROUPS] == 1
        lost = int(last[names.FAULTS_LOST_GROUPS])
        assert f"{lost} group(s) it held go back to be regenerated" in trainer_log
    assert not app_processes(app)


def test_a_killed_reward_executor_is_survived(tiny_policy, tmp_path):
    """The survivor scores everything from the loss on: a long run, watched until ten
    steps after the trainer took reward/1 out, then cancelled."""
    with launch(tiny_policy, tmp_path, steps=10_000, num_generators=1, num_reward=2,
                extra=[*SMALL, "--eval-every", "100000"]) as app:
        app.wait_for_log("trainer", "step 4/", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.reward .*--app-id {app.app_id} --replica 1")
        app.wait_for_log("trainer", "reward/1 is gone", timeout_s=APP_TIMEOUT_S)
        taken_out_at = max(int(n) for n in re.findall(r"step (\d+)/", app.log("trainer")))
        app.wait_for_log("trainer", f"step {taken_out_at + 10}/", timeout_s=APP_TIMEOUT_S)
        app.runner.cancel(app.handle)
        db = app.db()
        steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= taken_out_at + 10
        assert_every_slot_trained_once(db, len(steps))
        alive = rows(db, f"SELECT value FROM scalars WHERE step = {len(steps)} AND name = "
                         f"'{names.members_metric('reward')}'")
        assert alive == [(1.0,)]
