"""The asynchronous app end to end: ``llamarl.llamarl`` launched through TorchX's runner
on the local_cwd scheduler, on CPU, with a tiny policy made once per session
(``app_launch`` and the ``tiny_policy`` fixture).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torchx.specs import AppState
from transformers import AutoModelForCausalLM

from llamarl.app import names
from llamarl.app.state import train_state
from llamarl.app.model.policy import load_policy
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup, to_message
from llamarl.app.control.transport import StoreQueue, connect_store
from app_launch import APP_TIMEOUT_S, GROUP_SIZE, PROMPTS_PER_STEP, SMALL, STEPS, App, launch, rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# --------------------------------------------------------------------------- a clean run

def test_async_app_with_reward_executor(tiny_policy, tmp_path):
    # docs/rewards.md's "Write your own reward" example, scored remotely by the reward executor.
    rewards = "math_verifier,examples.my_reward:brevity=0.5"
    with launch(tiny_policy, tmp_path, num_reward=1, max_staleness=1, rewards=rewards) as app:
        app.wait_for_log("trainer", "run directory", timeout_s=APP_TIMEOUT_S)
        push_bad_messages(app)  # on the rollouts queue, which the reward executor reads here
        state = app.wait()
        assert state == AppState.SUCCEEDED, app.logs_tail()  # local_cwd: every replica exited 0
        db = app.db()
        rejected = dict(rows(db, "SELECT name, max(value) FROM scalars WHERE role = 'reward' AND name "
                                 "LIKE 'security/rejected_frames/%' GROUP BY name"))
        assert rejected == {names.rejected_metric(r): 1.0 for r in
                            ("missing_field", "wrong_type", "wrong_length", "bad_tag", "malformed_frame")}

        # Weights move to every generator, version after version.
        for receiver in ("generator/0", "generator/1"):
            versions = [v for (v,) in rows(db, f"SELECT version FROM weight_sync WHERE receiver = "
                                               f"'{receiver}' ORDER BY t")]
            assert len(versions) >= 2 and versions == list(range(len(versions))), (receiver, versions)
        sent = [v for (v,) in rows(db, "SELECT version FROM weight_sync WHERE receiver = 'trainer/0' "
                                       "ORDER BY t")]
        assert sent == list(range(STEPS + 1))

        # Off-policy but bounded: every trained rollout is at most max_staleness behind.
        used = [s for (s,) in rows(db, "SELECT staleness FROM staleness WHERE used = 1")]
        assert len(used) == STEPS * PROMPTS_PER_STEP * GROUP_SIZE
        assert max(used) <= 1 and any(s > 0 for s in used)

        # Every kind of event reached the single writer, from every role.
        for table in ("scalars", "intervals", "staleness", "weight_sync", "rewards"):
            assert rows(db, f"SELECT count(*) FROM {table}")[0][0] > 0, f"no {table} rows"
        timeline = set(rows(db, "SELECT DISTINCT role, replica FROM intervals"))
        assert timeline == {("trainer", 0), ("generator", 0), ("generator", 1), ("reward", 0)}
        components = {c for (c,) in rows(db, "SELECT DISTINCT component FROM rewards")}
        assert components == {"math_verifier", "brevity"}
        assert rows(db, "SELECT count(*) FROM rewards WHERE component = 'brevity' AND value IS NOT NULL")[0][0] > 0
        scalar_roles = {role for (role,) in rows(db, "SELECT DISTINCT role FROM scalars")}
        assert scalar_roles == {"trainer", "generator", "reward"}
        scalar_names = {n for (n,) in rows(db, "SELECT DISTINCT name FROM scalars")}
        assert {"eval/accuracy", "gen/tokens_per_s", "reward/samples_per_s", "staleness/max"} <= scalar_names
        assert rows(db, "SELECT count(*) FROM meta WHERE key = 'finished_at'") == [(1,)]

        # Each role stopped because the run finished, not because something failed.
        assert f"run finished: finished {STEPS} steps" in app.log("trainer")
        for role, replica in (("generator", 0), ("generator", 1), ("reward", 0)):
            log = app.log(role, replica)
            assert f"stopping: finished {STEPS} steps" in log, log[-2000:]
            assert " ERROR " not in log, log[-2000:]
            # Waiting for weights is silent (c10d logs two warnings per timed-out store wait),
            # and so is loading the policy (no progress bars).
            assert "[c10d]" not in log, log[-2000:]
            assert "Loading weights" not in log, log[-2000:]

        # The run directory keeps every role's log beside the config and the metrics.
        run_dir = app.runs_dir / app.app_id
        assert (run_dir / "config.json").is_file()
        logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
        assert set(logs) == {"trainer-0.log", "generator-0.log", "generator-1.log", "reward-0.log"}
        assert "run finished" in logs["trainer-0.log"]
        assert all("stopping: finished" in logs[f"{r}.log"] for r in ("generator-0", "generator-1", "reward-0"))

        # The dashboard draws this real run's every view without an exception.
        dashboard_draws_run(app.runs_dir, app.app_id)


def dashboard_draws_run(runs_dir: Path, run_id: str) -> None:
    from streamlit.testing.v1 import AppTest

    os.environ["LLAMARL_RUNS_DIR"] = str(runs_dir)
    try:
        app_file = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
        at = AppTest.from_file(str(app_file), default_timeout=60)
        at.query_params["run"] = run_id
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert not at.error, [e.value for e in at.error]
        assert len(at.get("plotly_chart")) > 0
    finally:
        del os.environ["LLAMARL_RUNS_DIR"]


@pytest.mark.parametrize("max_staleness", ["auto", 0])
def test_two_sharded_trainer_ranks(tiny_policy, tmp_path, max_staleness):
    """nproc_per_node=2: the policy is sharded (FSDP2) and each rank trains on half of
    every batch. Synchronous too, where the generator makes exactly one step's groups and
    each rank must leave the other its half (``llamarl.pipelines.rollouts.Holding``). Replica 0
    evaluates and exports the whole policy, gathered from the shards: the checkpoint's
    Hugging Face weights are the sharded training state's. A resume continues on 2 ranks.
    With ``--max-staleness auto`` (asynchronous, a trainer slowed by a KL term so the
    generator waits on the bound), both ranks train every step under the bound replica 0
    decided, and the resumed run continues with the checkpoint's bound."""
    slow = ["--kl-coef", "0.01", "--micro-batch", "1"] if max_staleness == "auto" else []
    with launch(tiny_policy, tmp_path, steps=2, num_generators=1, nproc=2,
                max_staleness=max_staleness, extra=[*SMALL, *slow]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        assert rows(db, "SELECT DISTINCT replica FROM intervals WHERE role = 'trainer' ORDER BY replica") == [(0,), (1,)]
        # Both ranks take part in every weight sync (each its own shard), initial weights included.
        assert rows(db, "SELECT receiver, count(*) FROM weight_sync WHERE receiver LIKE 'trainer/%' "
                        "GROUP BY receiver ORDER BY receiver") == [("trainer/0", 3), ("trainer/1", 3)]
        used = rows(db, "SELECT count(*) FROM staleness WHERE used = 1")[0][0]
        assert used == 2 * PROMPTS_PER_STEP * GROUP_SIZE
        # The weight digest (on by default) is per shard, each rank its own: the whole
        # weights are gathered only for step 2 (it evaluates and saves), not for step 1.
        assert rows(db, "SELECT replica, count(*) FROM intervals WHERE role = 'trainer' AND what = 'weight_gather' "
                        "GROUP BY replica ORDER BY replica") == [(0, 1), (1, 1)]
        assert rows(db, f"SELECT DISTINCT replica FROM scalars WHERE name = '{names.WEIGHT_DIGEST_S}' "
                        "ORDER BY replica") == [(0,), (1,)]
        assert f"run finished: finished 2 steps" in app.log("trainer")
        assert [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.eval_metric('accuracy')}' "
                                       "ORDER BY step")] == [0, 2]
    step2 = app.runs_dir / app.app_id / "checkpoints" / "step-2"
    exported = AutoModelForCausalLM.from_pretrained(step2)
    model, _ = load_policy(tiny_policy)
    train_state.load(step2 / train_state.DIR_NAME, model, torch.optim.AdamW(model.parameters()))
    trained = dict(model.named_parameters())
    for name, p in exported.named_parameters():
        assert torch.equal(p, trained[name]), name
    if max_staleness == 0:
        return
    state = json.loads((step2 / train_state.DIR_NAME / "state.json").read_text())["staleness_bound"]
    with launch(tiny_policy, tmp_path, steps=3, num_generators=1, nproc=2, max_staleness=max_staleness,
                extra=[*SMALL, *slow], options=["--resume", app.app_id]) as resumed:
        assert resumed.wait() == AppState.SUCCEEDED, resumed.logs_tail()
        log = resumed.log("trainer")
        assert f"resuming run {app.app_id} at step 2" in log, resumed.logs_tail()
        assert f"staleness bound {state['bound']}, continued from the checkpoint of step 2" in log
    assert (app.runs_dir / app.app_id / "checkpoints" / "step-3").is_dir()
    by_step: dict[int, dict[int, float]] = {}
    for step, replica, bound in rows(db, f"SELECT step, replica, value FROM scalars "
                                         f"WHERE name = '{names.STALENESS_BOUND}'"):
        by_step.setdefault(step, {})[replica] = bound
    assert sorted(by_step) == [1, 2, 3] and all(len(set(b.values())) == 1 and len(b) == 2 for b in by_step.values()), \
        f"every rank trains each step under one bound: {by_step}"
    assert by_step[1][0] == 1 and by_step[3][0] == state["bound"], by_step
    before = rows(db, "SELECT bound FROM staleness_bounds WHERE step <= 2 ORDER BY t")  # kept by the resume
    assert [b for (b,) in before][-1:] in ([], [state["bound"]]), before


def test_a_trainer_of_two_nodes(tiny_policy, tmp_path):
    """trainer_nodes=2 on local_cwd: two trainer replicas (torchrun agents) meet at a
    static rendezvous on replica 0's host, rank 1 reaches the control store there through
    --store-host, and the sharded run trains every rollout once."""
    with launch(tiny_policy, tmp_path, steps=2, num_generators=1, options=["--trainer_nodes", "2"]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        assert rows(db, "SELECT DISTINCT replica FROM intervals WHERE role = 'trainer' ORDER BY replica") == [(0,), (1,)]
        assert rows(db, "SELECT count(*) FROM staleness WHERE used = 1")[0][0] == 2 * PROMPTS_PER_STEP * GROUP_SIZE
        assert '"trainer_ranks": 2' in dict(rows(db, "SELECT key, value FROM meta"))["config"]
        assert "run finished: finished 2 steps" in app.log("trainer", 0)


def push_bad_messages(app: App) -> None:
    """On the rollouts queue of a running app: a garbage frame, a frame signed with another
    secret, and three messages signed with the app's own secret that break the rollout
    contract (a missing field, a wrong type, log-probs that do not match the tokens)."""
    secret = app.secret()
    store = connect_store(f"127.0.0.1:{app.store_port}", timeout_s=30)
    good = to_message(RolloutGroup(group_id=GroupId(99, 0), version=0, rollouts=[
        Rollout(prompt_ids=[5, 6], completion_ids=[7, 8], behaviour_logprobs=[-1.0, -1.0],
                version=0, group_id=GroupId(99, 0), task={"answer": 1.0})] * GROUP_SIZE))
    missing = {k: v for k, v in good.items() if k != "prompt_ids"}
    wrong_type = {**good, "version": "0"}
    short = {**good, "logprobs": [lp[:1] for lp in good["logprobs"]]}
    queue = StoreQueue(store, names.ROLLOUTS, secret, maxlen=1000)
    for msg in (missing, wrong_type, short):
        queue.push(msg, timeout_s=10)
    StoreQueue(store, names.ROLLOUTS, bytes(32), maxlen=1000).push(good, timeout_s=10)
    store.queue_push(queue.key, b"\x00garbage")


def test_synchronous_baseline_trains_only_fresh_rollouts(tiny_policy, tmp_path):
    """max_staleness = 0, same code path: generate, train, sync. Bad messages pushed on the
    rollouts queue are dropped and counted, never trained on, and the run goes on."""
    with launch(tiny_policy, tmp_path, steps=3, num_reward=0, max_staleness=0) as app:
        app.wait_for_log("trainer", "run directory", timeout_s=APP_TIMEOUT_S)
        push_bad_messages(app)
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        used = rows(db, "SELECT step, version, staleness FROM staleness WHERE used = 1")
        assert len(used) == 3 * PROMPTS_PER_STEP * GROUP_SIZE
        assert all(lag == 0 and version == step - 1 for step, version, lag in used)
        rejected = dict(rows(db, "SELECT name, max(value) FROM scalars WHERE name LIKE "
                                 "'security/rejected_frames/%' GROUP BY name"))
        assert rejected == {names.rejected_metric(r): 1.0 for r in
                            ("missing_field", "wrong_type", "wrong_length", "bad_tag", "malformed_frame")}
        assert "dropped a message (wrong_length in 'logprobs[0]')" in app.log("trainer")
        assert rows(db, "SELECT count(*) FROM staleness WHERE used = 0") == [(0,)]
        config = dict(rows(db, "SELECT key, value FROM meta"))["config"]
        assert '"mode": "sync"' in config


def test_int8_generators_record_quantization_and_mismatch(tiny_policy, tmp_path):
    """--gen-precision int8: each generator quantizes every version it swaps in (the time
    recorded under that version), and the trainer measures the mismatch of every step
    by lag; at lag 0 only the precision differs, so the ratio stays near 1."""
    with launch(tiny_policy, tmp_path, steps=3, num_generators=1, max_staleness=1,
                extra=[*SMALL, "--gen-precision", "int8"]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        quantized = rows(db, f"SELECT step, value FROM scalars WHERE name = '{names.WEIGHTS_QUANTIZE_S}' "
                             "AND role = 'generator' ORDER BY t")
        assert quantized and quantized[0][0] == 0 and all(s > 0 for _, s in quantized)
        swapped = [v for v, _ in quantized]
        assert swapped == sorted(set(swapped)), swapped  # each version quantized once, in order
        lags = {lag for (lag,) in rows(db, "SELECT DISTINCT staleness FROM staleness WHERE used = 1")}
        stats = {n for (n,) in rows(db, f"SELECT DISTINCT name FROM scalars WHERE name LIKE "
                                        f"'{names.MISMATCH_PREFIX}%'")}
        assert {names.mismatch_metric(lag, s) for lag in lags for s in names.MISMATCH_STATS} >= stats
        assert stats, "no mismatch metric recorded"
        ratio = rows(db, f"SELECT value FROM scalars WHERE name = '{names.mismatch_metric(0, 'ratio_mean')}'")
        assert all(0.5 < r < 2.0 for (r,) in ratio)
