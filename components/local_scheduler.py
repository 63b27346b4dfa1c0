"""The ``local_cwd`` TorchX scheduler of llamarl: torchx 0.7.0's local scheduler, whose
roles run with the Python that submitted them.

Registered under the name ``local_cwd`` in the ``torchx.schedulers`` entry-point group
(pyproject.toml), so ``torchx run`` (the README's default job), ``torchx status``, ``torchx
log`` and the runner API go through it. The one change: the submitting interpreter's
``bin`` directory comes first on every role's ``PATH`` (torchx's own ``extra_paths``, which
its local scheduler puts before the role's and the inherited ``PATH``). Why: the roles
start as ``python -m app.<executor>`` by name, so ``.venv/bin/torchx run`` from a shell
without the virtualenv activated (or a script run as ``.venv/bin/python``) gave every role
the system interpreter, and the app failed on ``No module named 'torch'``. llamarl's
``slurm`` scheduler does the same for its batch script.
"""

import os
import sys
from typing import Any, List, Optional

from torchx.schedulers.local_scheduler import LocalScheduler
from torchx.schedulers.local_scheduler import create_scheduler as create_torchx_local_scheduler


def create_scheduler(session_name: str, extra_paths: Optional[List[str]] = None, **kwargs: Any) -> LocalScheduler:
    """torchx's ``local_cwd`` scheduler with the submitting Python's directory first on PATH."""
    return create_torchx_local_scheduler(
        session_name, extra_paths=[os.path.dirname(sys.executable), *(extra_paths or [])], **kwargs)
