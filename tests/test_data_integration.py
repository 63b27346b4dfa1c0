"""The app on a dataset file, launched through TorchX like a user would: the generators
sample the file's prompts in the run's order, the verifier scores them against the
file's references, a held-out share is evaluated; a bad file fails the app before
anything trains, with the file and line as every role's stop reason; and the trained
policy comes out as a checkpoint a second run starts from."""

from __future__ import annotations

import json

import pytest
import torch
from torchx.specs import AppState
from transformers import AutoModelForCausalLM

from llamarl.app.data import sources as data
from llamarl.app import names
from llamarl.app.config import TrainerConfig
from llamarl.app.metrics.events import LAST_CHECKPOINT
from llamarl.app.model.policy import load_tokenizer
from app_launch import GROUP_SIZE, PROMPTS_PER_STEP, SMALL, launch, rows
from benchmarks import record_prompts
from data_files import gsm8k_rows, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2
PARITY = '''"""A reward the tiny policy earns on some completions and not on others (it solves
none of the file's problems): groups have a spread, so the policy's weights move."""


def odd_length(prompt, completion, meta):
    return float(len(completion) % 2)
'''


def test_app_trains_on_a_jsonl_file(tiny_policy, tmp_path):
    rows_ = gsm8k_rows()
    path = write_jsonl(tmp_path / "train.jsonl", rows_, ("question", "answer"))
    record = tmp_path / "seen.jsonl"
    flags = ["--eval-fraction", "0.25", "--max-prompt-tokens", "200"]
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=1, options=["--dataset", str(path)],
                rewards=f"math_verifier,{record_prompts.SPEC}", extra=[*SMALL, *flags],
                env=record_prompts.env(record)) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()

        # What every role computes from the file, computed here the same way.
        cfg = TrainerConfig(dataset=str(path), eval_size=20, prompts_per_step=PROMPTS_PER_STEP,
                            eval_fraction=0.25, max_prompt_tokens=200)
        expected = data.load(cfg, load_tokenizer(tiny_policy), log=lambda _: None)
        references = {r["question"]: r["reference"] for r in rows_}

        # The generator sampled the file's training prompts, in the run's order: one
        # generator fills slots 0, 1, 2, ... and the trainer's pipeline scored them as they
        # came (its prefetch may score a group or two more than the steps consumed).
        seen = record_prompts.records(record)
        assert len(seen) >= STEPS * PROMPTS_PER_STEP * GROUP_SIZE and len(seen) % GROUP_SIZE == 0
        slots = range(len(seen) // GROUP_SIZE)
        assert {s["prompt"] for s in seen} == {f"Q: {expected.order.problem(i).question}\nA:" for i in slots}
        for s in seen:
            question = s["prompt"][len("Q: "): -len("\nA:")]
            assert s["meta"]["answer_format"] == "gsm8k"
            assert s["meta"]["answer"].replace(",", "") == references[question]
            assert question not in {p.question for p in expected.held_out}

        counts = dict(rows(db, "SELECT name, value FROM scalars WHERE name LIKE 'data/%'"))
        # One generator fills slots in order: the checkpoint's frontier is every slot trained.
        assert counts.pop(names.DATA_SLOT) == STEPS * PROMPTS_PER_STEP
        assert counts == {names.DATA_TRAIN_PROBLEMS: len(expected.order),
                          names.DATA_EVAL_PROBLEMS: len(expected.held_out),
                          names.DATA_SKIPPED_BAD_ROWS: 0, names.DATA_SKIPPED_LONG_PROMPTS: 0}
        assert 0 < len(expected.held_out) < len(rows_)
        eval_steps = [s for (s,) in rows(db, f"SELECT step FROM scalars WHERE name = '{names.EVAL_ACCURACY}' "
                                             "ORDER BY step")]
        assert eval_steps == [0, STEPS]
        scored = rows(db, "SELECT count(*) FROM rewards WHERE component = 'math_verifier' AND value IS NOT NULL")
        assert scored == [(STEPS * PROMPTS_PER_STEP * GROUP_SIZE,)]
        assert f"fingerprint {expected.fingerprint[:16]}" in app.log("generator")
        config = json.loads(dict(rows(db, "SELECT key, value FROM meta"))["config"])
        assert config["dataset"] == str(path.resolve())


def test_a_bad_file_fails_the_app_before_training(tiny_policy, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "How many?", "answer": "#### 3"}\n{"question": "And now?", "answer": "four"}\n')
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=1,
                options=["--dataset", str(path)]) as app:
        assert app.wait() == AppState.FAILED
        trainer = app.log("trainer")
        error = f"DataError: {path}, line 2: cannot extract the reference from field 'answer'"
        assert error in trainer, trainer[-3000:]
        assert "step 1/" not in trainer
        generator = app.log("generator")
        assert f"stopping: trainer/0 failed: {error}" in generator, generator[-3000:]
        assert not (app.runs_dir / app.app_id).exists()  # it never started


def test_the_run_leaves_a_checkpoint_that_is_the_policy_of_a_second_run(tiny_policy, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(), ("question", "answer"))
    first, second = tmp_path / "first", tmp_path / "second"
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "parity.py").write_text(PARITY)
    with launch(tiny_policy, first, steps=STEPS, num_generators=1, options=["--dataset", str(path)],
                rewards="math_verifier,parity:odd_length", env={"PYTHONPATH": str(tmp_path / "plugins")},
                extra=[*SMALL, "--save-every", "1", "--keep-last", "1"]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        run_dir = app.runs_dir / app.app_id
        meta = dict(rows(app.db(), "SELECT key, value FROM meta"))
        saves = rows(app.db(), f"SELECT step, value FROM scalars WHERE name = '{names.CHECKPOINT_STEP}' "
                               "ORDER BY step")
        seconds = rows(app.db(), f"SELECT count(*) FROM scalars WHERE name = '{names.CHECKPOINT_SAVE_S}' "
                                 "AND value > 0")
    # One save per step, each deleting the one before: only the last remains.
    assert saves == [(s, float(s)) for s in range(1, STEPS + 1)] and seconds == [(STEPS,)]
    final = run_dir / "checkpoints" / f"step-{STEPS}"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [final.name]
    latest = {"step": STEPS, "path": str(final.resolve())}
    assert json.loads(meta[LAST_CHECKPOINT]) == latest
    assert json.loads((run_dir / "config.json").read_text())[LAST_CHECKPOINT] == latest

    # The trained policy, not the starting one: the weights moved.
    trained = AutoModelForCausalLM.from_pretrained(final)
    start = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert trained.config.vocab_size == start.config.vocab_size
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters()))

    with launch(final, second, steps=1, num_generators=1, options=["--dataset", str(path)]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        config = json.loads(dict(rows(app.db(), "SELECT key, value FROM meta"))["config"])
        assert config["policy"] == str(final)
        assert (app.runs_dir / app.app_id / "checkpoints" / "step-1" / "model.safetensors").is_file()


def test_tensorboard_gets_every_scalar_of_the_metrics_db(tiny_policy, tmp_path):
    pytest.importorskip("tensorboard")
    from test_tensorboard_mirror import read_scalars

    path = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(), ("question", "answer"))
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=1, options=["--dataset", str(path)],
                extra=[*SMALL, "--tensorboard"]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        in_db = rows(app.db(), "SELECT name, role, replica, count(*) FROM scalars GROUP BY name, role, replica")
        run_dir = app.runs_dir / app.app_id
    in_tensorboard = {t: len(v) for t, v in read_scalars(run_dir / "tensorboard").items()}
    assert in_tensorboard == {f"{name}/{role}-{replica}": n for name, role, replica, n in in_db}
    assert f"{names.LOSS}/trainer-0" in in_tensorboard and f"{names.GEN_TOKENS_PER_S}/generator-0" in in_tensorboard
