"""A reward component that scores nothing (weight 0) and writes down what the trainer's
reward saw: one JSON line ``{"prompt", "meta"}`` per scored completion, appended to the
file named by ``$LLAMARL_RECORD_PROMPTS``. With it the resume benchmark and the data and
resume integration tests see which prompts a run trained, in which order.

    launch(..., rewards=f"math_verifier,{record_prompts.SPEC}", env=record_prompts.env(path))
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "LLAMARL_RECORD_PROMPTS"
SPEC = "benchmarks.record_prompts:seen=0"
"""The reward component, weight 0: added to a run's rewards, it changes no score."""
REPO = Path(__file__).resolve().parents[1]


def seen(prompt: str, completion: str, meta: dict) -> float:
    with open(os.environ[ENV], "a") as f:
        f.write(json.dumps({"prompt": prompt, "meta": meta}) + "\n")
    return 0.0


def env(record: Path) -> dict[str, str]:
    """The roles' environment for recording into ``record``: the repository root first on
    their PYTHONPATH (where ``SPEC`` is imported from), then this process's own."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, ENV: str(record)}


def records(record: Path) -> list[dict]:
    """What was recorded into ``record``, in order (nothing yet: an empty list)."""
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def groups(record: Path, group_size: int) -> list[str]:
    """The prompt of each group recorded into ``record`` (a group's ``group_size``
    completions are scored together), in order."""
    return [r["prompt"] for r in records(record)[::group_size]]
