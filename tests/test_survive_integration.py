"""Losing one of two generators is survivable: ``llamarl.llamarl`` through TorchX's
runner on local_cwd, generator 1 SIGKILLed mid-run. The run finishes every step, each
once, trains exactly the rollouts it should, and counts the groups it regenerated.
How fast it regroups is measured by ``benchmarks/faults.py``, not here."""

from __future__ import annotations

import pytest
from torchx.specs import AppState

from app import names
from app_launch import APP_TIMEOUT_S, GROUP_SIZE, PROMPTS_PER_STEP, SMALL, launch, rows
from test_failfast import app_processes, kill

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 24


def test_a_killed_generator_is_survived_and_its_groups_regenerated(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=2,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", f"step 4/{STEPS}", timeout_s=APP_TIMEOUT_S)
        kill(app, f"app.generator .*--app-id {app.app_id} --replica 1")
        state = app.wait()
        trainer_log = app.log("trainer")
        # local_cwd has no replica retry, and the killed replica exited non-zero: TorchX
        # calls the app FAILED although the run finished (README, "When something fails").
        assert state in (AppState.SUCCEEDED, AppState.FAILED), app.logs_tail()
        assert f"finished {STEPS} steps" in trainer_log, app.logs_tail()
        assert "generator/1 is gone" in trainer_log
        assert "weight plane epoch 2: generators [0]" in trainer_log
        db = app.db()
        steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
        assert steps == list(range(1, STEPS + 1))  # every step, once
        trained = rows(db, "SELECT COUNT(*) FROM staleness WHERE used = 1")[0][0]
        assert trained == STEPS * PROMPTS_PER_STEP * GROUP_SIZE  # none lost, none twice
        last = dict(rows(db, f"SELECT name, value FROM scalars WHERE step = {STEPS} AND name IN "
                             f"('{names.FAULTS_LOST_GROUPS}', '{names.members_metric('generator')}', "
                             f"'{names.WEIGHT_REGROUPS}')"))
        assert last[names.members_metric("generator")] == 1
        assert last[names.WEIGHT_REGROUPS] == 1
        lost = int(last[names.FAULTS_LOST_GROUPS])
        assert f"{lost} group(s) it held go back to be regenerated" in trainer_log
    assert not app_processes(app)
