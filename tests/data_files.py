"""Small dataset files the tests write themselves: problems in GSM8K's format (a worked
solution with ``<<calculator>>`` notes, then ``#### <number>``) and in MATH's (a solution
whose last ``\\boxed{...}`` is the answer), written for these tests, not copied from
either dataset. Each comes with the reference its format's extraction must give.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from llamarl.app.data.datafile import FieldMap

GSM8K = ("question", "answer")
"""GSM8K's field names (and llamarl's defaults)."""
MATH = ("problem", "solution")
MATH_FIELDS = FieldMap("problem", "solution", "math")

# (name, item, a, b): "<name> buys <a> packs of <b> <item>" -> a * b, then + a, then the sum
_PEOPLE = [("Mara", "pencils", 3, 12), ("Tomas", "stickers", 25, 48), ("Ines", "marbles", 7, 9),
           ("Ravi", "bolts", 40, 35), ("Lena", "beads", 6, 15), ("Oskar", "tiles", 12, 110),
           ("June", "seeds", 9, 8), ("Pavel", "nails", 55, 20), ("Noor", "buttons", 4, 250),
           ("Aiko", "cards", 11, 11), ("Bruno", "cups", 5, 60), ("Chen", "straws", 30, 45)]


def gsm8k_rows() -> list[dict]:
    """24 word problems; references from 8 to 2,750, some written with a thousands comma."""
    rows = []
    for name, item, a, b in _PEOPLE:
        total = a * b
        rows.append({
            "question": f"{name} buys {a} packs of {item} with {b} {item} in each pack. "
                        f"How many {item} does {name} buy?",
            "answer": f"Each pack has {b} {item}, so {name} buys {a}*{b}=<<{a}*{b}={total}>>{total} "
                      f"{item}.\n#### {total:,}",
            "reference": str(total)})
        gave = min(a, total - 1)
        rows.append({
            "question": f"{name} had {total} {item} and gave {gave} of them to a friend. "
                        f"How many {item} are left?",
            "answer": f"{total}-{gave}=<<{total}-{gave}={total - gave}>>{total - gave}\n#### {total - gave:,}",
            "reference": str(total - gave)})
    return rows


MATH_ROWS = [
    {"problem": r"What is $\frac{1}{2} + \frac{1}{3}$?",
     "solution": r"The common denominator is 6, so the sum is $\frac{3}{6} + \frac{2}{6} = \boxed{\frac{5}{6}}$.",
     "reference": r"\frac{5}{6}"},
    {"problem": r"Simplify $\sqrt{50}$.",
     "solution": r"$\sqrt{50} = \sqrt{25 \cdot 2} = \boxed{5\sqrt{2}}$.",
     "reference": r"5\sqrt{2}"},
    {"problem": r"Find the vertex of $y = (x-3)^2 + 4$.",
     "solution": r"The vertex form gives the vertex $\boxed{\left( 3, 4 \right)}$.",
     "reference": r"\left( 3, 4 \right)"},
    {"problem": r"What is $2^{10}$?",
     "solution": r"Doubling ten times: $2^{10} = \boxed{1024}$.",
     "reference": "1024"},
    {"problem": r"Compute $\dfrac{x^{2}}{x}$ for $x \neq 0$.",
     "solution": r"Cancel one factor: $\boxed{x}$.",
     "reference": "x"},
    {"problem": r"Solve $x^2 = 9$ for $x > 0$.",
     "solution": r"Then $x = 3$ or $x = -3$; the positive root is $\boxed{3}$.",
     "reference": "3"},
    {"problem": r"Write $0.75$ as a fraction in lowest terms.",
     "solution": r"$0.75 = \frac{75}{100} = \boxed{\dfrac{3}{4}}$.",
     "reference": r"\dfrac{3}{4}"},
    {"problem": r"What is $\frac{d}{dx} x^{3}$?",
     "solution": r"By the power rule, $\boxed{3x^{2}}$.",
     "reference": "3x^{2}"},
    {"problem": r"Which set is $\{x : x^2 = 1\}$?",
     "solution": r"Both signs work: $\boxed{\{-1, 1\}}$.",
     "reference": r"\{-1, 1\}"},
    {"problem": r"Evaluate $\frac{\frac{1}{2}}{2}$.",
     "solution": r"Halving a half: $\boxed{\frac{\frac{1}{2}}{2}} = \frac14$, i.e. $\boxed{\frac{1}{4}}$.",
     "reference": r"\frac{1}{4}"},
    {"problem": r"What is the name of a polygon with five sides?",
     "solution": r"It is a $\boxed{\text{pentagon}}$.",
     "reference": r"\text{pentagon}"},
    {"problem": r"How many degrees are in a right angle?",
     "solution": r"A right angle measures $\boxed{90^\circ}$.",
     "reference": r"90^\circ"},
]
"""12 MATH-style problems: nested braces, fractions, sets, text and degrees in the boxes."""


def write_jsonl(path: Path, rows: list[dict], fields: tuple[str, ...]) -> Path:
    path.write_text("".join(json.dumps({k: r[k] for k in fields}) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict], fields: tuple[str, ...]) -> Path:
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in fields}), path)
    return path
