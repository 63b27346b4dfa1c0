"""The environment protocol: what an episode talks to, and its tools.

An episode starts from a dataset row: ``env.reset(row)`` gives the first messages the
policy sees (the prompt). Then, turn after turn, the policy writes a turn (text, up to
its end-of-turn token) and ``env.step(turn)`` answers with a ``Step``: the observation
(text, or chat messages such as tool results), a reward (``None`` until the end, or a
per-step reward the generator sums) and ``done``. One environment object serves one
episode; ``rows(split, n, seed)`` hands out its dataset rows (training and held out).

The shape follows the ecosystem's, so adapters stay thin: OpenEnv's
``reset() -> Observation`` / ``step(Action) -> Observation(reward, done)``, verifiers'
multi-turn ``env_response(messages, state)`` and rubric score, reasoning-gym's rows and
``score_answer``. What they differ in (pydantic actions, async, a rubric at the end) is
the adapters' business (``llamarl.app.envs.adapters``).

Tools are plain Python functions with type hints and a Google-style docstring: they are
described to the model through the tokenizer's chat template (``tools=`` of
``apply_chat_template``, the JSON schema transformers builds from the signature), and the
model calls them in the Hermes format that Qwen, SmolLM3, Hermes and many other templates
teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A call that does not
parse, names no known tool or has bad arguments is not fatal: ``call_tools`` gives the
error back to the model as the tool's answer and names its reason (``TOOL_ERRORS``), which
the generator counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from transformers.utils import get_json_schema

Message = dict[str, Any]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``
(a tool message may also carry ``"name"``)."""

Observation = str | list[Message]
"""What the environment says: a text (a user turn) or chat messages."""

Tool = Callable[..., Any]
"""A Python function with type hints and a docstring describing its arguments."""

# Why a tool call failed (counted by the generator under these names).
UNPARSED = "unparsed"
"""A ``<tool_call>`` whose body is not a JSON object with a "name"."""
UNKNOWN_TOOL = "unknown_tool"
"""The call names no tool the environment has."""
BAD_ARGUMENTS = "bad_arguments"
"""The arguments are not an object, or do not fit the function's signature."""
TOOL_RAISED = "tool_raised"
"""The tool ran and raised (or, for the sandboxed Python tool, failed its limits)."""
TOOL_ERRORS = (UNPARSED, UNKNOWN_TOOL, BAD_ARGUMENTS, TOOL_RAISED)

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn."""

    observation: Observation = ""
    """What the policy sees next (ignored once ``done``)."""
    reward: float | None = None
    """This step's reward; ``None`` until the episode's end when it is scored only then."""
    done: bool = False
    tool_calls: int = 0
    """Tool calls the turn made."""
    tool_errors: tuple[str, ...] = ()
    """The reason of each failed call (``TOOL_ERRORS``)."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras, kept with the episode's task metadata."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. Built with no arguments (or the options of its spec);
    ``reset`` then ``step`` until a ``Step`` is ``done``."""

    tools: Sequence[Tool]
    """The functions the model may call (empty: none; the template then gets no tools)."""

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` dataset rows of ``split`` ("train" or "test"), deterministic from
        ``seed``; the two splits must not overlap. A row is JSON-able."""
        ...

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """Start an episode on ``row``: the first messages (a text: one user message)."""
        ...

    def step(self, turn: str) -> Step:
        """The policy wrote ``turn`` (its text, end-of-turn token removed)."""
        ...

    # Optional: ``close()``, called (on the step pool) once the episode has ended.


def as_messages(observation: Observation, role: str = "user") -> list[Message]:
    """An observation as chat messages (a text becomes one ``role`` message)."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    return [dict(m) for m in observation]


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The JSON schemas of ``tools``, as chat templates take them (``tools=``)."""
    return [get_json_schema(t) for t in tools]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(turn: str) -> tuple[list[ToolCall], list[str]]:
    """The tool calls of ``turn`` and, for each ``<tool_call>`` that does not parse, an
    error text (its reason is ``UNPARSED``). A turn without ``<tool_call>`` has neither."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in TOOL_CALL_RE.findall(turn):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                          '<tool_call>{"name": "...", "arguments": {...}}</tool_call>')
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('the tool call needs a JSON object with a "name" string')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append(ToolCall(obj["name"], args))  # type: ignore[arg-type]
    return calls, errors


def _run_call(call: ToolCall, by_name: Mapping[str, Tool]) -> tuple[str, str | None]:
    """``(answer, error reason or None)`` of one call."""
    fn = by_name.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(by_name)) or 'none'}", UNKNOWN_TOOL
    if not isinstance(call.arguments, dict):
        return f"error: the arguments of {call.name!r} must be a JSON object", BAD_ARGUMENTS
    try:
        result = fn(**call.arguments)
    except TypeError as e:
        # A TypeError raised inside the tool's body is the tool's failure, not the caller's,
        # but both read the same here; the message names which.
        return f"error: {call.name}: {e}", BAD_ARGUMENTS
    except Exception as e:  # the tool's own failure: the model is told, the run goes on
        return f"error: {call.name} raised {type(e).__name__}: {e}", TOOL_RAISED
    return result if isinstance(result, str) else json.dumps(result), None


def call_tools(turn: str, tools: Sequence[Tool]) -> Step | None:
    """Run the tool calls of ``turn`` with ``tools``: a ``Step`` whose observation is one
    tool message per call (an error's text for a failed one), or ``None`` when the turn
    calls nothing (it is then the policy's answer)."""
    calls, unparsed = parse_tool_calls(turn)
    if not calls and not unparsed:
        return None
    by_name = {t.__name__: t for t in tools}
    messages: list[Message] = [{"role": "tool", "content": f"error: {e}"} for e in unparsed]
    errors = [UNPARSED] * len(unparsed)
    for call in calls:
        answer, error = _run_call(call, by_name)
        messages.append({"role": "tool", "name": call.name, "content": answer})
        if error is not None:
            errors.append(error)
    return Step(observation=messages, tool_calls=len(calls) + len(unparsed), tool_errors=tuple(errors))


__all__ = ["BAD_ARGUMENTS", "Environment", "Message", "Observation", "Step", "TOOL_ERRORS", "TOOL_RAISED",
           "Tool", "ToolCall", "UNKNOWN_TOOL", "UNPARSED", "as_messages", "call_tools", "parse_tool_calls",
           "tool_schemas"]
