"""Write the GSM8K-format sample that ships with llamarl (app/tasks/gsm8k_sample/).

    python scripts/make_gsm8k_sample.py            # rewrites train.jsonl and test.jsonl

Word problems of one to three steps of arithmetic on small numbers, each row
``{"question": ..., "answer": ...}`` with the answer written as GSM8K writes it: the
worked steps with ``<<a+b=c>>`` calculator annotations, then ``#### N``. Easy enough that
SmolLM2-135M-Instruct solves some of them greedily before any training (a sample it can
improve on in minutes on a CPU), unlike GSM8K itself. Deterministic: the templates and
the seed below make the same bytes every time; a question appears in one split only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 31
TRAIN_ROWS = 320
TEST_ROWS = 100
OUT = Path(__file__).resolve().parents[1] / "app" / "tasks" / "gsm8k_sample"

NAMES = [("Anna", "she"), ("Ben", "he"), ("Carla", "she"), ("David", "he"), ("Emma", "she"),
         ("Farid", "he"), ("Grace", "she"), ("Hugo", "he"), ("Ines", "she"), ("Jack", "he"),
         ("Lena", "she"), ("Marco", "he"), ("Nora", "she"), ("Omar", "he"), ("Priya", "she"),
         ("Sam", "he")]
THINGS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards", "stamps", "eggs"]


def _one_add(r: random.Random) -> tuple[str, list[str], int]:
    (n, p), t = r.choice(NAMES), r.choice(THINGS)
    a, b = r.randint(3, 40), r.randint(2, 30)
    return (f"{n} has {a} {t}. {p.capitalize()} gets {b} more {t}. How many {t} does {n} have now?",
            [f"{n} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {t} now."], a + b)


def _one_sub(r: random.Random) -> tuple[str, list[str], int]:
    (n, p), t = r.choice(NAMES), r.choice(THINGS)
    a = r.randint(10, 50)
    b = r.randint(2, a - 2)
    return (f"{n} had {a} {t} and gave {b} of them to a friend. How many {t} does {n} have left?",
            [f"{n} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {t} left."], a - b)


def _one_mul(r: random.Random) -> tuple[str, list[str], int]:
    t = r.choice(THINGS)
    a, b = r.randint(2, 12), r.randint(2, 10)
    return (f"Each box holds {a} {t}. How many {t} are in {b} boxes?",
            [f"{b} boxes hold {b} * {a} = <<{b}*{a}={a * b}>>{a * b} {t}."], a * b)


def _one_div(r: random.Random) -> tuple[str, list[str], int]:
    (n, p), t = r.choice(NAMES), r.choice(THINGS)
    a, b = r.randint(2, 10), r.randint(2, 8)
    return (f"{n} shares {a * b} {t} equally among {b} friends. How many {t} does each friend get?",
            [f"Each friend gets {a * b} / {b} = <<{a * b}/{b}={a}>>{a} {t}."], a)


def _two_buy_bags(r: random.Random) -> tuple[str, list[str], int]:
    (n, p), t = r.choice(NAMES), r.choice(THINGS)
    a, b, c = r.randint(2, 20), r.randint(2, 6), r.randint(2, 10)
    return (f"{n} has {a} {t}. {p.capitalize()} buys {b} bags with {c} {t} in each bag. "
            f"How many {t} does {n} have now?",
            [f"The bags hold {b} * {c} = <<{b}*{c}={b * c}>>{b * c} {t}.",
             f"{n} has {a} + {b * c} = <<{a}+{b * c}={a + b * c}>>{a + b * c} {t} now."], a + b * c)


def _two_earn_spend(r: random.Random) -> tuple[str, list[str], int]:
    n, p = r.choice(NAMES)
    a, b = r.randint(3, 12), r.randint(2, 7)
    c = r.randint(1, a * b - 1)
    return (f"{n} earns ${a} a day for {b} days and then spends ${c}. How many dollars does {n} have left?",
            [f"{n} earns {a} * {b} = <<{a}*{b}={a * b}>>{a * b} dollars.",
             f"{p.capitalize()} has {a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} dollars left."],
            a * b - c)


def _two_teams(r: random.Random) -> tuple[str, list[str], int]:
    c, k = r.randint(2, 6), r.randint(2, 8)
    a = r.randint(1, c * k - 1)
    b = c * k - a
    return (f"A class has {a} boys and {b} girls. The teacher splits the class into teams of {c}. "
            "How many teams are there?",
            [f"The class has {a} + {b} = <<{a}+{b}={c * k}>>{c * k} children.",
             f"There are {c * k} / {c} = <<{c * k}/{c}={k}>>{k} teams."], k)


def _two_twice(r: random.Random) -> tuple[str, list[str], int]:
    n, p = r.choice(NAMES)
    a = r.randint(3, 25)
    return (f"{n} reads {a} pages on Monday and twice as many pages on Tuesday. "
            f"How many pages does {n} read in the two days?",
            [f"On Tuesday {p} reads 2 * {a} = <<2*{a}={2 * a}>>{2 * a} pages.",
             f"In all {p} reads {a} + {2 * a} = <<{a}+{2 * a}={3 * a}>>{3 * a} pages."], 3 * a)


def _three_two_packs(r: random.Random) -> tuple[str, list[str], int]:
    n, p = r.choice(NAMES)
    a, b, c, d = r.randint(2, 5), r.randint(2, 10), r.randint(2, 5), r.randint(2, 10)
    e = r.randint(1, a * b + c * d - 1)
    total = a * b + c * d
    return (f"{n} buys {a} packs of {b} pens and {c} packs of {d} pencils. {p.capitalize()} gives away {e} of "
            f"them. How many pens and pencils does {n} have left?",
            [f"The pens are {a} * {b} = <<{a}*{b}={a * b}>>{a * b}.",
             f"The pencils are {c} * {d} = <<{c}*{d}={c * d}>>{c * d}.",
             f"{n} has {a * b} + {c * d} - {e} = <<{a * b}+{c * d}-{e}={total - e}>>{total - e} left."],
            total - e)


def _three_bakery(r: random.Random) -> tuple[str, list[str], int]:
    a, b = r.randint(2, 6), r.randint(4, 12)
    c = r.randint(1, a * b - 2)
    d = r.randint(1, a * b - c - 1)
    left = a * b - c - d
    return (f"A baker makes {a} trays of {b} muffins. She sells {c} muffins in the morning and {d} muffins "
            "in the afternoon. How many muffins are left?",
            [f"The baker makes {a} * {b} = <<{a}*{b}={a * b}>>{a * b} muffins.",
             f"She sells {c} + {d} = <<{c}+{d}={c + d}>>{c + d} muffins.",
             f"{a * b} - {c + d} = <<{a * b}-{c + d}={left}>>{left} muffins are left."], left)


TEMPLATES = [_one_add, _one_sub, _one_mul, _one_div,          # one step
             _two_buy_bags, _two_earn_spend, _two_teams, _two_twice,  # two steps
             _three_two_packs, _three_bakery]                 # three steps
WEIGHTS = [3, 3, 3, 2, 3, 3, 2, 2, 1, 1]
"""More one- and two-step problems than three-step ones: a 135M model gets few of those."""


def rows(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows: distinct questions, drawn template by weight."""
    r = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < TRAIN_ROWS + TEST_ROWS:
        question, steps, value = r.choices(TEMPLATES, WEIGHTS)[0](r)
        if question in seen:
            continue
        seen.add(question)
        out.append({"question": question, "answer": "\n".join(steps) + f"\n#### {value}"})
    return out[:TRAIN_ROWS], out[TRAIN_ROWS:]


def main() -> None:
    train, test = rows()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, split in (("train.jsonl", train), ("test.jsonl", test)):
        with open(OUT / name, "w") as f:
            for row in split:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(split)} rows to {OUT / name}")


if __name__ == "__main__":
    main()
