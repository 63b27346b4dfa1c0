"""A replica's proof of life before it can give one in the control store.

A generator or reward executor registers in the control store, and beats its heart
there, only once it has imported torch and reached the store: seconds, more on a loaded
machine. Killed in between (SIGKILL, the OOM killer), it writes no error file and no
heartbeat, and the trainer would wait for it until its start-up deadline. So, as the
first act of the role's interpreter (before ``import torch``), it takes an exclusive
``flock`` on ``alive.lock`` in its own replica directory and holds it for its life
(``hold``). The kernel lets go of the lock when the process ends, however it ends, and
no reused pid can hold it: a member that never registered and whose lock is free is
gone (``released``; ``health.check_health`` names it).

This needs TorchX's local scheduler's layout, where every replica of the app has a
directory beside the others' (``<app log dir>/<role>/<replica>/``, its error file in
it). Other schedulers end the whole job when a role's process dies and keep no such
shared directory: there ``hold`` does nothing. Standard library only: it is imported
before torch.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where TorchX's local, SLURM and Kubernetes schedulers expect a replica's error file."""
REPLICA_ERROR_FILE_ENV = "LLAMARL_REPLICA_ERROR_FILE"
"""The scheduler's error file of this replica, for the trainer ranks, whose own
``$TORCHELASTIC_ERROR_FILE`` is torchrun's (set by ``llamarl.app.roles.launch``)."""
LOCK_NAME = "alive.lock"

_held: list[int] = []  # the lock's descriptor, open for the process's life


def own_replica_dir() -> Path | None:
    """This replica's directory in TorchX's local layout (``<app log dir>/<role>/<k>/``,
    where its error file is), or ``None`` under another scheduler or started by hand."""
    own = os.environ.get(REPLICA_ERROR_FILE_ENV) or os.environ.get(ERROR_FILE_ENV)
    if not own or not own.endswith("/error.json"):
        return None
    replica_dir = Path(own).parent
    return replica_dir if replica_dir.name.isdigit() else None


def sibling_replica_dirs() -> dict[str, Path]:
    """``{"generator/1": dir}`` for every other replica of this app in the local layout;
    empty outside it."""
    replica_dir = own_replica_dir()
    if replica_dir is None:
        return {}
    app_dir = replica_dir.parent.parent
    return {f"{d.parent.name}/{d.name}": d for d in sorted(app_dir.glob("*/*"))
            if d.name.isdigit() and d != replica_dir and d.is_dir()}


def hold() -> Path | None:
    """Take and keep this process's lock in its replica directory; the lock file's path,
    or ``None`` where there is no such directory (or it is not writable: then the
    trainer learns of a death before registration only at its start-up deadline).

    The lock is taken on a file of a temporary name, which is then renamed: an observer
    never sees ``alive.lock`` before it is locked (it would call the member gone). The
    descriptor is not inherited by ``subprocess`` children (PEP 446), so a reward worker
    outliving its executor does not keep it alive."""
    replica_dir = own_replica_dir()
    if replica_dir is None:
        return None
    path = replica_dir / LOCK_NAME
    tmp = replica_dir / f".{LOCK_NAME}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.replace(tmp, path)
    except OSError:
        return None
    _held.append(fd)
    return path


def released(replica_dir: Path) -> bool:
    """Whether a process took the lock in ``replica_dir`` and has ended (no file: none
    took it yet, or it runs under no lock; ``False``)."""
    try:
        fd = os.open(replica_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its process holds it: alive
    except OSError:
        return False
    finally:
        os.close(fd)  # closing lets go of a lock taken here
    return True
