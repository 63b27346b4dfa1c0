"""Adapters: environments written for other frameworks, run unchanged.

OpenEnv (``openenv-core``, Meta PyTorch's environment standard): ``OpenEnv`` wraps either
an ``Environment`` in this process (``openenv.core.env_server.interfaces.Environment``:
``reset(seed=...) -> Observation``, ``step(Action) -> Observation`` whose ``reward`` and
``done`` are fields of the observation) or a client of one served elsewhere
(``EnvClient``/``SyncEnvClient``/``GenericEnvClient``, whose ``reset``/``step`` return a
``StepResult(observation, reward, done)``): both shapes are read the same way. What the
adapter adds is the two conversions a text policy needs: the policy's turn to the
environment's ``Action`` (by default: the action class's one required string field gets
the turn) and an observation to text (by default: its one string field besides
``done``/``reward``/``metadata``, else those fields as JSON; a client's observations are
dicts, read alike). A client needs ``action=`` (its actions are dicts: ``lambda turn:
{"message": turn}``). Rows are reset seeds.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Callable, Mapping

from llamarl.app.envs.protocol import Step, Tool

_RESERVED = {"done", "reward", "metadata"}


def _action_class(env: Any) -> type:
    """The ``Action`` subclass of an OpenEnv environment, from its generic parameters
    (``Environment[MyAction, MyObservation, State]``) or the annotation of ``step``."""
    for base in getattr(type(env), "__orig_bases__", ()):
        for arg in typing.get_args(base):
            if isinstance(arg, type) and any(c.__name__ == "Action" for c in arg.__mro__):
                return arg
    hints = typing.get_type_hints(type(env).step)
    if isinstance(hints.get("action"), type):
        return hints["action"]
    raise TypeError(f"cannot tell the Action class of {type(env).__name__}: pass action=...")


def text_action(action_cls: type) -> Callable[[str], Any]:
    """The turn into ``action_cls``'s one required string field."""
    fields = [n for n, f in action_cls.model_fields.items() if f.is_required() and f.annotation is str]
    if len(fields) != 1:
        raise TypeError(f"{action_cls.__name__} has {len(fields)} required string fields, not one: pass action=...")
    return lambda turn: action_cls(**{fields[0]: turn})


def observation_text(observation: Any) -> str:
    """An OpenEnv observation as text (see the module)."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    data = {k: v for k, v in data.items() if k not in _RESERVED}
    strings = [v for v in data.values() if isinstance(v, str)]
    return strings[0] if len(strings) == 1 and len(data) == 1 else json.dumps(data, default=str)


class OpenEnv:
    """An OpenEnv environment or client as an llamarl ``Environment`` (see the module).

    ``env``: the environment object, or a class or factory making one (the ``--env``
    spec's options go to it). ``action``: turn -> Action; ``render``: observation -> text.
    """

    tools: tuple[Tool, ...] = ()

    def __init__(self, env: Any, *, action: Callable[[str], Any] | None = None,
                 render: Callable[[Any], str] = observation_text, **options: Any) -> None:
        self.env = env(**options) if isinstance(env, type) or not hasattr(env, "step") else env
        self.action = action or text_action(_action_class(self.env))
        self.render = render

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        base = seed * 2 + (1 if split == "test" else 0)  # the splits' seeds never meet
        return [{"seed": base + 2 * i} for i in range(n)]

    @staticmethod
    def _read(out: Any) -> tuple[Any, float | None, bool]:
        """(observation, reward, done) of a server-side Observation or a client's StepResult."""
        obs = getattr(out, "observation", out)
        return obs, getattr(out, "reward", None), bool(getattr(out, "done", False))

    def reset(self, row: Mapping[str, Any]) -> str:
        obs, _, _ = self._read(self.env.reset(seed=row.get("seed"), **row.get("reset", {})))
        return self.render(obs)

    def step(self, turn: str) -> Step:
        obs, reward, done = self._read(self.env.step(self.action(turn)))
        return Step(observation=self.render(obs), reward=None if reward is None else float(reward), done=done)

    def close(self) -> None:
        """Closes a client's connection (a server-side environment has nothing to close)."""
        if callable(getattr(self.env, "close", None)):
            self.env.close()


__all__ = ["OpenEnv", "observation_text", "text_action"]
