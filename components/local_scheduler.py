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
from typing import Any, Dict, List, Optional, Type

from torchx.schedulers.api import AppDryRunInfo, DescribeAppResponse
from torchx.schedulers.local_scheduler import CWDImageProvider, LocalOpts, LocalScheduler, PopenRequest, SignalException
from torchx.specs import NONE, AppDef, AppState

from llamarl.components.dryrun import hide_secret

TRAINER_ROLE = "trainer"  # roles[0] of llamarl.components.llamarl


class LlamarlLocalScheduler(LocalScheduler):
    """torchx's local scheduler whose dry run hides the app's secret (``components.dryrun``)
    and whose final state is the run's: SUCCEEDED when the trainer finished it, even if a
    generator or reward executor was lost on the way (``describe``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._survived: Dict[str, str] = {}
        """App id -> what was lost in an app whose trainer finished the run."""

    def _submit_dryrun(self, app: AppDef, cfg: LocalOpts) -> AppDryRunInfo[PopenRequest]:
        return hide_secret(app, super()._submit_dryrun(app, cfg))

    def describe(self, app_id: str) -> Optional[DescribeAppResponse]:
        """torchx calls an app FAILED when any replica exited non-zero. A llamarl app
        survives a lost generator or reward executor, and its trainer exits 0 only when it
        finished every step: then the app SUCCEEDED, and the message names who was lost
        (``torchx run``'s exit code and ``torchx status`` tell a finished run from a failed one)."""
        resp = super().describe(app_id)
        if resp is not None and resp.state == AppState.FAILED:
            replicas = self._apps[app_id].role_replicas
            trainer = replicas.get(TRAINER_ROLE, [])
            if trainer and not any(r.is_alive() or r.failed() for r in trainer):
                lost = [f"{r.role_name}/{r.replica_id} (exit code {r.proc.returncode})"
                        for role in replicas.values() for r in role if r.failed()]
                self._apps[app_id].set_state(AppState.SUCCEEDED)
                self._survived[app_id] = ("the trainer finished the run; lost on the way and survived: "
                                          + ", ".join(lost))
        if resp is not None and app_id in self._survived:
            resp.state, resp.msg, resp.structured_error_msg = AppState.SUCCEEDED, self._survived[app_id], NONE
        return resp


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
