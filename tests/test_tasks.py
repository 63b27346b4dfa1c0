"""The task generator, its splits and the answer verifier (pure Python, fast)."""

from __future__ import annotations

import operator
import random
import re

import pytest

from llamarl.app.tasks import arithmetic as tasks

_LINE_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _check_solution(p: tasks.Problem) -> None:
    """Recompute the worked solution: every line's arithmetic, the chain from one line to
    the next, the final answer and the level."""
    *steps, last = p.solution.split("\n")
    assert last == f"#### {p.answer}"
    assert len(steps) == p.level
    results = []
    for line in steps:
        m = _LINE_RE.fullmatch(line)
        assert m, f"malformed step {line!r} in {p.solution!r}"
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert _OPS[op](a, b) == c, line
        if results:  # each step starts from the previous total
            assert a == results[-1], p.solution
        results.append(c)
    assert results[-1] == p.answer


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_match_solutions(split):
    for p in tasks.make_split(split, 300, seed=3):
        _check_solution(p)


def test_answers_are_non_negative_counts():
    assert min(p.answer for p in tasks.make_split("train", 20000, seed=0)) >= 0


def test_make_problem_levels():
    rng = random.Random(0)
    for level in (1, 2, 3):
        for _ in range(50):
            p = tasks.make_problem(rng, level)
            assert p.level == level
            _check_solution(p)
    with pytest.raises(ValueError, match="level"):
        tasks.make_problem(rng, 4)


def test_splits_deterministic_from_seed():
    a = tasks.make_split("train", 100, seed=7)
    b = tasks.make_split("train", 100, seed=7)
    c = tasks.make_split("train", 100, seed=8)
    assert a == b
    assert a != c
    assert len({p.question for p in a}) == 100  # distinct within a split


def test_train_and_eval_disjoint_whatever_the_seeds():
    train = {p.question for seed in (0, 1) for p in tasks.make_split("train", 500, seed=seed)}
    held_out = [p.question for seed in (0, 2) for p in tasks.make_split("eval", 200, seed=seed)]
    assert train.isdisjoint(held_out)
    assert all(tasks.split_of(q) == "eval" for q in held_out)
    assert all(tasks.split_of(q) == "train" for q in train)


def test_levels_honoured_in_turn():
    only2 = tasks.make_split("eval", 20, seed=0, levels=(2,))
    assert {p.level for p in only2} == {2}
    mixed = tasks.make_split("train", 12, seed=0, levels=(1, 3))
    assert [p.level for p in mixed] == [1, 3] * 6


def test_make_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        tasks.make_split("test", 5, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="levels"):
        tasks.make_split("train", 5, seed=0, levels=())


def test_gsm8k_format():
    for p in tasks.make_split("train", 30, seed=0):
        completion = tasks.format_completion(p)
        assert completion.startswith(" ")
        assert completion.splitlines()[-1] == f"#### {p.answer}"
        assert tasks.has_format(completion)
        assert tasks.is_correct(completion, p.answer)
        prompt = tasks.format_prompt(p.question)
        assert prompt.startswith("Q: ") and prompt.endswith("\nA:")
        assert p.question.endswith("have now?")


def test_shortcut_completion_answers_the_first_step():
    problems = tasks.make_split("train", 60, seed=0)
    for p in problems:
        shortcut = tasks.format_shortcut_completion(p)
        first = p.solution.splitlines()[0]
        assert shortcut == f" {first}\n#### {first.rsplit('=', 1)[1]}"
        assert tasks.has_format(shortcut)
        if p.level == 1:
            assert shortcut == tasks.format_completion(p)
    # for multi-step problems the shortcut is (almost always) wrong: that is its point
    wrong = [not tasks.is_correct(tasks.format_shortcut_completion(p), p.answer)
             for p in problems if p.level > 1]
    assert sum(wrong) >= 0.9 * len(wrong)


# ---- verifier ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("14+9=23\n#### 23", 23.0),
    ("#### 1,234", 1234.0),
    ("#### -7", -7.0),
    ("####-7", -7.0),
    ("#### 3.50", 3.5),
    ("#### .5", 0.5),
    ("#### 1\nthen\n#### 2", 2.0),  # the last marker wins
    ("#### 1 #### 2 #### 3", 3.0),
    ("答案 ✓ #### 42 🎉", 42.0),
    ("####", None),
    ("#### ", None),
    ("#### abc", None),
    ("the answer is 5", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert tasks.extract_answer(text) == expected


@pytest.mark.parametrize("garbage", [None, b"#### 5", 5, 5.0, ["#### 5"], {"a": 1}, object(),
                                     "#### " + "9" * 400, "#" * 10_000, "####" * 1000, "\x00\udcff#### 1"])
def test_verifier_never_raises_on_garbage(garbage):
    tasks.extract_answer(garbage)
    assert tasks.is_correct(garbage, 5) in (True, False)
    assert tasks.has_format(garbage) in (True, False)


def test_is_correct():
    assert tasks.is_correct(" 2+3=5\n#### 5", 5)
    assert tasks.is_correct("#### 5.0", 5)
    assert tasks.is_correct("#### 1,000", 1000)
    assert not tasks.is_correct("#### 6", 5)
    assert not tasks.is_correct("#### 5\n#### 6", 5)
    assert not tasks.is_correct(b"#### 5", 5)
    assert not tasks.is_correct(None, 5)
    assert not tasks.is_correct("#### " + "9" * 400, 5)  # overflows to inf, still just wrong
    assert not tasks.is_correct("#### 5", 10 ** 400)  # a reference too big for a float
    assert not tasks.is_correct("#### 5", "five")  # type: ignore[arg-type]


@pytest.mark.parametrize("text, expected", [
    (" 2+3=5\n#### 5", True),
    ("#### 5\n", True),
    ("#### -1,200.5", True),
    ("#### 5\nmore words", False),
    ("#### five", False),
    ("####", False),
    ("no marker", False),
    ("", False),
    (None, False),
])
def test_has_format(text, expected):
    assert tasks.has_format(text) is expected


def test_corpus_covers_the_vocabulary():
    text = "\n".join(tasks.corpus(seed=0, n=50))
    for word in tasks.NAMES + tasks.ITEMS + tasks.CONTAINERS + ("####", "Q:", "A:"):
        assert word in text
