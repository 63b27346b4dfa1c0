"""A verifiers taskset run unchanged through ``--env verifiers:<module>:<name>``: its tasks
as rows, its prompt as the first messages, its own rewards as the episode's reward; and
2 steps of the real app on it (tests/verifiers_tasksets.py)."""

import os
from pathlib import Path

import pytest
from torchx.specs import AppState

import verifiers.v1  # noqa: E402,F401  (the test extra installs it: a missing one fails, not skips)

from app_launch import SMALL, launch, rows  # noqa: E402
from llamarl.app.envs.spec import build_env  # noqa: E402
from llamarl.app.errors import ConfigError  # noqa: E402

SPEC = "verifiers:verifiers_tasksets:load_environment"


def test_a_taskset_s_tasks_prompts_and_rewards():
    make = build_env(SPEC)
    env = make()
    train, test = env.rows("train", 20, seed=0), env.rows("test", 3, seed=0)
    assert {r["task_index"] for r in test} == {9}  # every 10th of 12 tasks is held out
    assert len({r["task_index"] for r in train}) == 11 and 9 not in {r["task_index"] for r in train}
    assert env.reset({"task_index": 3}) == [{"role": "user", "content": "Write the number 3."}]
    step = env.step("3")
    assert step.done and step.reward == 1.5 and step.info["verifiers_rewards"] == {"exact": 1.0, "short": 0.5}
    assert env.step("the number is 3").reward == 0.0
    # The taskset class works too (made with its config), and a bad name is one line.
    assert build_env("verifiers:verifiers_tasksets:EchoTaskset")().rows("test", 1, seed=0) == [{"task_index": 9}]
    with pytest.raises(ConfigError, match="not a verifiers Taskset"):
        build_env("verifiers:verifiers_tasksets:EchoData")


@pytest.mark.integration
@pytest.mark.slow
def test_the_app_trains_on_a_verifiers_taskset(tiny_policy, tmp_path):
    here = str(Path(__file__).resolve().parent)  # the roles import verifiers_tasksets from here
    path = ":".join(p for p in (os.environ.get("PYTHONPATH"), here) if p)
    extra = [*SMALL, "--env", SPEC, "--max-turns", "1", "--max-new-tokens", "4"]
    with launch(tiny_policy, tmp_path, steps=2, num_generators=1, rewards="env_reward", extra=extra,
                env={"PYTHONPATH": path}) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        episodes = rows(db, "SELECT max(value) FROM scalars WHERE role = 'generator' AND name = 'env/episodes'")
        assert episodes[0][0] > 0
        assert rows(db, "SELECT max(step) FROM scalars WHERE role = 'trainer'")[0][0] == 2
        assert {c for (c,) in rows(db, "SELECT DISTINCT component FROM rewards")} >= {"env_reward"}
