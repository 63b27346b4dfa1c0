"""``--tensorboard``: every scalar the metrics database records, also as TensorBoard events.

The SQLite database and the dashboard stay the source of truth; this is a copy for
people who watch runs in TensorBoard. Trainer replica 0 hands it the same events it
writes to ``metrics.db``; it keeps the scalars. A scalar's tag is ``<name>/<role>-<replica>``
(``loss/trainer-0``, ``gen/tokens_per_s/generator-1``), so replicas stay apart and
TensorBoard groups tags by the metric's own prefix. Its step is the training step it
belongs to; a scalar recorded without one (generator throughput) takes the count of that
tag's earlier values. Times are the events' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

DIR_NAME = "tensorboard"
"""The event files' directory inside a run directory."""


def summary_writer_class() -> type:
    """torch's ``SummaryWriter``, or an ImportError that says what to install (torch's own
    says only that the package is missing). Called at start-up, before anything trains."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("--tensorboard needs the tensorboard package: pip install tensorboard "
                          f"(or pip install -e '.[tensorboard]' in the repository) ({e})") from e
    return SummaryWriter


def tag(event: dict[str, Any]) -> str:
    return f"{event['name']}/{event['role']}-{event['replica']}"


class TensorBoardMirror:
    """Writes the scalar events it is given under ``<run_dir>/tensorboard/``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / DIR_NAME
        self._writer = summary_writer_class()(log_dir=str(self.path))
        self._counts: dict[str, int] = {}

    def write(self, events: Iterable[dict[str, Any]]) -> int:
        """Write the ``scalar`` events among ``events`` (others are ignored); returns how many."""
        n = 0
        for ev in events:
            if ev.get("type") != "scalar":
                continue
            name = tag(ev)
            step = ev["step"] if ev.get("step") is not None else self._counts.get(name, 0)
            self._counts[name] = self._counts.get(name, 0) + 1
            self._writer.add_scalar(name, float(ev["value"]), global_step=int(step), walltime=ev["t"])
            n += 1
        self._writer.flush()
        return n

    def close(self) -> None:
        self._writer.close()
