"""Command-line flags from config dataclasses.

Each field becomes ``--field-name``; its help text is the docstring written under the
field (read from the class source once), so the dataclass stays the single place where
an option is named, typed, documented and validated.

Why this module and not ``tyro``, which builds a parser from the same docstrings: the
trainer's parser must raise ``ConfigError`` instead of exiting (replica 0 hosts the control
store and tells every other role why the run stops), answer a misspelt flag with the
closest one, take the trainer's and the generator's configs on one command line, and
publish the parsed config as JSON for the other roles; tyro exits on errors, and bending
it to each of these would take as much code as the ~150 lines here, plus a dependency
and its own flag spellings to keep in step with the docs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import textwrap
import typing
from typing import Any, Literal, Sequence, TypeVar
from llamarl.app.errors import ConfigError

T = TypeVar("T")



def explained(parser: argparse.ArgumentParser, message: str) -> str:
    """``parser``'s error ``message``, an unknown flag answered with the closest known one
    (and a snake_case one with the dashes flags are spelled with)."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    close = list(dict.fromkeys(m[0] for flag in message.removeprefix(prefix).split() if flag.startswith("--")
                               if (m := difflib.get_close_matches(flag.split("=", 1)[0], known, n=1))))
    if "_" in message:
        message += " (flags are spelled with dashes: --group-size, not --group_size)"
    return message + (f" (did you mean {', '.join(close)}?)" if close else "")


class SuggestingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ``explained`` (then it exits, as argparse does)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        super().error(explained(self, message))


class RaisingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors, ``explained``, raise ``ConfigError`` instead of exiting."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        message = explained(self, message)
        if message.startswith("unrecognized arguments: ") and "did you mean" not in message:
            # Read in a role's log, far from the usage that argparse prints beside its error.
            message += f" (`python -m {self.prog} --help` lists every flag)"
        raise ConfigError(f"{self.prog}: {message}")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any, doc: str) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else None
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    kwargs: dict[str, Any] = {"dest": f.name, "help": f"{doc} (default: {default!r})", "required": required}
    if typing.get_origin(hint) is Literal:
        kwargs.update(choices=list(typing.get_args(hint)), type=type(typing.get_args(hint)[0]))
    elif hint is bool:
        kwargs.update(action=argparse.BooleanOptionalAction)
        del kwargs["required"]
    elif typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        words = [v for a in inner if typing.get_origin(a) is Literal for v in typing.get_args(a)]
        kinds = [a for a in inner if typing.get_origin(a) is not Literal]
        kwargs.update(type=_word_or(kinds[0], words) if words else kinds[0])
    else:
        kwargs.update(type=hint)
    parser.add_argument(flag, **kwargs)


def _word_or(kind: type, words: list[str]) -> Any:
    """A flag's converter for ``int | Literal["auto"]``: one of ``words``, else a ``kind``."""
    def convert(value: str) -> Any:
        if value in words:
            return value
        try:
            return kind(value)
        except ValueError:
            choices = " or ".join(repr(w) for w in words)
            raise argparse.ArgumentTypeError(f"an {kind.__name__} or {choices}, got {value!r}") from None
    convert.__name__ = f"{kind.__name__} or {'/'.join(words)}"
    return convert


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, inspect.getdoc(cls) or None)
    for f in dataclasses.fields(cls):
        _add_field(group, f, hints[f.name], docs.get(f.name, ""))  # type: ignore[arg-type]


def config_from_args(args: argparse.Namespace, cls: type[T]) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return cls(**given)


def parse(argv: Sequence[str] | None, *classes: type, description: str = "", prog: str | None = None) -> list[Any]:
    """Parse ``argv`` into one instance of each config class (flags must not clash)."""
    parser = SuggestingParser(description=description, prog=prog)
    for cls in classes:
        add_config_args(parser, cls)
    args = parser.parse_args(argv)
    try:
        return [config_from_args(args, cls) for cls in classes]
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The control store's flags of the trainer role (``llamarl.app.roles.launch`` reads them too)."""
    parser.add_argument("--store-port", type=int, default=0,
                        help="port of the control store on replica 0 (0: derived from --app-id)")
    parser.add_argument("--app-id", default="", help="the TorchX app id, published on the control store")
    parser.add_argument("--store-host", default="",
                        help="host of trainer replica 0, where trainer ranks > 0 reach the control store "
                             "(llamarl.app.roles.launch sets it for a trainer of several nodes); empty or a loopback name: "
                             "where the store listens (--store-bind)")
    parser.add_argument("--store-bind", default="127.0.0.1",
                        help="where the control store listens: an address or host name of this host, the "
                             "one the other roles connect to (the component passes the trainer's host as "
                             "TorchX names it to them), or 0.0.0.0 for every interface")
    add_secret_argument(parser)


SECRET_FILE_FLAG_HELP = ("file holding the app's secret (hex; mode 600, checked); default: the file "
                         "$LLAMARL_SECRET_FILE names, else $LLAMARL_SECRET (roles started by hand)")


def add_secret_argument(parser: argparse.ArgumentParser) -> None:
    """``--secret-file``, which every role takes (``llamarl.app.control.frames.read_secret``)."""
    parser.add_argument("--secret-file", default="", help=SECRET_FILE_FLAG_HELP)
