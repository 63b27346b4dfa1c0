"""Choosing rewards by configuration: the spec string, name resolution and the registry.

A spec is one string, the ``--rewards`` value of the local loop and the TorchX component::

    spec      := component ("," component)*
    component := target ["(" option ("," option)* ")"] ["=" weight]
    option    := key "=" value

for example ``"math_verifier,format=0.2"``,
``"math_verifier,length_penalty(target=100,scale=0.02)=0.5"``,
``"math_verifier,mypkg.rewards:brevity=0.5"`` or
``"hf_classifier(path=/models/rm,label=1)=0.3"``. The weight defaults to 1. Option values
are read as int, then float, then ``true``/``false``, else kept as strings; a value cannot
contain ``,`` or unbalanced parentheses.

A target resolves, in this order, to

1. a built-in name (``BUILTINS``),
2. an entry point of the ``llamarl.rewards`` group (an installed plugin),
3. ``package.module:attr`` (user code importable on ``sys.path``).

Built-ins are called with the options to make the component. A plugin or user object is
the component itself; if it is a class, or if options are given, it is called with the
options (as keyword arguments) and what it returns is the component.

The *log name* of a component, ``reward/<name>`` in the metrics, is the built-in or entry
point name, or the last part of ``attr`` for ``package.module:attr``. Names must be unique
within a spec; ``total`` is reserved.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import math
import re
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from llamarl.app.errors import ConfigError
from llamarl.app.rewards.builtins import LengthPenalty, env_reward, format_reward
from llamarl.app.rewards.composite import CompositeReward
from llamarl.app.rewards.core import Component
from llamarl.app.rewards.models import HFClassifier, SemanticSimilarity
from llamarl.app.rewards.verifiers import boxed_verifier, gsm8k_verifier, math_verifier

ENTRY_POINT_GROUP = "llamarl.rewards"


def _no_options(fn: Callable) -> Callable[..., Callable]:
    def factory(**options: Any) -> Callable:
        if options:
            raise TypeError(f"takes no options, got {sorted(options)}")
        return fn
    return factory


BUILTINS: dict[str, Callable[..., Any]] = {
    "math_verifier": _no_options(math_verifier),
    "gsm8k_verifier": _no_options(gsm8k_verifier),
    "boxed_verifier": _no_options(boxed_verifier),
    "format": _no_options(format_reward),
    "env_reward": _no_options(env_reward),
    "length_penalty": LengthPenalty,
    "semantic_similarity": SemanticSimilarity,
    "hf_classifier": HFClassifier,
}
"""Built-in name -> factory called with the spec's options."""

INLINE_BUILTINS = frozenset({"math_verifier", "gsm8k_verifier", "boxed_verifier", "format", "env_reward",
                             "length_penalty"})
"""Built-ins that run in the scoring thread (``Component.inline``): pure Python that
cannot hang or crash. The model-based ones, plugins and user code run in worker processes."""


@dataclass(frozen=True)
class ComponentSpec:
    target: str
    """Built-in name, entry point name, or ``package.module:attr``."""
    options: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    @property
    def name(self) -> str:
        if ":" in self.target:
            return self.target.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        return self.target


_COMPONENT_RE = re.compile(r"(?P<target>[^\s()=,]+)\s*(?:\((?P<options>.*)\))?\s*(?:=\s*(?P<weight>[^()=]*))?")


def _split_top_level(text: str, spec: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ')' in reward spec {spec!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"unbalanced '(' in reward spec {spec!r}")
    return parts + [text[start:]]


def _option_value(raw: str) -> Any:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def parse_spec(spec: str) -> list[ComponentSpec]:
    """The components of ``spec`` in order; ValueError naming the bad part otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"reward spec must be a non-empty string like 'math_verifier,format=0.2', got {spec!r}")
    out = []
    for part in _split_top_level(spec, spec):
        part = part.strip()
        if not part:
            raise ConfigError(f"empty component in reward spec {spec!r} (stray comma?)")
        m = _COMPONENT_RE.fullmatch(part)
        if m is None:
            raise ConfigError(f"cannot parse reward component {part!r} in spec {spec!r}; expected "
                             f"name, name=weight or name(key=value,...)=weight")
        options: dict[str, Any] = {}
        if m["options"] is not None and m["options"].strip():
            for item in _split_top_level(m["options"], spec):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq or not key.isidentifier():
                    raise ConfigError(f"reward option {item.strip()!r} of {m['target']!r} must be "
                                     f"key=value with key a Python identifier (spec {spec!r})")
                if key in options:
                    raise ConfigError(f"reward option {key!r} given twice for {m['target']!r}")
                options[key] = _option_value(value.strip())
        weight = 1.0
        if m["weight"] is not None:
            try:
                weight = float(m["weight"])
            except ValueError:
                raise ConfigError(f"weight of reward {m['target']!r} must be a number, got "
                                 f"{m['weight'].strip()!r} (spec {spec!r})") from None
            if not math.isfinite(weight):
                raise ConfigError(f"weight of reward {m['target']!r} must be finite, got {weight}")
        out.append(ComponentSpec(m["target"], options, weight))
    names = [c.name for c in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"reward component names must be unique in spec {spec!r}, repeated: {dupes}; "
                         f"to use one reward twice, wrap it in a function of another name")
    return out


def installed_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the ``llamarl.rewards`` group, by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> dict[str, list[str]]:
    """What a spec may name without ``module:attr``: for CLI help and error messages."""
    return {"builtins": sorted(BUILTINS), "plugins": sorted(installed_plugins())}


def import_target(target: str, what: str = "reward", shape: str = "package.module:function") -> Any:
    """The object ``target`` (``package.module:attr``, ``attr`` may be dotted) names, for a
    ``what`` spec (``reward``, ``env``): a missing colon or attribute is a refusal
    (``ConfigError``); a module that fails to import is not (``ValueError``): it may be the
    user's, failing on its own bug, whose traceback shows where."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {target!r}: expected {shape}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {target!r}: cannot import module {module_name!r} ({exc}); "
                         f"is its directory on PYTHONPATH?") from exc
    except Exception as exc:  # the module's own code raised while it was imported
        raise ValueError(f"{what} {target!r}: importing module {module_name!r} raised "
                         f"{type(exc).__name__}: {exc} (its traceback is above)") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what} {target!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def resolve(c: ComponentSpec, device: str | None = None) -> Any:
    """The component object for one parsed spec entry. ``device`` (the role's, e.g.
    ``cuda:0``) is given to a component class with a ``device`` field whose spec did not
    name one: a reward model then runs where its executor was given a GPU."""
    if c.target in BUILTINS:
        factory, is_factory = BUILTINS[c.target], True
    else:
        plugins = installed_plugins()
        if c.target in plugins:
            factory = plugins[c.target].load()
        elif ":" in c.target:
            factory = import_target(c.target)
        else:
            found = available()
            close = difflib.get_close_matches(c.target, found["builtins"] + found["plugins"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown reward {c.target!r}{hint}: not a built-in {found['builtins']}, "
                             f"not an installed plugin {found['plugins']} "
                             f"(entry point group {ENTRY_POINT_GROUP!r}), and not package.module:function")
        is_factory = isinstance(factory, type) or bool(c.options)
    if not is_factory:
        return factory
    options = dict(c.options)
    if (device is not None and "device" not in options and dataclasses.is_dataclass(factory)
            and "device" in {f.name for f in dataclasses.fields(factory)}):
        options["device"] = device
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"bad options {c.options} for reward {c.target!r}: {exc}") from exc


def build_reward(spec: str, *, timeout_s: float = 30.0, start_timeout_s: float = 300.0,
                 device: str | None = None) -> CompositeReward:
    """Parse ``spec``, resolve every component and return the composite. Worker processes
    are not started yet, nor models loaded: call ``.load()`` at executor start. ``device``:
    the executor's, for reward models whose spec names none (see ``resolve``)."""
    components = [Component(name=c.name, fn=resolve(c, device), weight=c.weight, inline=c.target in INLINE_BUILTINS)
                  for c in parse_spec(spec)]
    return CompositeReward(components, timeout_s=timeout_s, start_timeout_s=start_timeout_s)
