"""Answer extraction and equality (app/tasks/answers.py) and the verifier rewards built on them:
every answer format, the equality table of docs/data.md row by row, and no exception on
whatever a policy writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llamarl.app.tasks import answers
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.rewards import Sample, build_reward
from llamarl.app.rewards.verifiers import boxed_verifier, gsm8k_verifier, math_verifier
from data_files import MATH_ROWS, gsm8k_rows

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def equality_table() -> list[tuple[str, str, bool]]:
    """The rows of docs/data.md's equality table, so that the doc cannot drift."""
    text = DOC.read_text()
    table = text.split("<!-- equality-table -->")[1].split("<!-- /equality-table -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        ref, ans, verdict = (re.fullmatch(r"`(.*)`", c)[1] if c.startswith("`") else c for c in cells)
        rows.append((ref, ans, {"yes": True, "no": False}[verdict]))
    return rows


TABLE = equality_table()


def test_the_doc_table_has_both_verdicts():
    assert len(TABLE) >= 20
    assert {v for _, _, v in TABLE} == {True, False}


@pytest.mark.parametrize("reference, answer, expected", TABLE)
def test_equality_table_of_the_docs(reference, answer, expected):
    assert answers.equal(reference, answer) is expected
    assert answers.equal(answer, reference) is expected  # symmetric
    # The same verdict from a completion, in a box or (a number) after ####.
    assert answers.is_correct(f"so $\\boxed{{{answer}}}$.", reference) is expected
    if re.fullmatch(r"-?[\d,]*\.?\d+", answer):
        assert answers.is_correct(f"so\n#### {answer}", reference) is expected


@pytest.mark.parametrize("row", gsm8k_rows(), ids=lambda r: r["reference"])
def test_gsm8k_references(row):
    ref = answers.reference_answer(row["answer"], "gsm8k")
    assert answers.equal(ref, row["reference"])
    assert tasks.is_correct(f" worked\n#### {row['reference']}", ref)


@pytest.mark.parametrize("row", MATH_ROWS, ids=lambda r: r["reference"])
def test_math_references_are_the_last_box_with_nested_braces(row):
    assert answers.reference_answer(row["solution"], "math") == row["reference"]


@pytest.mark.parametrize("value, expected", [
    ("72", "72"), ("  -3.5 ", "-3.5"), (72, "72"), (0.5, "0.5"), (r"\frac{1}{2}", r"\frac{1}{2}"),
    ("", None), ("   ", None), (None, None), (True, None), ([1], None),
])
def test_plain_references(value, expected):
    assert answers.reference_answer(value, "plain") == expected


@pytest.mark.parametrize("value, fmt", [
    ("The answer is 5.", "gsm8k"), ("#### five", "gsm8k"), (72, "gsm8k"),
    ("no box here", "math"), (r"\boxed{unclosed", "math"), (r"\boxed{ }", "math"), (None, "math"),
])
def test_unextractable_references(value, fmt):
    assert answers.reference_answer(value, fmt) is None


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="answer format"):
        answers.reference_answer("#### 5", "csv")


@pytest.mark.parametrize("text, marker, expected", [
    ("2+3=5\n#### 5", "any", "5"),
    (r"#### 5 but then \boxed{6}", "any", "6"),  # the later marker wins
    (r"\boxed{6} and finally #### 5", "any", "5"),
    (r"#### 5 but then \boxed{6}", "hash", "5"),
    (r"\boxed{6} and finally #### 5", "boxed", "6"),
    (r"\boxed{a} \boxed{b}", "any", "b"),
    (r"\fbox{7}", "boxed", "7"),
    (r"\boxed 9 is it", "boxed", "9"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", "any", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{\{1\}}", "any", r"\{1\}"),  # escaped braces are not nesting
    ("#### $1,000", "hash", "1,000"),
    (r"\boxed{5} then \boxed{unclosed", "any", "5"),
    ("no answer", "any", None),
])
def test_final_answer(text, marker, expected):
    assert answers.final_answer(text, marker) == expected


@pytest.mark.parametrize("garbage", [None, b"#### 5", 5, 5.0, ["#### 5"], object(), "#### " + "9" * 400,
                                     "\\boxed{" * 5000, "{" * 10_000 + "}", "####" * 1000,
                                     "\x00\udcff\\boxed{1}", "\\frac" * 1000, "\\frac{" * 100 + "1",
                                     "\\frac{" * 20_000, "\\boxed{" * 20_000 + "}"])
def test_nothing_raises_on_garbage(garbage):
    answers.final_answer(garbage)
    assert answers.is_correct(garbage, 5) in (True, False)
    assert answers.is_correct("#### 5", garbage) in (True, False)
    assert answers.equal(garbage, garbage) in (True, False)
    assert isinstance(answers.normalize(garbage), str)


def test_verifiers_differ_only_in_the_marker():
    meta = {"answer": r"\frac{5}{6}", "answer_format": "math"}
    boxed = r"so $\boxed{\dfrac{5}{6}}$"
    assert (math_verifier("", boxed, meta), boxed_verifier("", boxed, meta), gsm8k_verifier("", boxed, meta)) \
        == (1.0, 1.0, 0.0)
    meta = {"answer": "1250", "answer_format": "gsm8k"}
    hashed = "so\n#### 1,250"
    assert (math_verifier("", hashed, meta), boxed_verifier("", hashed, meta), gsm8k_verifier("", hashed, meta)) \
        == (1.0, 0.0, 1.0)
    assert math_verifier("", "#### 1249", meta) == 0.0


def test_math_verifier_keeps_scoring_the_builtin_task():
    for p in tasks.make_split("eval", 12, seed=3):
        right, shortcut = tasks.format_completion(p), tasks.format_shortcut_completion(p)
        for verifier in (math_verifier, gsm8k_verifier):
            assert verifier("", right, p.meta()) == 1.0
            assert verifier("", shortcut, p.meta()) == float(shortcut.endswith(f"#### {p.answer}"))
        assert boxed_verifier("", right, p.meta()) == 0.0


def test_verifiers_are_builtins_by_name():
    with build_reward("math_verifier,gsm8k_verifier,boxed_verifier=0") as reward:
        (result,) = reward.score([Sample(prompt="", completion=r"\boxed{3}", meta={"answer": "3"})])
    assert result.components == {"math_verifier": 1.0, "gsm8k_verifier": 0.0, "boxed_verifier": 1.0}


def test_a_unicode_minus_after_the_hash_marker_is_extracted_and_read_as_minus():
    """Typeset answers carry U+2212, not the ASCII hyphen-minus."""
    assert answers.is_correct("so she owes\n#### \u22123", "-3")
    assert answers.hash_answer("#### \u221212.5") is not None
    assert not answers.is_correct("#### \u22123", "3")


def test_a_multiple_choice_letter_is_the_same_in_parentheses_and_in_text():
    assert answers.is_correct("The answer is \\boxed{\\text{(A)}}", "A")
    assert answers.is_correct("\\boxed{(B)}", "B")
    assert not answers.is_correct("\\boxed{(B)}", "C")
    assert answers.normalize("(x)") == "(x)"  # a lower-case letter is an expression, not a choice
