"""Final answers: extracting them from reference solutions and from completions, and
deciding when two of them are equal.

Pure: no torch, no I/O; nothing here raises on strange input (a verifier is called on
whatever a policy writes). The same extraction reads the reference out of a dataset row
(``llamarl.app.data.datafile``) and the answer out of a completion (the verifier rewards and held-out
evaluation), so a reference and a right answer are read the same way.

Answer markers:

- ``#### <number>`` (GSM8K): the number after the last ``####``;
- ``\\boxed{...}`` (MATH): the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``),
  nested braces included; ``\\boxed 5`` too.

Equality is equality of ``normalize``'s canonical strings. Numbers are compared by value,
exactly (``0.5`` equals ``1/2``; ``0.333`` does not equal ``1/3``); everything else as
text after the rewrites listed in ``normalize`` (no algebra: ``2x`` is not ``x*2``). The
table of what counts as equal is in docs/data.md, and the tests check every row of it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

AnswerFormat = Literal["gsm8k", "math", "plain"]
"""How a dataset's answer field holds the reference: after ``####``, in the last
``\\boxed{}``, or as the whole field."""
ANSWER_FORMATS: tuple[str, ...] = ("gsm8k", "math", "plain")

Marker = Literal["hash", "boxed", "any"]
"""Which marker a completion's final answer may use; ``any``: the last of either."""

_HASH_RE = re.compile(r"####\s*\$?\s*([-\u2212]?[\d,]*\.?\d+)")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{|[^\s{}$]+)")
MAX_TEXT = 100_000
"""Longer texts are read from their last ``MAX_TEXT`` characters (final answers are at
the end; a runaway completion costs no more than this)."""
MAX_ANSWER = 1000
"""Longer answers are compared as written, whitespace aside (rewriting is quadratic in
the worst case; a final answer this long is not one)."""


def _tail(text: object) -> str | None:
    return text[-MAX_TEXT:] if isinstance(text, str) else None


def _hash_match(text: str) -> tuple[int, str] | None:
    last = None
    for last in _HASH_RE.finditer(text):
        pass
    return (last.start(), last.group(1)) if last else None


def _boxed_match(text: str) -> tuple[int, str] | None:
    found, closing = None, None
    for m in _BOXED_RE.finditer(text):
        if m.group(1) != "{":  # \boxed 5
            found = (m.start(), m.group(1))
            continue
        closing = _closing_braces(text) if closing is None else closing
        end = closing.get(m.end() - 1)
        if end is not None:
            found = (m.start(), text[m.end(): end])
    return found


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each ``{`` -> position of its ``}``, in one pass (``\\{`` and ``\\}``
    are characters, not braces); an unclosed ``{`` has no entry."""
    pairs, open_at = {}, []
    for i, ch in enumerate(text):
        if ch in "{}" and text[i - 1: i] != "\\":
            if ch == "{":
                open_at.append(i)
            elif open_at:
                pairs[open_at.pop()] = i
    return pairs


def _braced(text: str, open_at: int) -> str | None:
    """The content of the brace group opening at ``text[open_at]``, or None if unclosed."""
    end = _closing_braces(text[open_at:]).get(0)
    return text[open_at + 1: open_at + end] if end is not None else None


def hash_answer(text: object) -> str | None:
    """The number after the last ``####`` (as written: ``1,000``, ``-3``, ``.5``), or None."""
    text = _tail(text)
    m = _hash_match(text) if text is not None else None
    return m[1] if m else None


def boxed_answer(text: object) -> str | None:
    """The content of the last closed ``\\boxed{...}`` / ``\\fbox{...}``, or None."""
    text = _tail(text)
    m = _boxed_match(text) if text is not None else None
    return m[1] if m else None


def final_answer(completion: object, marker: Marker = "any") -> str | None:
    """The completion's final answer by ``marker``; with ``any``, whichever of the last
    ``####`` answer and the last ``\\boxed{}`` comes later in the text."""
    text = _tail(completion)
    if text is None:
        return None
    found = [m for m in ((_hash_match(text) if marker in ("hash", "any") else None),
                         (_boxed_match(text) if marker in ("boxed", "any") else None)) if m]
    return max(found)[1] if found else None


def reference_answer(value: object, answer_format: str) -> str | None:
    """The reference a dataset's answer field holds, or None when it holds none:
    ``gsm8k``, the number after ``####``; ``math``, the last ``\\boxed{}``; ``plain``, the
    whole field (numbers as written by ``str``, e.g. ``72`` or ``0.5``)."""
    if answer_format == "gsm8k":
        return hash_answer(value)
    if answer_format == "math":
        ref = boxed_answer(value)
        return ref if ref is not None and ref.strip() else None
    if answer_format == "plain":
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return None
        text = str(value).strip()
        return text or None
    raise ValueError(f"answer format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


# ---------------------------------------------------------------------- normalisation

_DROP = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;:]|\\q?quad(?![A-Za-z])|\\ |~"
                   r"|\\\$|\$|\\%|%|\^\s*\{?\\circ\}?|\\displaystyle")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_CHOICE = re.compile(r"\(([A-Z])\)")
"""A multiple-choice answer written ``(B)``: the letter alone, as ``B`` and ``\\text{(B)}`` are."""
_MINUS = str.maketrans({"\u2212": "-"})
"""The unicode minus sign (U+2212), which typeset answers carry, reads as ``-``."""
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
_OPERATOR = re.compile(r"[-+*/^=<>,]")


def _number(text: str) -> Fraction | None:
    """``5``, ``-0.25``, ``3/4``, ``(-1)/2`` as an exact fraction, else None."""
    parts = text.split("/")
    if len(parts) > 2:
        return None
    values = []
    for part in parts:
        part = part[1:-1] if part.startswith("(") and part.endswith(")") else part
        if not _NUMBER.fullmatch(part) or len(part) > 400:
            return None
        values.append(Fraction(part))
    if len(values) == 2:
        return values[0] / values[1] if values[1] != 0 else None
    return values[0]


def _group(text: str, at: int) -> tuple[str, int] | None:
    """The argument of a TeX command at ``text[at]``: a brace group or one character."""
    if at >= len(text):
        return None
    if text[at] == "{":
        inner = _braced(text, at)
        return (inner, at + len(inner) + 2) if inner is not None else None
    return text[at], at + 1


def _rewrite_fracs(text: str) -> str:
    """``\\frac{a}{b}`` (and ``\\frac ab``) as ``a/b``, a part with an operator in
    parentheses; ``\\sqrt2`` as ``\\sqrt{2}``."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\\frac", i) and not text[i + 5: i + 6].isalpha():
            num = _group(text, i + 5)
            den = _group(text, num[1]) if num else None
            if num and den:
                parts = [_rewrite_fracs(num[0]), _rewrite_fracs(den[0])]
                out.append("/".join(f"({p})" if _OPERATOR.search(p) and _number(p) is None else p
                                    for p in parts))
                i = den[1]
                continue
        if text.startswith("\\sqrt", i) and not text[i + 5: i + 6].isalpha() and text[i + 5: i + 6] not in ("{", "["):
            arg = _group(text, i + 5)
            if arg:
                out.append("\\sqrt{" + arg[0] + "}")
                i = arg[1]
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def normalize(answer: object) -> str:
    """The canonical form two answers are compared in (docs/data.md has the table)."""
    text = answer if isinstance(answer, str) else str(answer)
    if len(text) > MAX_ANSWER:
        return "".join(text[:MAX_TEXT].split())
    text = text.strip().translate(_MINUS)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _TEXT.sub(r"\1", text)
    text = _DROP.sub("", text)
    text = "".join(text.split())
    text = text.rstrip(".")
    while len(text) > 1 and text[0] == "{" and _braced(text, 0) == text[1:-1]:
        text = text[1:-1]
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if _CHOICE.fullmatch(text):
        text = text[1]
    text = _rewrite_fracs(text)
    value = _number(text)
    if value is not None:
        return str(value)  # "5", "-1/2": one spelling per value
    return text


def equal(a: object, b: object) -> bool:
    """True when ``a`` and ``b`` have the same canonical form. Never raises."""
    try:
        return normalize(a) == normalize(b)
    except Exception:  # a verifier never raises, whatever it is given
        return False


def is_correct(completion: object, reference: object, marker: Marker = "any") -> bool:
    """True when the completion's final answer (by ``marker``) equals ``reference``."""
    got = final_answer(completion, marker)
    return got is not None and reference is not None and equal(got, reference)
