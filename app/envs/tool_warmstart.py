"""The tiny policy's tool warm start: the plain warm start plus calculator demonstrations.

The plain warm start (``llamarl.app.rl.warmstart``) teaches worked solutions only, so a
policy started from it never calls a tool and RL has no tool call to reinforce. This one
adds, for as many problems again, the episode the ``calculator`` environment expects in
the tiny policy's plain chat format (``llamarl.app.envs.chat``): the prompt with the
``calculate`` tool described, a turn that calls it with the problem's expression, the
tool's answer (fed, no loss) and a turn ``#### <answer>``. Its tokenizer also learns the
format's text (the tool header alone is 430 tokens of the plain tokenizer, past the
policy's 256-token context). Cached apart from the plain one (``checkpoints/warmstart-tools``)
and built only for a run whose ``--env`` has the calculator tool with ``--policy tiny``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from llamarl.app.envs.builtins import calculate
from llamarl.app.envs.chat import ChatFormat, plain_tools_header
from llamarl.app.envs.protocol import tool_schemas
from llamarl.app.rl.contract import Rollout
from llamarl.app.rl.warmstart import ExtraDemonstrations, WarmStartConfig, ensure_warmstart, warm_start
from llamarl.app.tasks import arithmetic as tasks

TOOL_WARMSTART = "checkpoints/warmstart-tools"
VOCAB_SIZE = 768
"""The plain tokenizer's 512 and room for the tool format's merges."""
TOOL_STEPS = 600
"""As many as the plain warm start's: the tool format is learnt in a few dozen steps, but
turning a story into its expression takes as long as learning worked solutions."""
TOOL_SEED_OFFSET = 7919
"""The tool demonstrations' problems are drawn with ``seed`` plus this: other stories
than the worked solutions'."""


def expression(problem: tasks.Problem) -> str:
    """The built-in problem's steps as one expression, e.g. ``(3*4+5)*2``."""
    steps = [line.split("=")[0] for line in problem.solution.splitlines()[:-1]]
    expr, additive = steps[0], "*" not in steps[0]
    for lhs in steps[1:]:
        op, n = re.fullmatch(r"\d+([-+*])(\d+)", lhs).groups()  # type: ignore[union-attr]
        if op == "*" and additive:
            expr = f"({expr})"
        expr, additive = f"{expr}{op}{n}", op != "*"
    return expr


def tool_call_text(expr: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calculate', 'arguments': {'expression': expr}})}</tool_call>"


def demonstration(problem: tasks.Problem, fmt: ChatFormat) -> Rollout:
    """One calculator episode of ``problem``, as the episode runner would record it."""
    expr = expression(problem)
    value = calculate(expr)
    if value != str(problem.answer):
        raise AssertionError(f"{expr} = {value}, not the answer {problem.answer}")
    eot = fmt.end_of_turn_id
    messages: list[dict[str, Any]] = [{"role": "user", "content": tasks.format_prompt(problem.question)}]
    prompt, prompt_ids = fmt.prompt(messages)
    call = tool_call_text(expr)
    messages.append({"role": "assistant", "content": call})
    _, obs_ids = fmt.observation(messages, [{"role": "tool", "name": "calculate", "content": value}])
    call_ids = fmt.tokenizer(call, add_special_tokens=False)["input_ids"] + [eot]
    answer_ids = fmt.tokenizer(f"#### {value}", add_special_tokens=False)["input_ids"] + [eot]
    ids = call_ids + obs_ids + answer_ids
    mask = [True] * len(call_ids) + [False] * len(obs_ids) + [True] * len(answer_ids)
    return Rollout(prompt_ids=prompt_ids, completion_ids=ids, behaviour_logprobs=[0.0] * len(ids),
                   policy_mask=mask, segment_versions=[0, 0], version=0, prompt=prompt)


def tool_demonstrations(cfg: WarmStartConfig) -> ExtraDemonstrations:
    """``cfg.train_size`` calculator episodes (levels in turn) for ``warm_start``."""
    problems = tasks.make_split("train", cfg.train_size, seed=cfg.seed + TOOL_SEED_OFFSET)
    header = plain_tools_header(tool_schemas([calculate]))
    corpus = [header + "\n<tool_call>{\"name\": \"calculate\", \"arguments\": {\"expression\": \"\"}}</tool_call>"
              "\n<tool_response></tool_response>\n"] * 1000 + [tool_call_text(expression(p)) for p in problems[:2000]]

    def make(tokenizer: Any) -> list[Rollout]:
        fmt = ChatFormat(tokenizer, tool_schemas([calculate]))
        return [demonstration(p, fmt) for p in problems]

    return ExtraDemonstrations(corpus=corpus, make=make, vocab_size=VOCAB_SIZE)


def train_tool_warmstart(cfg: WarmStartConfig, *, log: Callable[[str], None] = print) -> dict[str, float]:
    return warm_start(cfg, log=log, extra=tool_demonstrations(cfg))


def ensure_tool_warmstart(path: str | Path = TOOL_WARMSTART, *, log: Callable[[str], None] = print) -> Path:
    """The tool warm start at ``path``, trained there once if missing (see the module)."""
    return ensure_warmstart(path, log=log, steps=TOOL_STEPS, train=lambda out: train_tool_warmstart(
        WarmStartConfig(out=out, steps=TOOL_STEPS), log=log))


def has_calculator(make_env: Callable[[], Any]) -> bool:
    """Whether the environment offers the built-in ``calculate`` tool (the tool warm start's)."""
    return any(t is calculate for t in getattr(make_env(), "tools", ()))


__all__ = ["TOOL_WARMSTART", "demonstration", "ensure_tool_warmstart", "expression", "has_calculator",
           "tool_demonstrations", "train_tool_warmstart"]
