"""A deliberately slow reward for ``benchmarks/simulator.py``: the math verifier after a
fixed pause per sample, so that scoring becomes a stage of known cost (a sleep, which
takes no CPU from the other roles on a shared machine)."""

from __future__ import annotations

import time

from llamarl.app.tasks.arithmetic import is_correct


class Pause:
    """``benchmarks.sim_reward:Pause(seconds=0.02)``: 1 for a correct answer, else 0,
    each after ``seconds`` of sleep."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = float(seconds)

    def __call__(self, prompt: str, completion: str, meta: dict) -> float:
        time.sleep(self.seconds)
        return 1.0 if is_correct(completion, meta["answer"]) else 0.0
