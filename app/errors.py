"""The errors a user is meant to read: a refused flag, input or device.

Each is a ``ConfigError``: its message is the whole story, and a role that raises one ends on
that one line with exit code 1 and no traceback (``llamarl.app.control.health.reported``).
Other exceptions are bugs or failures of the machinery and keep their tracebacks. Pure: no
imports, so every layer (``names`` included) can raise them. ``check_at_least`` is the one
range check of the typed configs' ``__post_init__`` (a plain ``ValueError``, which
``llamarl.app.cli`` turns into the flag's argparse error).
"""


class ConfigError(ValueError):
    """A flag, a config value or an input (a dataset, a policy directory, a device) the run
    refuses (raised instead of argparse's exit, so a role that hosts the control store can
    tell the others why it stops)."""


class DataError(ConfigError):
    """Bad dataset input; the message names the file and, for a row, the row."""


class DeviceError(ConfigError):
    """A role was asked for a device (or a precision on it) that it cannot have."""


def check_at_least(config: object, low: float, *fields: str, strict: bool = False) -> None:
    """Refuse the first of ``fields`` of ``config`` below ``low`` (with ``strict``, at ``low``
    too): ``ValueError("<field> must be >= <low>, got <value>")`` (``> <low>`` with ``strict``),
    the message every config gives for a number out of its range."""
    for name in fields:
        value = getattr(config, name)
        if value < low or (strict and value == low):
            raise ValueError(f"{name} must be {'>' if strict else '>='} {low:g}, got {value}")
