"""Answer verifiers: 1.0 when the completion's final answer equals the sample's reference
``meta["answer"]``, else 0.0.

They read answers with ``llamarl.app.tasks.answers``, the extraction that read the reference out of the
dataset, and compare them under its normalisation (docs/data.md). They differ only in
which marker the completion's final answer may use:

- ``math_verifier``: the last ``#### <number>`` or ``\\boxed{...}``, whichever comes
  later. One verifier for the built-in task, GSM8K and MATH files alike, whatever the
  prompt asks for; the default.
- ``gsm8k_verifier``: only ``#### <number>`` (an answer in ``\\boxed{}`` scores 0).
- ``boxed_verifier``: only ``\\boxed{...}``.

The reference's own format (``meta["answer_format"]``) does not matter here: the task
dict carries the reference already extracted. A sample without ``meta["answer"]`` raises
KeyError, so it is quarantined rather than silently scored 0.
"""

from __future__ import annotations

from llamarl.app.tasks import answers


def math_verifier(prompt: str, completion: str, meta: dict) -> float:
    """1.0 when the last ``####`` or ``\\boxed{}`` answer equals ``meta["answer"]``."""
    return 1.0 if answers.is_correct(completion, meta["answer"], marker="any") else 0.0


def gsm8k_verifier(prompt: str, completion: str, meta: dict) -> float:
    """1.0 when the number after the last ``####`` equals ``meta["answer"]``."""
    return 1.0 if answers.is_correct(completion, meta["answer"], marker="hash") else 0.0


def boxed_verifier(prompt: str, completion: str, meta: dict) -> float:
    """1.0 when the last ``\\boxed{...}`` equals ``meta["answer"]``."""
    return 1.0 if answers.is_correct(completion, meta["answer"], marker="boxed") else 0.0
