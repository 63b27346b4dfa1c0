"""Datasets that ship with llamarl, named for ``--dataset`` so a run needs no download.

    --dataset gsm8k-sample      420 GSM8K-format word problems of one to three steps of
                                arithmetic on small numbers (320 to train on, 100 held
                                out), written by scripts/make_gsm8k_sample.py

A named dataset is a training file and a held-out file installed with the package; the
held-out file is the run's ``--eval-dataset`` unless ``--eval-dataset`` or
``--eval-fraction`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Sample:
    train: Path
    held_out: Path


NAMED = {"gsm8k-sample": Sample(train=HERE / "gsm8k_sample" / "train.jsonl",
                                held_out=HERE / "gsm8k_sample" / "test.jsonl")}
"""``--dataset NAME`` -> the files it names."""
