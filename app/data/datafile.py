"""Reading a dataset file into problems: JSONL, Parquet, or a Hugging Face ``datasets``
``save_to_disk`` directory, with every bad input named before anything trains.

    rows = read_problems("train.jsonl", FieldMap(), on_bad_row="error")

Decisions:

- The format comes from the path: a directory is a ``save_to_disk`` directory;
  ``.jsonl``/``.ndjson``/``.json`` are JSON (one object per line, or for ``.json`` also one
  array of objects); ``.parquet``/``.pq`` Parquet. Any other name is read by its first
  bytes (``PAR1``: Parquet; ``{`` or ``[``: JSON), else refused as an unknown format.
- Only the two mapped fields are read (Parquet reads only those columns).
- A *file* error (missing, unknown format, not Parquet, no such column, no usable row)
  always stops. A *row* error (not valid UTF-8, not JSON, no question, no extractable
  reference) stops too, naming the row, unless ``on_bad_row="skip"``: then the row is
  left out and reported in ``Problems.skipped``. JSON rows are named by line (1-based, as
  editors number them), Parquet and ``datasets`` rows by index (0-based, as pandas and
  ``datasets`` do).
- A ``datasets`` directory needs the optional ``datasets`` package (``pip install
  'llamarl[data]'``); a ``DatasetDict`` (several splits) is refused with the split
  directories to choose from, rather than picking one silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llamarl.app.tasks import answers
from llamarl.app.tasks.arithmetic import Problem
from llamarl.app.errors import DataError

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
DATA_EXTRA = "pip install 'llamarl[data]'"



@dataclass(frozen=True)
class FieldMap:
    """Which fields hold the question and the reference, and how the reference is written."""

    prompt_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "gsm8k"

    def __post_init__(self) -> None:
        if self.answer_format not in answers.ANSWER_FORMATS:
            raise ValueError(f"answer format must be one of {answers.ANSWER_FORMATS}, got {self.answer_format!r}")


@dataclass
class Problems:
    """What one file gave: its problems in file order, and the rows left out."""

    path: Path
    problems: list[Problem]
    skipped: list[str] = field(default_factory=list)
    """``"<file>, line 7: <why>"`` for every row skipped under ``on_bad_row="skip"``."""


def read_problems(path: str | Path, fields: FieldMap, *, on_bad_row: str = "error") -> Problems:
    """Every row of ``path`` as a ``Problem`` (``level`` 0, ``answer`` the extracted
    reference, ``solution`` the answer field as it is). Raises ``DataError``."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    out = Problems(path=path, problems=[])
    for where, record in _records(path, fields):
        try:
            out.problems.append(_problem(record, fields))
        except _BadRow as e:
            message = f"{path}, {where}: {e}"
            if on_bad_row == "error":
                raise DataError(f"{message} (--on-bad-row skip leaves such rows out)") from None
            out.skipped.append(message)
    if not out.problems:
        why = f"; every row was bad, the first: {out.skipped[0]}" if out.skipped else ""
        raise DataError(f"{path}: empty dataset, no usable row{why}")
    return out


class _BadRow(Exception):
    pass


def _problem(record: dict[str, Any] | _BadRow, fields: FieldMap) -> Problem:
    if isinstance(record, _BadRow):
        raise record
    for name in (fields.prompt_field, fields.answer_field):
        if name not in record:
            raise _BadRow(f"no field {name!r} (it has {sorted(record)}; see --prompt-field, --answer-field)")
    question, raw = record[fields.prompt_field], record[fields.answer_field]
    if not isinstance(question, str) or not question.strip():
        raise _BadRow(f"field {fields.prompt_field!r} is not a non-empty text (got {_short(question)})")
    reference = answers.reference_answer(raw, fields.answer_format)
    if reference is None:
        how = {"gsm8k": "no number after '####'", "math": "no closed \\boxed{...}",
               "plain": "empty or not text/number"}[fields.answer_format]
        raise _BadRow(f"cannot extract the reference from field {fields.answer_field!r} with "
                      f"--answer-format {fields.answer_format}: {how} (got {_short(raw)})")
    return Problem(question=question, answer=reference, solution=raw if isinstance(raw, str) else str(raw),
                   level=0, answer_format=fields.answer_format)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- formats

def _records(path: Path, fields: FieldMap) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    """``(where, record)`` for every row; a row that cannot be read is a ``_BadRow``."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        yield from _hf_records(path, fields)
        return
    kind = _kind(path)
    if kind == "parquet":
        yield from _parquet_records(path, fields)
    else:
        yield from _json_records(path)


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.lstrip()[:1] in (b"{", b"["):
        return "json"
    raise DataError(f"{path}: unknown format: expected JSON lines (.jsonl), JSON (.json), Parquet "
                    f"(.parquet) or a Hugging Face datasets save_to_disk directory")


def _json_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    with path.open("rb") as f:
        head = f.read(4096)
        if path.suffix.lower() not in (".jsonl", ".ndjson") and head.lstrip()[:1] == b"[":
            yield from _json_array(path, head + f.read())
            return
        f.seek(0)
        yield from _json_lines(f)


def _json_lines(f: Any) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    """Line by line, never the whole file in memory at once."""
    for number, line in enumerate(f, start=1):
        where = f"line {number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield where, _BadRow(f"not valid UTF-8 (byte {e.start} of the line: {line[e.start:e.start + 1]!r})")
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield where, _BadRow(f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield where, record if isinstance(record, dict) else _BadRow(
            f"not a JSON object (a {type(record).__name__})")


def _json_array(path: Path, data: bytes) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    for i, record in enumerate(rows):
        yield f"element {i}", record if isinstance(record, dict) else _BadRow(
            f"not a JSON object (a {type(record).__name__})")


def _columns(path: Path, have: list[str], fields: FieldMap) -> list[str]:
    wanted = list(dict.fromkeys([fields.prompt_field, fields.answer_field]))
    missing = [name for name in wanted if name not in have]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {have}; see --prompt-field, "
                        f"--answer-field)")
    return wanted


def _column_records(columns: dict[str, list[Any]]) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    names = list(columns)
    for i, values in enumerate(zip(*columns.values())):
        record: dict[str, Any] = {}
        for name, value in zip(names, values):
            if isinstance(value, bytes):  # a binary column: text only if it is UTF-8
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as e:
                    record = _BadRow(f"field {name!r} is not valid UTF-8 (byte {e.start})")  # type: ignore[assignment]
                    break
            record[name] = value
        yield f"row {i}", record


def _parquet_records(path: Path, fields: FieldMap) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        wanted = _columns(path, schema.names, fields)
        table = pq.read_table(path, columns=wanted)
    except (pyarrow.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({e})") from None
    yield from _column_records({name: table.column(name).to_pylist() for name in wanted})


def _hf_records(path: Path, fields: FieldMap) -> Iterator[tuple[str, dict[str, Any] | _BadRow]]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        example = "train" if "train" in splits or not splits else splits[0]
        raise DataError(f"{path}: a datasets DatasetDict with splits {splits}; give one split's "
                        f"directory, e.g. {path / example}")
    if not (path / "state.json").is_file():
        raise DataError(f"{path}: a directory that is not a Hugging Face datasets save_to_disk "
                        f"directory (no state.json)")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a Hugging Face datasets directory, and reading it needs the datasets "
                        f"package: {DATA_EXTRA}") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # the package's own errors for a damaged directory
        raise DataError(f"{path}: cannot load this datasets directory ({type(e).__name__}: {e})") from None
    wanted = _columns(path, list(ds.column_names), fields)
    table = ds.select_columns(wanted).with_format("arrow")[:]
    yield from _column_records({name: table.column(name).to_pylist() for name in wanted})
