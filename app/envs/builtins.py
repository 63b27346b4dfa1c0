"""The built-in environments: reasoning-gym tasks, the arithmetic task with tools, and a
multi-turn game.

- ``ReasoningGym(task, **options)`` (``--env reasoning_gym:<task>``): any of
  reasoning-gym's procedural tasks; its rows are the task's own items (training and
  held-out from seeds that never meet), the reward its ``score_answer`` of the final
  answer (``final_answer_text``). One turn.
- ``Calculator`` (``--env calculator``): the built-in arithmetic task with a
  ``calculate`` tool (``+ - * / ( )`` on numbers, evaluated from the syntax tree, never
  ``eval``) and, with ``python=true``, the sandboxed ``python`` tool. The episode ends at
  the first turn that calls no tool: that turn is the answer.
- ``GuessNumber`` (``--env guess_number``): guess a secret number in ``[1, high]``; each
  guess is answered "higher" or "lower"; reward 1 for the right number, 0 if the turns
  run out.

Each row is deterministic and JSON-able, and ``reset`` depends on the row alone, so the G
episodes of a row share their prompt.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import random
import re
from typing import Any, Mapping

from llamarl.app.envs.protocol import Step, Tool, call_tools
from llamarl.app.envs.sandbox import PythonSandbox, SandboxLimits
from llamarl.app.tasks import answers
from llamarl.app.tasks import arithmetic

TEST_SEED_OFFSET = 1_000_003
"""Added to the seed of held-out rows. reasoning-gym seeds item i with ``seed + i``, so the
splits never share an item while they have fewer rows than this."""


def final_answer_text(turn: str) -> str:
    """The turn's final answer, whatever its kind (a word, a list, a number): inside the
    last ``<answer>...</answer>`` (reasoning-gym's own convention), else the rest of the
    line after the last ``####``, else the last ``\\boxed{}``, else the whole turn; stripped."""
    tagged = re.findall(r"<answer>(.*?)</answer>", turn, re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    if "####" in turn:
        return (turn.rsplit("####", 1)[1].strip().splitlines() or [""])[0].strip()
    boxed = answers.boxed_answer(turn)
    return (boxed if boxed is not None else turn).strip()


@functools.cache
def _gym_dataset(task: str, options: tuple[tuple[str, Any], ...], seed: int, size: int):
    import reasoning_gym  # optional: the envs extra

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **dict(options))


class ReasoningGym:
    """A reasoning-gym task (see the module)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, task: str, **options: Any) -> None:
        try:
            import reasoning_gym
        except ImportError as e:
            raise ImportError("--env reasoning_gym:... needs reasoning-gym: pip install 'llamarl[envs]'") from e
        if task not in reasoning_gym.factory.DATASETS:
            raise ValueError(f"reasoning-gym has no task {task!r}; it has {', '.join(sorted(reasoning_gym.factory.DATASETS))}")
        self.task, self.options = task, tuple(sorted(options.items()))

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        seed = seed + (TEST_SEED_OFFSET if split == "test" else 0)
        data = _gym_dataset(self.task, self.options, seed, n)
        # Rows travel as the rollouts' JSON task: a task's metadata may hold tuples, sets or
        # numpy numbers, which score_answer reads back as lists and strings alike (the row
        # it scores is this JSON one in every process).
        return [json.loads(json.dumps({"question": e["question"], "answer": e["answer"], "metadata": e["metadata"],
                                       "gym_seed": seed, "gym_size": n}, default=str)) for e in data]

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row = row
        return arithmetic.format_prompt(row["question"])

    def step(self, turn: str) -> Step:
        # score_answer reads the dataset's config (e.g. tolerances): the one that made the row.
        data = _gym_dataset(self.task, self.options, self.row.get("gym_seed", 0), self.row.get("gym_size", 1))
        entry = {"question": self.row["question"], "answer": self.row["answer"], "metadata": self.row["metadata"]}
        return Step(reward=float(data.score_answer(final_answer_text(turn), entry)), done=True)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "(12 + 5) * 3"
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _evaluate(ast.parse(expression, mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class Calculator:
    """The arithmetic task with tools (see the module)."""

    def __init__(self, *, python: bool = False, levels: tuple[int, ...] = (1, 2, 3)) -> None:
        self.levels = tuple(levels)
        self.tools: tuple[Tool, ...] = (calculate,)
        if python:
            self.tools += (PythonSandbox(SandboxLimits()).tool(),)

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        problems = arithmetic.make_split("eval" if split == "test" else "train", n, seed=seed, levels=self.levels)
        return [{"question": p.question, **p.meta()} for p in problems]

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row = row
        return arithmetic.format_prompt(row["question"])

    def step(self, turn: str) -> Step:
        step = call_tools(turn, self.tools)
        if step is not None:
            return step
        return Step(reward=float(answers.is_correct(turn, self.row["answer"])), done=True)


class GuessNumber:
    """Guess the secret number (see the module)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, *, high: int = 20) -> None:
        if high < 2:
            raise ValueError(f"guess_number needs high >= 2, got {high}")
        self.high = high

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(f"{seed}/{split}/guess")
        return [{"secret": rng.randint(1, self.high), "high": self.high} for _ in range(n)]

    def reset(self, row: Mapping[str, Any]) -> str:
        self.secret = int(row["secret"])
        return (f"I picked a whole number from 1 to {row['high']}. Guess it: write one number per turn, "
                "and I say higher or lower.")

    def step(self, turn: str) -> Step:
        numbers = re.findall(r"-?\d+", turn)
        if not numbers:
            return Step(observation="Write a number.")
        guess = int(numbers[-1])
        if guess == self.secret:
            return Step(observation="Right!", reward=1.0, done=True)
        return Step(observation="higher" if guess < self.secret else "lower")


__all__ = ["Calculator", "GuessNumber", "ReasoningGym", "calculate", "final_answer_text"]
