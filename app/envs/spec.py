"""``--env``: which environment a run's episodes talk to, named like a reward.

``NAME`` or ``NAME(option=value, ...)`` (options parsed as in ``--rewards``), NAME one of:

- a built-in: ``calculator``, ``guess_number`` (``llamarl.app.envs.builtins``);
- ``reasoning_gym:<task>``: a reasoning-gym task, e.g. ``reasoning_gym:basic_arithmetic``;
- ``openenv:<package.module>:<Class>``: an OpenEnv environment class (``adapters.OpenEnv``);
- ``verifiers:<package.module>:<name>``: a verifiers taskset, env or loader (``verifiers_adapter``);
- an entry point of the ``llamarl.envs`` group (an installed plugin);
- ``<package.module>:<Class>``: your own class, following ``protocol.Environment``.

``build_env(spec)`` returns the factory the episode runner calls once per episode; it
makes one environment at once, so a bad spec fails at startup with a one-line error.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

from llamarl.app.envs.adapters import OpenEnv
from llamarl.app.envs.builtins import Calculator, GuessNumber, ReasoningGym
from llamarl.app.envs.protocol import Environment
from llamarl.app.envs.verifiers_adapter import verifiers_factory
from llamarl.app.errors import ConfigError
from llamarl.app.rewards.spec import import_target, parse_spec

ENTRY_POINT_GROUP = "llamarl.envs"

BUILTINS: dict[str, Callable[..., Environment]] = {"calculator": Calculator, "guess_number": GuessNumber}


def _import(target: str) -> Any:
    try:
        return import_target(target, "env", "package.module:Class")
    except ValueError as e:  # a module that fails to import: a refusal at startup, as any bad --env
        raise ConfigError(str(e)) from e


def _factory(target: str, options: dict[str, Any]) -> Callable[[], Environment]:
    if target in BUILTINS:
        cls = BUILTINS[target]
        return lambda: cls(**options)
    if target.startswith("reasoning_gym:"):
        task = target.partition(":")[2]
        return lambda: ReasoningGym(task, **options)
    if target.startswith("openenv:"):
        env_cls = _import(target.partition(":")[2])
        return lambda: OpenEnv(env_cls, **options)
    if target.startswith("verifiers:"):
        return verifiers_factory(_import(target.partition(":")[2]), dict(options))
    plugins = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    cls = plugins[target].load() if target in plugins else _import(target) if ":" in target else None
    if cls is None:
        raise ConfigError(f"unknown env {target!r}: built-ins are {', '.join(sorted(BUILTINS))}; or "
                          "reasoning_gym:<task>, openenv:<module>:<Class>, verifiers:<module>:<name>, "
                          f"an entry point of "
                          f"{ENTRY_POINT_GROUP!r} ({', '.join(sorted(plugins)) or 'none installed'}), "
                          "or <module>:<Class>")
    return lambda: cls(**options)


def build_env(spec: str) -> Callable[[], Environment]:
    """The environment factory of ``spec`` (see the module), checked by making one."""
    try:
        parts = parse_spec(spec)
    except ConfigError as e:
        raise ConfigError(f"env spec {spec!r}: {e}") from None
    if len(parts) != 1 or parts[0].weight != 1.0:
        raise ConfigError(f"env spec {spec!r}: name one environment, with options in parentheses")
    try:
        make = _factory(parts[0].target, parts[0].options)
        env = make()
    except ConfigError:
        raise
    except (TypeError, ValueError, ImportError) as e:
        raise ConfigError(f"env {spec!r}: {e}") from e
    missing = [m for m in ("rows", "reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env {spec!r}: {type(env).__name__} has no {', '.join(missing)} "
                          "(see llamarl.app.envs.protocol.Environment)")
    return make


__all__ = ["BUILTINS", "ENTRY_POINT_GROUP", "build_env"]
