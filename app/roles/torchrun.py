"""torchrun (``torch.distributed.run``) as ``llamarl.app.roles.launch`` runs it: the same agent, whose
end on a failed rank is one line instead of a Python traceback of the agent around
torchrun's ``ChildFailedError`` banner (some 40 lines in the terminal above the cause,
which ``llamarl.app.roles.launch`` prints last from the rank's own error file).

    python -m llamarl.app.roles.torchrun --nproc_per_node 2 --standalone --nnodes 1 -m llamarl.app.roles.trainer ...

The line, ``FAILED_RANK_LINE``, names the first failed rank and its exit code, from which
``llamarl.app.roles.launch`` names a rank that a signal killed with no Python error. torchrun's error
file (the failed rank's, copied by its ``@record``) is written as before. A stop signal
(``SignalException``, raised in the agent by its SIGTERM/SIGINT handler, after it stopped
its ranks) ends it quietly with exit code 1, as torchrun's own end does: ``llamarl.app.roles.launch``,
which forwarded the signal, names the stop.
"""

from __future__ import annotations

import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

FAILED_RANK_LINE = "torchrun: rank {rank} failed first, exit code {exitcode}"
"""Printed to stderr when a rank failed (``llamarl.app.roles.launch.FAILED_RANK`` reads it back)."""


def main(argv: list[str] | None = None) -> None:
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
