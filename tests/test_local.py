"""The single-process RL loop end to end on a tiny warm-started policy, and warm-start
determinism. A few seconds each on two CPU cores."""

from __future__ import annotations

import sqlite3
import textwrap
from pathlib import Path

import pytest
import torch

from llamarl.app.roles import local
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.model.policy import load_policy
from llamarl.app.rl.warmstart import WarmStartConfig, warm_start

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_warmstart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("warmstart") / "policy"
    warm_start(WarmStartConfig(out=str(out), steps=20, batch_size=16, train_size=500, eval_size=4),
               log=lambda _: None)
    return out


def _run(policy: Path, runs_dir: Path, run_id: str, gen_precision: str = "fp32", **overrides) -> local.LocalResult:
    cfg = TrainerConfig(policy=str(policy), steps=2, prompts_per_step=2, group_size=2, eval_size=8,
                        runs_dir=str(runs_dir), run_id=run_id, **overrides)
    return local.run(cfg, GeneratorConfig(max_new_tokens=24, gen_precision=gen_precision), log=lambda _: None)


def _query(run_dir: Path, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(run_dir / "metrics.db") as db:
        return db.execute(sql, args).fetchall()


def _scalar_steps(run_dir: Path, name: str) -> list[int]:
    return [s for (s,) in _query(run_dir, "SELECT step FROM scalars WHERE name = ? ORDER BY step", name)]


def test_local_run_writes_the_run_directory(tiny_warmstart, tmp_path):
    result = _run(tiny_warmstart, tmp_path, "r1")
    run_dir = result.run_dir
    assert run_dir == tmp_path / "r1"
    assert (run_dir / "config.json").is_file()
    assert [step for step, _ in result.evals] == [0, 2]
    assert all(0.0 <= m["accuracy"] <= 1.0 for _, m in result.evals)

    for name in ("loss", "reward/math_verifier", "reward/total", "aipo/ratio_mean", "aipo/frac_truncated",
                 "grad_norm", "response_len", "gen/tokens_per_s", "train/tokens_per_s", "quarantined/total",
                 "frac_zero_var", "frac_no_answer", "frac_cut_off"):
        assert _scalar_steps(run_dir, name) == [1, 2], name
    assert _scalar_steps(run_dir, "eval/accuracy") == [0, 2]
    assert _scalar_steps(run_dir, "eval/sampled_accuracy") == [0, 2]
    # one staleness row per consumed rollout: 2 steps x 2 prompts x 2 samples, all fresh
    assert _query(run_dir, "SELECT step, version, staleness, used FROM staleness ORDER BY step") == \
        [(1, 0, 0, 1)] * 4 + [(2, 1, 0, 1)] * 4
    whats = {w for (w,) in _query(run_dir, "SELECT DISTINCT what FROM intervals")}
    assert {"eval", "generate", "reward", "train"} <= whats
    meta = dict(_query(run_dir, "SELECT key, value FROM meta"))
    assert {"finished_at", "config", "run_id", "schema_version"} <= set(meta)
    assert len(_query(run_dir, "SELECT * FROM rewards WHERE component = 'math_verifier'")) == 8


def test_int8_generator_is_quantized_before_every_step(tiny_warmstart, tmp_path):
    """Rollouts come from a quantized copy of the trained model, refreshed before each
    step (its time recorded under the version it quantized)."""
    result = _run(tiny_warmstart, tmp_path, "int8", gen_precision="int8")
    rows = _query(result.run_dir, "SELECT step, role, value FROM scalars WHERE name = 'weights/quantize_s' "
                                  "ORDER BY step")
    assert [(step, role) for step, role, _ in rows] == [(0, "generator"), (1, "generator")]
    assert all(seconds > 0 for _, _, seconds in rows)
    # Every rollout is of lag 0: the mismatch is the precision's alone, measured each step.
    for stat in ("ratio_mean", "ratio_max", "frac_truncated", "kl"):
        assert _scalar_steps(result.run_dir, f"mismatch/lag0/{stat}") == [1, 2]
    assert not _query(result.run_dir, "SELECT name FROM scalars WHERE name LIKE 'mismatch/lag1/%'")
    assert _scalar_steps(result.run_dir, "loss") == [1, 2]


def test_user_reward_from_the_docs_runs_end_to_end(tiny_warmstart, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # examples/ imports from the repository root
    result = _run(tiny_warmstart, tmp_path, "brevity", rewards="math_verifier,examples.my_reward:brevity=0.5")
    assert _scalar_steps(result.run_dir, "reward/brevity") == [1, 2]
    rows = _query(result.run_dir, "SELECT value, reason FROM rewards WHERE component = 'brevity'")
    assert len(rows) == 8 and all(reason is None and 0.0 <= value <= 1.0 for value, reason in rows)


FLAKY_REWARD = textwrap.dedent("""
    calls = 0

    def flaky(prompt, completion, meta):
        global calls
        calls += 1
        if calls % 2 == 0:
            raise RuntimeError("every second call fails")
        return 0.25
""")


def test_raising_reward_is_quarantined_and_the_run_continues(tiny_warmstart, tmp_path, monkeypatch):
    (tmp_path / "llamarl_test_flaky_reward.py").write_text(FLAKY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _run(tiny_warmstart, tmp_path / "runs", "flaky", rewards="math_verifier,llamarl_test_flaky_reward:flaky")
    run_dir = result.run_dir
    assert [step for step, _ in result.evals] == [0, 2]  # it went on to the end
    # 4 rollouts a step, every second call of the flaky reward raises
    assert _query(run_dir, "SELECT step, value FROM scalars WHERE name = 'quarantined/total' ORDER BY step") == \
        [(1, 2.0), (2, 2.0)]
    assert _query(run_dir, "SELECT step, value FROM scalars WHERE name = 'quarantined/raised:RuntimeError' "
                           "ORDER BY step") == [(1, 2.0), (2, 2.0)]
    assert _query(run_dir, "SELECT COUNT(*) FROM rewards WHERE component = 'flaky' AND value IS NULL "
                           "AND reason = 'raised:RuntimeError'") == [(4,)]
    # only the kept rollouts were trained on
    assert _query(run_dir, "SELECT COUNT(*) FROM staleness") == [(4,)]
    assert "finished_at" in dict(_query(run_dir, "SELECT key, value FROM meta"))


ALWAYS_RAISES = "def boom(prompt, completion, meta):\n    raise RuntimeError('boom')\n"


def test_a_step_whose_rollouts_are_all_quarantined_is_skipped(tiny_warmstart, tmp_path, monkeypatch):
    (tmp_path / "llamarl_test_boom_reward.py").write_text(ALWAYS_RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _run(tiny_warmstart, tmp_path / "runs", "boom", rewards="llamarl_test_boom_reward:boom")
    assert [step for step, _ in result.evals] == [0, 2]
    assert _query(result.run_dir, "SELECT step, value FROM scalars WHERE name = 'quarantined/total' "
                                  "ORDER BY step") == [(1, 4.0), (2, 4.0)]


def test_a_first_step_without_any_answer_logs_the_warning(tiny_warmstart, tmp_path):
    # One token is never a final answer ('####' and each digit are tokens of their own).
    cfg = TrainerConfig(policy=str(tiny_warmstart), steps=1, prompts_per_step=2, group_size=2, eval_size=2,
                        runs_dir=str(tmp_path), run_id="cut")
    lines: list[str] = []
    local.run(cfg, GeneratorConfig(max_new_tokens=1), log=lines.append)
    (warning,) = [line for line in lines if line.startswith("WARNING")]
    assert "step 1: no completion has a final answer" in warning and "--system-prompt" in warning
    assert "100% of the completions were cut off at 1 tokens" in warning
    (step_line,) = [line for line in lines if line.startswith("step 1/1")]
    assert "no answer 1.00 cut off 1.00" in step_line


@pytest.mark.integration
def test_warmstart_is_deterministic(tmp_path):
    def train(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
        cfg = WarmStartConfig(out=str(tmp_path / name), steps=3, batch_size=8, train_size=40, eval_size=2,
                              seed=seed)
        warm_start(cfg, log=lambda _: None)
        return load_policy(tmp_path / name)[0].state_dict()

    a, b, c = train("a"), train("b"), train("c", seed=1)
    assert all(torch.equal(v, b[k]) for k, v in a.items())
    assert not all(torch.equal(v, c[k]) for k, v in a.items())


def test_a_warm_start_leaves_the_callers_thread_count_as_it_was(tmp_path):
    before = torch.get_num_threads()
    threads = 2 if before != 2 else 1
    cfg = WarmStartConfig(out=str(tmp_path / "w"), steps=1, batch_size=4, train_size=8, eval_size=1, threads=threads)
    warm_start(cfg, log=lambda _: None)
    assert torch.get_num_threads() == before
