"""The test interpreter's bin directory, first on the PATH of processes started by name.

The README's test command, ``.venv/bin/python -m pytest``, runs from a new shell without
the virtualenv activated. TorchX roles start ``python -m app.generator`` and ``python -m
torch.distributed.run`` by name, so they would find the system interpreter on PATH, one
without llamarl's dependencies. Tests that start processes by name give them this
directory first on PATH; processes started as ``sys.executable`` need nothing.
"""

import os
import sys

VENV_BIN = os.path.dirname(sys.executable)


def component_env(extra: dict[str, str] | None = None) -> list[str]:
    """The llamarl component's ``--env`` option that puts ``VENV_BIN`` first on every role's
    PATH (TorchX's local schedulers put a role's PATH before the one they inherit), with
    the ``extra`` variables too (values without ``,`` or ``=``)."""
    env = {"PATH": VENV_BIN, **(extra or {})}
    return ["--env", ",".join(f"{k}={v}" for k, v in env.items())]
