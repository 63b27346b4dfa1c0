"""The run's prompts (app/data/sources.py): held-out splits, prompt formatting and the length
filter, bad rows counted, the order over epochs and its state, and the fingerprint check
between roles over a real control store. Reading files: tests/test_datafile.py."""

from __future__ import annotations

import json

import pytest

from llamarl.app.data import sources as data
from llamarl.app import names
from llamarl.app.control import runtime
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.control import transport
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.errors import ConfigError, DataError
from llamarl.app.model.policy import build_tokenizer, encode_prompts, save_policy
from data_files import GSM8K, MATH, MATH_ROWS, gsm8k_rows, write_jsonl, write_parquet
from role_processes import TEST_SECRET
from tiny_models import tiny_llama  # max_position_embeddings=64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tasks.corpus(0, n=200) + [r"\frac{}$^ " + "".join(chr(c) for c in range(32, 127))])


def cfg(**kw) -> TrainerConfig:
    return TrainerConfig(**{"eval_size": 200, **kw})


def quiet(_: str) -> None:
    pass


def test_bad_rows_skipped_are_counted_in_the_run_data(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"question": "Q1?", "answer": "#### 1"}\n' + '{"question": "Q?", "answer": "x"}\n' * 2)
    lines: list[str] = []
    run = data.load(cfg(dataset=str(path), on_bad_row="skip"), tokenizer, log=lines.append)
    assert run.counts[names.DATA_SKIPPED_BAD_ROWS] == 2 and len(run.order) == 1
    assert any(line.startswith("skipped 2 bad rows (--on-bad-row skip)") for line in lines)


# --------------------------------------------------------------------------- held out

def test_eval_fraction_splits_by_prompt_hash(tmp_path, tokenizer):
    rows = gsm8k_rows()
    rows += [rows[0], rows[5]]  # duplicated prompts stay on one side
    path = write_jsonl(tmp_path / "g.jsonl", rows, GSM8K)
    run = data.load(cfg(dataset=str(path), eval_fraction=0.3), tokenizer, log=quiet)
    train = {p.question for p in run.order.problems}
    held = {p.question for p in run.held_out}
    assert train and held and not train & held
    assert train | held == {r["question"] for r in rows}
    assert all(data.held_out(q, 0.3) for q in held) and not any(data.held_out(q, 0.3) for q in train)
    assert run.counts[names.DATA_EVAL_PROBLEMS] == len(run.held_out)
    # --eval-size takes the first in hash order: the same problems whatever the seed.
    small = data.load(cfg(dataset=str(path), eval_fraction=0.3, eval_size=2, seed=7), tokenizer, log=quiet)
    assert small.held_out == sorted(run.held_out, key=lambda p: data._unit_hash(p.question))[:2]


def test_eval_dataset_and_no_evaluation(tmp_path, tokenizer):
    rows = gsm8k_rows()
    train = write_jsonl(tmp_path / "train.jsonl", rows[:16], GSM8K)
    test = write_parquet(tmp_path / "test.parquet", rows[16:], GSM8K)
    run = data.load(cfg(dataset=str(train), eval_dataset=str(test)), tokenizer, log=quiet)
    assert len(run.order) == 16 and {p.question for p in run.held_out} == {r["question"] for r in rows[16:]}
    lines: list[str] = []
    alone = data.load(cfg(dataset=str(train)), tokenizer, log=lines.append)
    assert alone.held_out == [] and any("no held-out evaluation" in line for line in lines)


def test_the_shipped_sample_is_named_graded_and_reproducible(tmp_path, tokenizer, monkeypatch):
    """``--dataset gsm8k-sample``: 320 training and 100 held-out problems, distinct, every
    reference an integer the verifier reads and its worked steps right; its held-out file
    gives way to the run's own choice; the script that wrote it writes the same bytes;
    its name survives the paths trainer replica 0 publishes."""
    import importlib.util
    import re
    from pathlib import Path

    from llamarl.app.rewards.verifiers import math_verifier
    from llamarl.app.tasks import samples

    run = data.load(cfg(dataset="gsm8k-sample"), tokenizer, log=quiet)
    train, held = run.order.problems, run.held_out
    assert (len(train), len(held)) == (320, 100)
    assert not {p.question for p in train} & {p.question for p in held}
    for p in [*train, *held]:
        assert int(p.answer) >= 0 and math_verifier("", f"so #### {p.answer}", p.meta()) == 1.0
    rows = [json.loads(line) for line in samples.NAMED["gsm8k-sample"].train.read_text().splitlines()]
    for row in rows:  # every calculator annotation <<a op b=c>> is right
        for expr, value in re.findall(r"<<([^=]+)=([^>]+)>>", row["answer"]):
            assert eval(expr) == int(value), row  # noqa: S307 (our own file, digits and + - * /)
    own = data.load(cfg(dataset="gsm8k-sample", eval_fraction=0.2), tokenizer, log=quiet)
    assert len(own.order) + len(own.held_out) == 320
    assert data.absolute_paths(cfg(dataset="gsm8k-sample")).dataset == "gsm8k-sample"

    spec = importlib.util.spec_from_file_location("make_sample",
                                                  Path(__file__).parents[1] / "scripts" / "make_gsm8k_sample.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "OUT", tmp_path)
    script.main()
    for sample_file in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / sample_file).read_bytes() == (samples.HERE / "gsm8k_sample" / sample_file).read_bytes()


def test_an_eval_fraction_that_leaves_a_side_empty_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows()[:2], GSM8K)
    fraction = 0.999  # both prompts of this file hash below it
    assert all(data.held_out(r["question"], fraction) for r in gsm8k_rows()[:2])
    with pytest.raises(DataError, match=r"--eval-fraction 0.999 leaves 0 training and 2 held-out"):
        data.read(cfg(dataset=str(path), eval_fraction=fraction), log=quiet)


@pytest.mark.parametrize("kwargs, message", [
    ({"eval_fraction": 0.1}, "need dataset"),
    ({"dataset": "x", "eval_fraction": 0.1, "eval_dataset": "y"}, "not both"),
    ({"dataset": "x", "eval_fraction": 1.0}, r"\[0, 1\)"),
    ({"prompt_template": "no placeholder"}, "must contain {question}"),
    ({"system_prompt": "be brief"}, "needs chat_template"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
    ({"answer_field": ""}, "must not be empty"),
])
def test_data_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**kwargs)


# --------------------------------------------------------------------------- prompts

def test_builtin_task_is_a_lazy_stream_by_default(tokenizer):
    c = cfg(steps=3, prompts_per_step=4, eval_size=5)
    run = data.load(c, tokenizer, log=quiet)
    assert run.order.problems == tasks.TrainProblems(size=12, seed=1, levels=(1, 2, 3))
    assert [run.order.problem(i) for i in range(12)] == [tasks.train_problem(i, seed=1) for i in range(12)]
    assert [p.level for p in run.order.problems[:6]] == [1, 2, 3, 1, 2, 3]
    assert all(tasks.split_of(p.question) == "train" for p in run.order.problems)
    assert run.held_out == tasks.make_split("eval", 5, seed=0)
    assert [run.order.problem(i) for i in range(14)] == [run.order.problems[i % 12] for i in range(14)]
    q = run.held_out[0].question
    assert run.format_prompt(q) == tasks.format_prompt(q)


def test_builtin_problem_i_is_made_without_the_ones_before_it(tokenizer):
    """--steps 10**9 starts as fast as --steps 3: the stream makes problem i from the seed
    and i alone, so the last slot of a billion-step run is reached without drawing the
    others, and a fresh stream gives it whatever was drawn before."""
    c = cfg(steps=10**9, prompts_per_step=16, eval_size=5)
    run = data.load(c, tokenizer, log=quiet)
    last = 10**9 * 16 - 1
    assert len(run.order) == 10**9 * 16 and run.counts[names.DATA_TRAIN_PROBLEMS] == 10**9 * 16
    fresh = tasks.TrainProblems(size=10**9 * 16, seed=1)
    assert fresh[last] == run.order.problem(last) == tasks.train_problem(last, seed=1)
    assert [fresh[i] for i in (7, 3, 7)] == [tasks.train_problem(i, seed=1) for i in (7, 3, 7)]
    # The fingerprint pins the stream by its definition and first prompts, not its length:
    # another --steps is the same stream (a resume may add steps), another seed is not.
    assert data.load(cfg(steps=3, prompts_per_step=16, eval_size=5), tokenizer, log=quiet).fingerprint \
        == run.fingerprint
    assert data.load(cfg(steps=3, prompts_per_step=16, eval_size=5, seed=1), tokenizer, log=quiet).fingerprint \
        != run.fingerprint


def test_builtin_resume_position_restores_the_same_prompts(tokenizer):
    whole = data.load(cfg(steps=1000, prompts_per_step=4), tokenizer, log=quiet).order
    first = data.load(cfg(steps=1000, prompts_per_step=4), tokenizer, log=quiet).order
    first.take(37)
    resumed = data.load(cfg(steps=2000, prompts_per_step=4), tokenizer, log=quiet).order  # more --steps
    resumed.load_state_dict(first.state_dict())
    assert resumed.take(9) == [whole.problem(i) for i in range(37, 46)]


def test_builtin_prompts_longer_than_the_limit_are_refused(tokenizer):
    with pytest.raises(DataError, match=r"the built-in task: --max-prompt-tokens 5 is below its prompts' length"):
        data.load(cfg(steps=3, max_prompt_tokens=5), tokenizer, log=quiet)


def test_prompt_template_and_its_newline_escape(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS, MATH)
    template = r"Problem: {question}\nPut the answer in \boxed{}.\nSolution:"
    c = cfg(dataset=str(path), prompt_field="problem", answer_field="solution", answer_format="math",
            prompt_template=template)
    run = data.load(c, tokenizer, log=quiet)
    assert run.format_prompt("What?") == "Problem: What?\nPut the answer in \\boxed{}.\nSolution:"
    # Read back from the published JSON, the config is the same.
    assert TrainerConfig(**json.loads(json.dumps(c.__dict__))) == c


@pytest.fixture()
def chat_tokenizer(tokenizer):
    tok = build_tokenizer(tasks.corpus(0, n=200) + ["<|user|><|system|><|assistant|>"])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def test_chat_template_with_a_system_prompt(tmp_path, chat_tokenizer, tokenizer):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(), GSM8K)
    c = cfg(dataset=str(path), chat_template=True, system_prompt="Answer after ####.")
    run = data.load(c, chat_tokenizer, log=quiet)
    assert run.format_prompt("How many?") == "<s><|system|>Answer after ####.\n<|user|>How many?\n<|assistant|>"
    ids = encode_prompts(chat_tokenizer, [run.format_prompt("How many?")])[0]
    assert ids.count(chat_tokenizer.bos_token_id) == 1 and ids[0] == chat_tokenizer.bos_token_id
    without_system = data.load(cfg(dataset=str(path), chat_template=True), chat_tokenizer, log=quiet)
    assert without_system.format_prompt("Hi?") == "<s><|user|>Hi?\n<|assistant|>"
    assert run.fingerprint != without_system.fingerprint
    with pytest.raises(ValueError, match="has no chat template"):
        data.load(cfg(dataset=str(path), chat_template=True), tokenizer, log=quiet)


def test_long_prompts_are_skipped_and_counted_never_truncated(tmp_path, tokenizer):
    rows = gsm8k_rows()[:6]
    rows[2] = {**rows[2], "question": "How many? " + "Ava has apples. " * 40}
    rows[4] = {**rows[4], "question": "How many? " + "Ben has books. " * 60}
    path = write_jsonl(tmp_path / "g.jsonl", rows, GSM8K)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [tasks.format_prompt(r["question"]) for r in rows])]
    limit = sorted(lengths)[-3]  # the two long ones are over it
    lines: list[str] = []
    run = data.load(cfg(dataset=str(path), max_prompt_tokens=limit), tokenizer, log=lines.append)
    assert [p.question for p in run.order.problems] == [r["question"] for i, r in enumerate(rows) if i not in (2, 4)]
    assert run.counts[names.DATA_SKIPPED_LONG_PROMPTS] == 2
    assert any(f"skipped 2 prompts longer than --max-prompt-tokens {limit}" in line
               and f"the longest has {max(lengths)} tokens" in line for line in lines)
    with pytest.raises(DataError, match=r"every training prompt is longer than --max-prompt-tokens 3 "
                                        rf"\(the shortest has {min(lengths)} tokens\)"):
        data.load(cfg(dataset=str(path), max_prompt_tokens=3), tokenizer, log=quiet)


def test_the_prompt_limit_is_capped_by_the_policys_context(tmp_path, tokenizer):
    """--max-prompt-tokens 512 with a policy of 64 positions and --max-new-tokens 16: prompts
    are measured against 48, said once; a policy with room keeps the flag as given."""
    save_policy(tiny_llama(), tokenizer, tmp_path / "tiny")
    lines: list[str] = []
    capped = data.fit_prompt_budget(cfg(max_prompt_tokens=512), GeneratorConfig(max_new_tokens=16),
                                    tmp_path / "tiny", log=lines.append)
    assert capped.max_prompt_tokens == 48
    assert lines == ["--max-prompt-tokens 512 capped to 48: the policy's context is 64 tokens, less "
                     "--max-new-tokens 16; longer prompts are skipped and counted"]
    assert data.fit_prompt_budget(cfg(max_prompt_tokens=40), GeneratorConfig(max_new_tokens=16),
                                  tmp_path / "tiny", log=lines.append).max_prompt_tokens == 40
    assert len(lines) == 1
    with pytest.raises(ConfigError, match="--max-new-tokens 64 leaves no room for a prompt in the policy's "
                                          "context of 64 tokens"):
        data.fit_prompt_budget(cfg(), GeneratorConfig(max_new_tokens=64), tmp_path / "tiny", log=quiet)


# --------------------------------------------------------------------------- order

def _problems(n: int) -> list[tasks.Problem]:
    return [tasks.Problem(question=f"q{i}", answer=str(i), solution=f"#### {i}", level=0) for i in range(n)]


def test_order_is_a_new_permutation_every_epoch_and_deterministic():
    problems = _problems(20)
    order = data.ProblemOrder(problems, seed=3, shuffle=True)
    epochs = [[order.index(e * 20 + i) for i in range(20)] for e in range(3)]
    assert all(sorted(e) == list(range(20)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(20))
    again = data.ProblemOrder(problems, seed=3, shuffle=True)
    assert [again.index(i) for i in reversed(range(60))] == [i for e in epochs for i in e][::-1]
    other = data.ProblemOrder(problems, seed=4, shuffle=True)
    assert [other.index(i) for i in range(20)] != epochs[0]
    assert [data.ProblemOrder(problems, seed=3, shuffle=False).index(i) for i in range(25)] == \
        list(range(20)) + list(range(5))


def test_order_take_position_and_state():
    problems = _problems(10)
    order = data.ProblemOrder(problems, seed=0, shuffle=True)
    first = order.take(7) + order.take(7)
    assert (order.position, order.epoch) == (14, 1)
    assert first == [order.problem(i) for i in range(14)]
    state = json.loads(json.dumps(order.state_dict()))  # JSON-able, as a checkpoint stores it
    resumed = data.ProblemOrder(problems, seed=0, shuffle=True)
    resumed.load_state_dict(state)
    assert resumed.take(9) == order.take(9)
    for key, value in (("seed", 1), ("size", 11), ("shuffle", False), ("position", -1)):
        with pytest.raises(ValueError, match=key):
            resumed.load_state_dict({**state, key: value})


def test_order_is_lazy_for_long_runs():
    order = data.ProblemOrder(_problems(1000), seed=0, shuffle=True)
    slot = 100_000 * 16  # --steps 100000: epoch 1600, made when asked for, alone
    assert order.problem(slot) == order.problems[order.index(slot)]
    order.problem(slot + 1000)
    order.problem(slot + 2000)
    assert sorted(order._perms) == [1601, 1602]  # only the last two epochs used are kept


def test_dataset_order_follows_the_seed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(), GSM8K)
    a = data.load(cfg(dataset=str(path), seed=1), tokenizer, log=quiet)
    b = data.load(cfg(dataset=str(path), seed=1), tokenizer, log=quiet)
    c = data.load(cfg(dataset=str(path), seed=2), tokenizer, log=quiet)
    first = [a.order.problem(i).question for i in range(24)]
    assert first == [b.order.problem(i).question for i in range(24)]
    assert first != [c.order.problem(i).question for i in range(24)]
    assert sorted(first) == sorted(r["question"] for r in gsm8k_rows())
    assert a.fingerprint == b.fingerprint == c.fingerprint  # the order is not part of the data


# --------------------------------------------------------------------------- same data in every role

def test_fingerprint_covers_rows_mapping_and_prompts(tmp_path, tokenizer):
    rows = gsm8k_rows()
    path = write_jsonl(tmp_path / "g.jsonl", rows, GSM8K)
    base = data.load(cfg(dataset=str(path)), tokenizer, log=quiet).fingerprint
    same_rows_as_parquet = write_parquet(tmp_path / "g.parquet", rows, GSM8K)
    assert data.load(cfg(dataset=str(same_rows_as_parquet)), tokenizer, log=quiet).fingerprint == base
    changed = write_jsonl(tmp_path / "h.jsonl", [{**rows[0], "answer": "#### 37"}] + rows[1:], GSM8K)
    assert data.load(cfg(dataset=str(changed)), tokenizer, log=quiet).fingerprint != base
    assert data.load(cfg(dataset=str(path), answer_format="plain"), tokenizer, log=quiet).fingerprint != base
    assert data.load(cfg(dataset=str(path), prompt_template="{question}"), tokenizer, log=quiet).fingerprint != base
    assert data.load(cfg(dataset=str(path), eval_fraction=0.2), tokenizer, log=quiet).fingerprint != base


@pytest.fixture()
def store():
    return transport.host_store(0, None, timeout_s=30, bind="127.0.0.1")


def test_a_generator_with_other_data_fails_naming_both(tmp_path, tokenizer, store):
    rows = gsm8k_rows()
    trainer_file = write_jsonl(tmp_path / "train.jsonl", rows, GSM8K)
    other_file = write_jsonl(tmp_path / "other.jsonl", rows[:-1], GSM8K)
    trainer_data = data.load(cfg(dataset=str(trainer_file)), tokenizer, log=quiet)
    generator_data = data.load(cfg(dataset=str(other_file)), tokenizer, log=quiet)
    with runtime.Runtime.join("trainer", 0, store, TEST_SECRET) as trainer:
        data.publish(trainer.signed, trainer_data)
        with pytest.raises(data.DataMismatch) as e:
            with runtime.Runtime.join("generator", 0, store, TEST_SECRET) as generator:
                data.check_published(generator, generator_data, timeout_s=10)
        message = str(e.value)
        assert (f"trainer/0: fingerprint {trainer_data.fingerprint[:16]}: {trainer_file} (24 training "
                f"problems)") in message
        assert (f"generator/0: fingerprint {generator_data.fingerprint[:16]}: {other_file} (23 training "
                f"problems)") in message
        assert "same path (SLURM: a shared file system; Kubernetes: the image or a shared volume)" in message
        # The failed generator stopped the run: the trainer's wait ends with its reason.
        with pytest.raises(transport.Stopped, match="generator/0 failed: llamarl.app.data.sources.DataMismatch: generator/0 "
                                                    "read other prompts than the trainer; every role"):
            data.wait_for_checks(trainer, ["generator/0"], timeout_s=10)


def test_generators_with_the_same_data_are_waited_for(tmp_path, tokenizer, store):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(), GSM8K)
    same = data.load(cfg(dataset=str(path)), tokenizer, log=quiet)
    with runtime.Runtime.join("trainer", 0, store, TEST_SECRET) as trainer:
        data.publish(trainer.signed, same)
        with pytest.raises(TimeoutError, match="no dataset check from generator/0, generator/1"):
            data.wait_for_checks(trainer, ["generator/0", "generator/1"], timeout_s=0.2)
        for replica in (0, 1):
            with runtime.Runtime.join("generator", replica, store, TEST_SECRET) as generator:
                data.check_published(generator, data.load(cfg(dataset=str(path)), tokenizer, log=quiet),
                                     timeout_s=10)
        data.wait_for_checks(trainer, ["generator/0", "generator/1"], timeout_s=10)
        assert not trainer.control.stopped()


def test_absolute_paths_are_published(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = data.absolute_paths(cfg(dataset="train.jsonl", eval_dataset="sub/test.jsonl"))
    assert (c.dataset, c.eval_dataset) == (str(tmp_path / "train.jsonl"), str(tmp_path / "sub" / "test.jsonl"))
    assert data.absolute_paths(cfg()).dataset == ""
