"""Adapter: a ``verifiers`` taskset (the environments PRIME-RL trains on), run unchanged.

verifiers (``verifiers.v1``) splits an environment into a ``Taskset`` (config in, typed
``Task``s out; each task's ``data`` holds its ``prompt`` and system prompt, and its
``@vf.reward`` / ``@vf.metric`` methods score a ``Trace``) and the harness that plays it
against a model behind an API. llamarl is the harness here: ``Verifiers`` hands out the
taskset's tasks as rows, renders a task's prompt as the first messages, and scores the
policy's turn the way verifiers does, ``Task.score`` on a ``Trace`` holding the prompt and
the turn (rewards that need a runtime sandbox are skipped, as verifiers itself does when
it scores without one); the episode's reward is the trace's weighted sum. One turn per
episode: a taskset's tools are MCP servers its harness runs, which this adapter does not
start.

``--env verifiers:<package.module>:<name>``, name one of: a ``Taskset`` subclass (made
with its config class, the spec's options as the config's fields), a ``Taskset`` object,
an ``Env`` (its ``taskset``), or a loader function returning either (given the options).
Held out: every ``test_every``-th task (the last one when there are fewer).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any, Callable, Mapping

from llamarl.app.envs.protocol import Message, Step, Tool

MAX_TASKS = 100_000
"""Tasks read from a taskset at most (an infinite one yields forever)."""


def load_taskset(target: Any, **options: Any) -> Any:
    """The ``Taskset`` that ``target`` names (see the module)."""
    from verifiers.v1 import Env, Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    if isinstance(target, type) and issubclass(target, Taskset):
        config_cls = concrete_type(target, TasksetConfig) or TasksetConfig
        return target(config_cls(**options))
    obj = target(**options) if callable(target) and not isinstance(target, (Taskset, Env)) else target
    obj = getattr(obj, "taskset", obj) if isinstance(obj, Env) else obj
    if not isinstance(obj, Taskset):
        raise TypeError(f"{getattr(target, '__name__', target)!r} gave a {type(obj).__name__}, "
                        "not a verifiers Taskset (or Env)")
    return obj


class VerifiersTasks:
    """A taskset's tasks, read once and shared by every episode's environment."""

    def __init__(self, taskset: Any, test_every: int = 10) -> None:
        if test_every < 2:
            raise ValueError(f"test_every must be >= 2, got {test_every}")
        self.taskset = taskset
        self.tasks = list(itertools.islice(iter(taskset), MAX_TASKS))
        if len(self.tasks) < 2:
            raise ValueError(f"{type(taskset).__name__} has {len(self.tasks)} tasks: a training and a "
                             "held-out split need at least 2")
        test = set(range(test_every - 1, len(self.tasks), test_every)) or {len(self.tasks) - 1}
        self.split = {"test": sorted(test), "train": [i for i in range(len(self.tasks)) if i not in test]}


def _messages(task: Any, system_prompt: str | None) -> list[Message]:
    from verifiers.v1.types import content_text

    data = task.data
    system = data.system_prompt or system_prompt
    out: list[Message] = [{"role": "system", "content": system}] if system else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        out += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
    return out


class Verifiers:
    """A verifiers taskset as an llamarl ``Environment`` (see the module)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, tasks: VerifiersTasks) -> None:
        self.tasks = tasks

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        order = list(self.tasks.split[split])
        random.Random(f"{seed}/{split}").shuffle(order)
        return [{"task_index": order[i % len(order)]} for i in range(n)]

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.task = self.tasks.tasks[int(row["task_index"])]
        self.messages = _messages(self.task, self.tasks.taskset.system_prompt)
        return self.messages

    def step(self, turn: str) -> Step:
        from verifiers.v1 import AgentConfig, Trace
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
        history = [kinds[m["role"]](content=m["content"]) for m in self.messages]
        nodes = [MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(history)]
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=AssistantMessage(content=turn),
                                 sampled=True))
        trace = Trace(task=TraceTask(type=type(self.task).__name__, data=self.task.data, key=self.task.key),
                      agent=AgentInfo(config=AgentConfig(), name="llamarl"), nodes=nodes)
        asyncio.run(self.task.score(trace))
        rewards = {k: None if r is None else r.value for k, r in trace.rewards.items()}
        return Step(reward=float(trace.reward), done=True, info={"verifiers_rewards": rewards})


def verifiers_factory(target: Callable[..., Any] | Any, options: dict[str, Any]) -> Callable[[], Verifiers]:
    """The ``--env verifiers:...`` factory: the taskset loaded once, an adapter per episode."""
    test_every = options.pop("test_every", 10)
    tasks = VerifiersTasks(load_taskset(target, **options), test_every=test_every)
    return lambda: Verifiers(tasks)


__all__ = ["MAX_TASKS", "Verifiers", "VerifiersTasks", "load_taskset", "verifiers_factory"]
