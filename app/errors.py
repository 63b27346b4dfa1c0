"""The errors a user is meant to read: a refused flag, input or device.

Each is a ``ConfigError``: its message is the whole story, and a role that raises one ends on
that one line with exit code 1 and no traceback (``llamarl.app.control.health.reported``).
Other exceptions are bugs or failures of the machinery and keep their tracebacks. Pure: no
imports, so every layer (``names`` included) can raise them.
"""


class ConfigError(ValueError):
    """A flag, a config value or an input (a dataset, a policy directory, a device) the run
    refuses (raised instead of argparse's exit, so a role that hosts the control store can
    tell the others why it stops)."""


class DataError(ConfigError):
    """Bad dataset input; the message names the file and, for a row, the row."""


class DeviceError(ConfigError):
    """A role was asked for a device (or a precision on it) that it cannot have."""
