"""Checkpoint and resume through TorchX, as a user would: a run killed after its step-2
checkpoint is started again with ``--resume auto`` (what a scheduler's application retry
does); it continues the same run directory and metrics database, trains the remaining
steps on the same prompts in the same order, and every step is recorded once. A resume
that cannot work fails before anything trains and leaves the run as it was; a finished
run goes on for more steps with ``--resume RUN_ID``. Multi-turn episodes killed in flight
are played again from their start, each row trained once. (Two trainer ranks saving and
loading collectively: tests/test_train_state.py.)"""

from __future__ import annotations

import json
import time

import pytest
from torchx.specs import AppState

from llamarl.app.data import sources as data
from llamarl.app import names
from llamarl.app.config import TrainerConfig
from llamarl.app.envs.spec import build_env
from llamarl.app.metrics.events import RESUMED
from llamarl.app.model.policy import load_tokenizer
from app_launch import GROUP_SIZE, PROMPTS_PER_STEP, SMALL, launch, rows
from benchmarks import record_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
def _launch(policy, tmp_path, record, *flags, steps=STEPS):
    # Synchronous with one generator: step s trains slots (s-1)*B .. s*B-1, in order.
    return launch(policy, tmp_path, steps=steps, num_generators=1, max_staleness=0,
                  rewards=f"math_verifier,{record_prompts.SPEC}",
                  extra=[*SMALL, "--eval-every", "100", "--save-every", "2", *flags],
                  env=record_prompts.env(record))


def test_a_killed_run_resumes_from_its_checkpoint(tiny_policy, tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_id = "resumed-run"
    auto = ["--run-id", run_id, "--resume", "auto"]  # after the component's own --run-id
    with _launch(tiny_policy, tmp_path, first, *auto) as app:
        app.wait_for_log("trainer", "no run to resume", timeout_s=120)
        run_dir = app.runs_dir / run_id
        _kill_after_checkpoint(app, run_dir / "checkpoints" / "step-2")
    state = json.loads((run_dir / "checkpoints" / "step-2" / "train_state" / "state.json").read_text())
    assert state["step"] == 2 and state["ledger"] == {"frontier": 2 * PROMPTS_PER_STEP, "done": []}

    with _launch(tiny_policy, tmp_path, second, *auto) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        assert f"resuming run {run_id} at step 2" in app.log("trainer"), app.logs_tail()
    assert not (app.runs_dir / app.app_id).exists(), "the resume continued the old run directory"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert (run_dir / "checkpoints" / "step-4" / "train_state" / "state.json").is_file()

    # The same prompts in the same order as an uninterrupted run: slot n is problem n of
    # the run's order, and the resumed run trained slots 8..15 first.
    cfg = TrainerConfig(steps=STEPS, prompts_per_step=PROMPTS_PER_STEP, eval_size=20)
    order = data.load(cfg, load_tokenizer(tiny_policy), log=lambda _: None).order
    expected = [f"Q: {order.problem(n).question}\nA:" for n in range(2 * PROMPTS_PER_STEP, STEPS * PROMPTS_PER_STEP)]
    assert record_prompts.groups(second, GROUP_SIZE)[: len(expected)] == expected
    assert record_prompts.groups(first, GROUP_SIZE)[: 2 * PROMPTS_PER_STEP] == [
        f"Q: {order.problem(n).question}\nA:" for n in range(2 * PROMPTS_PER_STEP)]

    # One metrics database: every step once, the resume marked, the run finished.
    import sqlite3
    db = sqlite3.connect(run_dir / "metrics.db")
    steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
    assert steps == [1, 2, 3, 4]
    versions = [v for (v,) in rows(db, f"SELECT value FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
    assert versions == [1.0, 2.0, 3.0, 4.0]
    meta = dict(rows(db, "SELECT key, value FROM meta"))
    assert [r["step"] for r in json.loads(meta[RESUMED])] == [2] and "finished_at" in meta
    assert rows(db, f"SELECT step, value FROM scalars WHERE name = '{names.DATA_SLOT}' ORDER BY step") == [
        (2, 8.0), (4, 16.0)]
    assert max(s for (s,) in rows(db, "SELECT step FROM staleness")) == STEPS

    # A refusal: before anything trains, nothing of the run changed. The later of the two
    # places a resume is refused (the run is found, its config differs); every refusal's
    # message, "no run 'X'" included, is checked in tests/test_train_state.py, and each app
    # run costs ~10 s.
    before = (rows(db, "SELECT COUNT(*) FROM scalars"), sorted(p.name for p in run_dir.rglob("*")))
    with _launch(tiny_policy, tmp_path, tmp_path / "refused.jsonl", "--resume", run_id, "--lr", "0.5", steps=6) as app:
        assert app.wait() == AppState.FAILED
        assert "was started with another config (lr: 0.0001 then, 0.5 now)" in app.log("trainer"), app.logs_tail()
    assert (rows(db, "SELECT COUNT(*) FROM scalars"), sorted(p.name for p in run_dir.rglob("*"))) == before
    assert not (tmp_path / "refused.jsonl").exists(), "a refused resume generated rollouts"

    # A finished run trains on: two more steps.
    with _launch(tiny_policy, tmp_path, tmp_path / "third.txt", "--resume", run_id, steps=6) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
    steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' ORDER BY t")]
    assert steps == [1, 2, 3, 4, 5, 6]
    state = json.loads((run_dir / "checkpoints" / "step-6" / "train_state" / "state.json").read_text())
    assert state["ledger"] == {"frontier": 6 * PROMPTS_PER_STEP, "done": []}
    assert [r["step"] for r in json.loads(dict(rows(db, "SELECT key, value FROM meta"))[RESUMED])] == [2, 4]


def test_episodes_in_flight_at_a_kill_are_played_again_once(tiny_policy, tmp_path):
    """Multi-turn episodes (guess the number, one secret per row) killed in flight after
    the step-1 checkpoint: the resumed run plays the slots after it from their start, so
    every row is trained exactly once, at its slot's step (groups of one step go out as
    their episodes end: in any order within the step)."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_id, steps = "resumed-episodes", 3
    env = "guess_number(high=1000000)"  # secrets that tell the rows apart

    def start(record):
        return launch(tiny_policy, tmp_path, steps=steps, num_generators=1, max_staleness=0,
                      rewards=f"env_reward,{record_prompts.SPEC}", env=record_prompts.env(record),
                      extra=[*SMALL, "--eval-every", "100", "--save-every", "1", "--env", env, "--max-turns", "3",
                             "--max-episode-tokens", "48", "--run-id", run_id, "--resume", "auto"])

    with start(first) as app:
        run_dir = app.runs_dir / run_id
        _kill_after_checkpoint(app, run_dir / "checkpoints" / "step-1")
    with start(second) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        assert f"resuming run {run_id} at step 1" in app.log("trainer"), app.logs_tail()

    env_rows = build_env(env)().rows("train", steps * PROMPTS_PER_STEP, seed=TrainerConfig().seed)
    secrets = [r["secret"] for r in env_rows]
    assert len(set(secrets)) == len(secrets)

    def played(record, steps):
        """The secrets each of the first ``steps`` steps trained, a set per step."""
        secrets = [r["meta"]["secret"] for r in record_prompts.records(record)[::GROUP_SIZE]]
        return [set(secrets[k * PROMPTS_PER_STEP:(k + 1) * PROMPTS_PER_STEP]) for k in range(steps)]

    def by_step(rows):
        return [set(rows[k * PROMPTS_PER_STEP:(k + 1) * PROMPTS_PER_STEP]) for k in range(len(rows) // PROMPTS_PER_STEP)]

    assert played(first, 1) == by_step(secrets[:PROMPTS_PER_STEP])
    # Whatever the first run had in flight past slot 4, the resumed one starts at slot 4.
    assert played(second, 2) == by_step(secrets[PROMPTS_PER_STEP:])
    assert all(r["meta"]["turns"] >= 1 for r in record_prompts.records(second))
    import sqlite3
    db = sqlite3.connect(run_dir / "metrics.db")
    assert [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.TRAIN_VERSION}' "
                                   "ORDER BY t")] == [1, 2, 3]
    state = json.loads((run_dir / "checkpoints" / "step-3" / "train_state" / "state.json").read_text())
    assert state["ledger"] == {"frontier": steps * PROMPTS_PER_STEP, "done": []}


def _kill_after_checkpoint(app, checkpoint) -> None:
    """Wait (at most 240 s) for ``checkpoint`` while the app runs, then kill every process
    of the app: a crash, not a stop."""
    deadline = time.monotonic() + 240
    while not checkpoint.is_dir():
        assert time.monotonic() < deadline, app.logs_tail()
        assert app.runner.status(app.handle).state == AppState.RUNNING, app.logs_tail()
        time.sleep(0.2)
    app.runner.cancel(app.handle)
    assert app.wait() != AppState.SUCCEEDED
