"""``local_llamarl``: torchx 0.7.0's ``local_cwd`` scheduler, whose roles run with the
Python that submitted them.

Registered under its own name in the ``torchx.schedulers`` entry-point group
(pyproject.toml; torchx's ``local_cwd`` stays as it is) and named by the repository's
``.torchxconfig``, so ``torchx run`` (the README's default job), ``torchx status``, ``torchx
log`` and the runner API go through it. The one change: the submitting interpreter's
``bin`` directory comes first on every role's ``PATH`` (torchx's own ``extra_paths``, which
its local scheduler puts before the role's and the inherited ``PATH``). Why: the roles
start as ``python -m llamarl.app.roles.<executor>`` by name, so ``.venv/bin/torchx run`` from a shell
without the virtualenv activated (or a script run as ``.venv/bin/python``) gave every role
the system interpreter, and the app failed on ``No module named 'torch'``. ``slurm_llamarl``
does the same for its batch script.
"""

import os
import sys
from types import TracebackType
from typing import Any, List, Optional, Type

from torchx.schedulers.api import AppDryRunInfo
from torchx.schedulers.local_scheduler import CWDImageProvider, LocalOpts, LocalScheduler, PopenRequest, SignalException
from torchx.specs import AppDef

from llamarl.components.dryrun import hide_secret


class LlamarlLocalScheduler(LocalScheduler):
    """torchx's local scheduler whose dry run hides the app's secret (``components.dryrun``)."""

    def _submit_dryrun(self, app: AppDef, cfg: LocalOpts) -> AppDryRunInfo[PopenRequest]:
        return hide_secret(app, super()._submit_dryrun(app, cfg))


def create_scheduler(session_name: str, extra_paths: Optional[List[str]] = None, cache_size: int = 100,
                     **kwargs: Any) -> LlamarlLocalScheduler:
    """torchx's ``local_cwd`` scheduler with the submitting Python's directory first on PATH,
    a dry run that hides the secret, and a one-line end for ``torchx run`` stopped by Ctrl-C
    (``stopped_by_a_signal``)."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = stopped_by_a_signal
    return LlamarlLocalScheduler(session_name=session_name,
                                 image_provider_class=kwargs.get("image_provider_class", CWDImageProvider),
                                 cache_size=cache_size,
                                 extra_paths=[os.path.dirname(sys.executable), *(extra_paths or [])])


def stopped_by_a_signal(kind: Type[BaseException], error: BaseException, tb: Optional[TracebackType]) -> None:
    """How ``torchx run`` ends on Ctrl-C (SIGINT) or SIGTERM: torchx's local scheduler
    raises ``SignalException`` from its signal handler, the runner's ``close`` then stops
    every role (SIGTERM, SIGKILL after 10 s), and the exception, which torchx's CLI does
    not catch, reaches the interpreter: one line saying so instead of its traceback (exit
    code 1, as before). Any other uncaught exception is printed as Python prints it."""
    if isinstance(error, SignalException):
        print(f"torchx run: {error.sigval.name} received: every role of the app was stopped (its run "
              "directory keeps what it recorded)", file=sys.stderr, flush=True)
        return
    sys.__excepthook__(kind, error, tb)
