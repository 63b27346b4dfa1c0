"""Reading dataset files (app/data/datafile.py): JSONL, JSON arrays, Parquet and datasets
directories in GSM8K, MATH and plain formats, and every bad input named by file and row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llamarl.app.data.datafile import FieldMap, read_problems
from llamarl.app.errors import DataError
from data_files import GSM8K, MATH, MATH_FIELDS, MATH_ROWS, gsm8k_rows, write_jsonl, write_parquet


# --------------------------------------------------------------------------- formats

def test_gsm8k_jsonl_and_parquet_read_the_same_problems(tmp_path):
    rows = gsm8k_rows()
    from_jsonl = read_problems(write_jsonl(tmp_path / "g.jsonl", rows, GSM8K), FieldMap())
    from_parquet = read_problems(write_parquet(tmp_path / "g.parquet", rows, GSM8K), FieldMap())
    assert from_jsonl.problems == from_parquet.problems
    assert [p.question for p in from_jsonl.problems] == [r["question"] for r in rows]  # file order
    assert [p.solution for p in from_jsonl.problems] == [r["answer"] for r in rows]
    for p, r in zip(from_jsonl.problems, rows):
        assert (p.level, p.answer_format) == (0, "gsm8k")
        assert p.answer.replace(",", "") == r["reference"]  # as written: "2,750"
    assert any("," in p.answer for p in from_jsonl.problems)
    assert from_jsonl.skipped == []


@pytest.mark.parametrize("write", [write_jsonl, write_parquet])
def test_math_format(tmp_path, write):
    path = write(tmp_path / f"m.{'jsonl' if write is write_jsonl else 'parquet'}", MATH_ROWS, MATH)
    problems = read_problems(path, MATH_FIELDS).problems
    assert [p.answer for p in problems] == [r["reference"] for r in MATH_ROWS]
    assert {p.answer_format for p in problems} == {"math"}


def test_plain_format_takes_numbers_and_text_as_written(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["one?", "two?"], "a": [72, 3]}), path)
    assert [p.answer for p in read_problems(path, FieldMap("q", "a", "plain")).problems] == ["72", "3"]
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "x?", "a": 0.5}\n{"q": "y?", "a": " Paris "}\n')
    assert [p.answer for p in read_problems(path, FieldMap("q", "a", "plain")).problems] == ["0.5", "Paris"]


def test_json_array_and_formats_by_content(tmp_path):
    rows = gsm8k_rows()[:3]
    expected = read_problems(write_jsonl(tmp_path / "g.jsonl", rows, GSM8K), FieldMap()).problems
    array = tmp_path / "g.json"
    array.write_text(json.dumps([{k: r[k] for k in GSM8K} for r in rows], indent=1))
    assert read_problems(array, FieldMap()).problems == expected
    no_suffix = tmp_path / "lines"
    no_suffix.write_bytes((tmp_path / "g.jsonl").read_bytes())
    assert read_problems(no_suffix, FieldMap()).problems == expected
    parquet_no_suffix = write_parquet(tmp_path / "table", rows, GSM8K)
    assert read_problems(parquet_no_suffix, FieldMap()).problems == expected


def test_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = gsm8k_rows()[:5]
    ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in GSM8K})
    ds.save_to_disk(str(tmp_path / "one"))
    expected = read_problems(write_jsonl(tmp_path / "g.jsonl", rows, GSM8K), FieldMap()).problems
    assert read_problems(tmp_path / "one", FieldMap()).problems == expected
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "both"))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['test', 'train'\].*both/train"):
        read_problems(tmp_path / "both", FieldMap())
    assert read_problems(tmp_path / "both" / "train", FieldMap()).problems == expected


def test_datasets_directory_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(DataError, match=r"ds: .*needs the datasets package: pip install 'llamarl\[data\]'"):
        read_problems(tmp_path / "ds", FieldMap())


# --------------------------------------------------------------------------- bad input

def _write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


GOOD = '{"question": "Q1?", "answer": "#### 1"}\n'


@pytest.mark.parametrize("name, content, fields, message", [
    ("none.jsonl", None, FieldMap(), r"none\.jsonl: no such file or directory"),
    ("notes.txt", "hello there", FieldMap(), r"notes\.txt: unknown format: expected JSON lines"),
    ("fake.parquet", "not parquet at all", FieldMap(), r"fake\.parquet: not a Parquet file"),
    ("empty.jsonl", "", FieldMap(), r"empty\.jsonl: empty dataset, no usable row$"),
    ("blank.jsonl", "\n  \n\n", FieldMap(), r"blank\.jsonl: empty dataset"),
    ("field.jsonl", GOOD + '{"prompt": "Q2?", "answer": "#### 2"}\n', FieldMap(),
     r"field\.jsonl, line 2: no field 'question' \(it has \['answer', 'prompt'\]"),
    ("ref.jsonl", GOOD * 2 + '{"question": "Q3?", "answer": "it is 3"}\n', FieldMap(),
     r"ref\.jsonl, line 3: cannot extract the reference from field 'answer' with --answer-format "
     r"gsm8k: no number after '####' \(got 'it is 3'\)"),
    ("box.jsonl", '{"problem": "P?", "solution": "\\\\boxed{unclosed"}\n', MATH_FIELDS,
     r"box\.jsonl, line 1: cannot extract .* --answer-format math: no closed \\boxed"),
    ("utf8.jsonl", GOOD.encode() + b'{"question": "caf\xe9?", "answer": "#### 2"}\n', FieldMap(),
     r"utf8\.jsonl, line 2: not valid UTF-8 \(byte 17 of the line"),
    ("json.jsonl", GOOD + '{"question": "Q2?", "answer": \n', FieldMap(), r"json\.jsonl, line 2: not valid JSON"),
    ("list.jsonl", GOOD + '["Q2?", "#### 2"]\n', FieldMap(), r"list\.jsonl, line 2: not a JSON object"),
    ("blankq.jsonl", '{"question": "  ", "answer": "#### 2"}\n', FieldMap(),
     r"blankq\.jsonl, line 1: field 'question' is not a non-empty text"),
    ("array.json", b'[{"question": "Q1?", "answer": "#### 1"},\n "x"]', FieldMap(),
     r"array\.json, element 1: not a JSON object"),
    ("bad.json", b'[{"question": "Q1?",\n "answer": }]', FieldMap(), r"bad\.json, line 2: not valid JSON"),
])
def test_bad_input_is_named_by_file_and_row(tmp_path, name, content, fields, message):
    path = tmp_path / name if content is None else _write(tmp_path, name, content)
    with pytest.raises(DataError, match=message):
        read_problems(path, fields)


def test_parquet_missing_column_and_null_row(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "solution": ["#### 1", "#### 2"]}), path)
    with pytest.raises(DataError, match=r"t\.parquet: no column 'answer' \(columns: \['question', 'solution'\]"):
        read_problems(path, FieldMap())
    pq.write_table(pa.table({"question": ["a?", None, "c?"], "answer": ["#### 1", "#### 2", "#### 3"]}), path)
    with pytest.raises(DataError, match=r"t\.parquet, row 1: field 'question' is not a non-empty text \(got None\)"):
        read_problems(path, FieldMap())
    pq.write_table(pa.table({"question": pa.array([b"a?", b"\xff?"], pa.binary()), "answer": ["#### 1", "#### 2"]}),
                   path)
    with pytest.raises(DataError, match=r"t\.parquet, row 1: field 'question' is not valid UTF-8"):
        read_problems(path, FieldMap())


def test_a_directory_that_is_not_a_dataset(tmp_path):
    with pytest.raises(DataError, match=r"not a Hugging Face datasets save_to_disk directory \(no state.json\)"):
        read_problems(tmp_path, FieldMap())


def test_skip_leaves_bad_rows_out_and_reports_them(tmp_path):
    path = _write(tmp_path, "mixed.jsonl", GOOD.encode() + b"\xff\n" + b'{"question": "Q?", "answer": "x"}\n'
                  + b'{"question": "Q4?", "answer": "#### 4"}\n')
    with pytest.raises(DataError, match="line 2: not valid UTF-8"):
        read_problems(path, FieldMap())
    out = read_problems(path, FieldMap(), on_bad_row="skip")
    assert [p.answer for p in out.problems] == ["1", "4"]
    assert [s.split(": ", 1)[0] for s in out.skipped] == [f"{path}, line 2", f"{path}, line 3"]
    every_row_bad = _write(tmp_path, "bad.jsonl", '{"question": "Q?", "answer": "x"}\n' * 3)
    with pytest.raises(DataError, match=r"empty dataset, no usable row; every row was bad, the first: .*line 1"):
        read_problems(every_row_bad, FieldMap(), on_bad_row="skip")
