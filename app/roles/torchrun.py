"""torchrun (``torch.distributed.run``) as ``llamarl.app.roles.launch`` runs it: the same agent, whose
end on a failed rank is one line instead of a Python traceback of the agent around
torchrun's ``ChildFailedError`` banner (some 40 lines in the terminal above the cause,
which ``llamarl.app.roles.launch`` prints last from the rank's own error file).

    python -m llamarl.app.roles.torchrun --nproc_per_node 2 --standalone --nnodes 1 -m llamarl.app.roles.trainer ...

The line, ``health.FAILED_RANK_LINE``, names the first failed rank and its exit code, from which
``llamarl.app.roles.launch`` names a rank that a signal killed with no Python error. torchrun's error
file (the failed rank's, copied by its ``@record``) is written as before. A stop signal
(``SignalException``, raised in the agent by its SIGTERM/SIGINT handler, after it stopped
its ranks) ends it quietly with exit code 1, as torchrun's own end does: ``llamarl.app.roles.launch``,
which forwarded the signal, names the stop; a second stop signal is ignored (``_stop_once``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

from torch.distributed import run
from torch.distributed.elastic.multiprocessing import api as elastic_api
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from llamarl.app.control.health import FAILED_RANK_LINE


def _stop_once(signum: int, frame: FrameType | None) -> None:
    """torchrun's stop handler, raising ``SignalException`` on the first stop signal only.
    Under SLURM the agent gets SIGTERM twice, from slurmstepd (which signals every process
    of the step) and forwarded by ``llamarl.app.roles.launch``; the second, raised inside the
    agent's shutdown of its ranks, ends in some 40 lines of ``--- Logging error ---``.
    Later signals are ignored by a Python handler (not ``SIG_IGN``, which the ranks that
    torchrun may still start would inherit). The agent's own warnings about the stop
    (``Received 15 death signal``, ``Sending process N closing signal``) are silenced:
    ``llamarl.app.roles.launch`` says it in one line."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if sig is not None:
            signal.signal(sig, _ignore)
    _terminate_process_handler(signum, frame)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A stop signal after the first: the agent is stopping already."""


def main(argv: list[str] | None = None) -> None:
    elastic_api._terminate_process_handler = _stop_once
    try:
        run.main(argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(FAILED_RANK_LINE.format(rank=rank, exitcode=failure.exitcode), file=sys.stderr, flush=True)
        sys.exit(1)
    except SignalException:
        sys.exit(1)


if __name__ == "__main__":
    main()
