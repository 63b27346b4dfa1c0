"""GSM8K-style arithmetic word problems with a verifiable numeric answer.

Pure: no torch, no process groups. A problem is a short story whose answer takes one to
three arithmetic steps (its *level*). Worked solutions follow GSM8K's format: one
calculation per line, then ``#### <number>`` as the last line.

Splits are deterministic from a seed and disjoint: a problem belongs to ``eval`` when a
stable hash of its question falls in the eval bucket, to ``train`` otherwise, so the same
question can never appear in both whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from llamarl.app.tasks import answers

Split = Literal["train", "eval"]

NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea",
         "Max", "Nia", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tia")
ITEMS = ("apples", "books", "coins", "pens", "stamps", "shells", "cards", "eggs", "cups", "rocks",
         "balls", "kites")
CONTAINERS = ("boxes", "bags", "jars", "baskets", "shelves")

_SINGULAR = {"apples": "apple", "books": "book", "coins": "coin", "pens": "pen", "stamps": "stamp",
             "shells": "shell", "cards": "card", "eggs": "egg", "cups": "cup", "rocks": "rock",
             "balls": "ball", "kites": "kite"}

EVAL_BUCKETS = 10  # one bucket in ten of the hash space is held out for evaluation

_PRONOUN = {name: ("She" if name in {"Ava", "Cara", "Fay", "Hana", "Lea", "Nia", "Pia", "Rosa",
                                     "Tia", "Jo"} else "He") for name in NAMES}


@dataclass(frozen=True)
class Problem:
    """A prompt's question and its reference answer: one of the built-in task's, or one
    row of a dataset file (``llamarl.app.data.datafile``: ``level`` 0, ``answer`` the reference text
    its ``answer_format`` extraction read)."""

    question: str
    answer: int | str
    solution: str
    """Worked steps, one per line, ending with ``#### <answer>`` (a dataset row: its
    answer field as it is)."""
    level: int
    """Arithmetic steps of a built-in problem; 0 for a dataset row."""
    answer_format: str = "gsm8k"
    """How ``solution`` holds the reference (``llamarl.app.tasks.answers.ANSWER_FORMATS``)."""

    def meta(self) -> dict[str, Any]:
        """The rollout's ``task`` dict, which reward functions get as ``meta``."""
        return {"answer": self.answer, "answer_format": self.answer_format,
                "solution": self.solution, "level": self.level}


def _step_add(rng: random.Random, who: str, item: str, have: int) -> tuple[str, str, int]:
    n = rng.randint(1, 9)
    return f"{_PRONOUN[who]} gets {n} more {item}.", f"{have}+{n}={have + n}", have + n


def _step_sub(rng: random.Random, who: str, item: str, have: int) -> tuple[str, str, int]:
    n = rng.randint(1, min(9, have - 1))
    noun = item if n > 1 else _SINGULAR.get(item, item)
    return f"{_PRONOUN[who]} gives away {n} {noun}.", f"{have}-{n}={have - n}", have - n


def _step_mul(rng: random.Random, who: str, item: str, have: int) -> tuple[str, str, int]:
    n = rng.randint(2, 3)
    return f"{_PRONOUN[who]} ends up with {n} times as many {item}.", f"{have}*{n}={have * n}", have * n


def make_problem(rng: random.Random, level: int) -> Problem:
    """One problem of ``level`` steps (1, 2 or 3)."""
    if level not in (1, 2, 3):
        raise ValueError(f"level must be 1, 2 or 3, got {level}")
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.3:
        boxes, per = rng.randint(2, 5), rng.randint(2, 9)
        container = rng.choice(CONTAINERS)
        have = boxes * per
        story = [f"{who} has {boxes} {container} with {per} {item} in each."]
        lines = [f"{boxes}*{per}={have}"]
    else:
        have = rng.randint(2, 20)
        story, lines = [f"{who} has {have} {item}."], []
    ops = (_step_add, _step_sub, _step_mul)
    for _ in range(level - len(lines)):
        # Multiplication only on small totals keeps every answer below 200; nothing can be
        # given away from fewer than two.
        allowed = ops if have <= 30 else ops[:2]
        op = rng.choice(allowed if have >= 2 else (_step_add, _step_mul))
        sentence, line, have = op(rng, who, item, have)
        story.append(sentence)
        lines.append(line)
    question = " ".join(story) + f" How many {item} does {who} have now?"
    solution = "\n".join(lines + [f"#### {have}"])
    return Problem(question=question, answer=have, solution=solution, level=level)


def split_of(question: str) -> Split:
    digest = hashlib.sha256(question.encode()).digest()
    return "eval" if digest[0] % EVAL_BUCKETS == 0 else "train"


def make_split(split: Split, n: int, *, seed: int, levels: Sequence[int] = (1, 2, 3)) -> list[Problem]:
    """``n`` distinct problems of ``split``, levels in turn, deterministic from ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not levels:
        raise ValueError("levels must not be empty")
    rng = random.Random(f"{seed}/{split}")
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise ValueError(f"could not draw {n} distinct {split} problems at levels {list(levels)}")
        p = make_problem(rng, levels[len(out) % len(levels)])
        if p.question in seen or split_of(p.question) != split:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def train_problem(index: int, *, seed: int, levels: Sequence[int] = (1, 2, 3)) -> Problem:
    """Problem ``index`` of the lazy training stream: drawn from a generator seeded by
    ``seed`` and ``index`` alone (no other problem is drawn to make it), at level
    ``levels[index % len(levels)]``, from the ``train`` side of the split. Unlike
    ``make_split`` the stream does not remove repeats (that needs every earlier problem):
    a story may come back, as problems do when a dataset is used for several epochs."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if not levels:
        raise ValueError("levels must not be empty")
    rng = random.Random(f"{seed}/train/{index}")
    level = levels[index % len(levels)]
    while True:  # nine draws in ten are on the train side: a few tries at most
        p = make_problem(rng, level)
        if split_of(p.question) == "train":
            return p


@dataclass(frozen=True)
class TrainProblems(Sequence[Problem]):
    """The built-in task's training problems ``0..size-1``, each made when asked for
    (``train_problem``): a run of a billion steps costs nothing until it samples."""

    size: int
    seed: int
    levels: tuple[int, ...] = (1, 2, 3)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not self.levels:
            raise ValueError("levels must not be empty")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(f"problem {index} of {self.size}")
        return train_problem(index % self.size, seed=self.seed, levels=self.levels)


# ---- prompt format and verifier ------------------------------------------------------

PROMPT_TEMPLATE = "Q: {question}\nA:"


def format_prompt(question: str) -> str:
    return PROMPT_TEMPLATE.format(question=question)


def format_completion(problem: Problem) -> str:
    """What the policy should write after the prompt (the SFT target)."""
    return " " + problem.solution


def format_shortcut_completion(problem: Problem) -> str:
    """A plausible but wrong worked solution: the first step, then its result as the
    answer. The warm start mixes these in to play an imperfect instruct model."""
    first = problem.solution.splitlines()[0]
    return f" {first}\n#### {first.rsplit('=', 1)[1]}"


def extract_answer(text: object) -> float | None:
    """The number after the last ``####`` marker, or None. Never raises."""
    found = answers.hash_answer(text)
    try:
        return float(found.replace(",", "")) if found is not None else None
    except (ValueError, OverflowError):
        return None


def is_correct(completion: object, reference: object) -> bool:
    """True when the number after the completion's last ``####`` equals ``reference``
    (``llamarl.app.tasks.answers.equal``: by value, ``5.0`` and ``1,000`` as expected). Never raises."""
    return answers.is_correct(completion, reference, marker="hash")


def has_format(completion: object) -> bool:
    """True when the completion ends with a well-formed ``#### <number>`` line."""
    if not isinstance(completion, str):
        return False
    last = completion.strip().splitlines()[-1:] or [""]
    return bool(re.fullmatch(r"####\s*-?[\d,]*\.?\d+", last[0].strip()))


def corpus(seed: int = 0, n: int = 3000) -> list[str]:
    """Text covering the task's alphabet and vocabulary, for building the tokenizer."""
    rng = random.Random(f"{seed}/corpus")
    texts = [format_prompt(p.question) + format_completion(p)
             for p in (make_problem(rng, 1 + i % 3) for i in range(n))]
    texts.append(" ".join(NAMES + ITEMS + CONTAINERS))
    return texts
