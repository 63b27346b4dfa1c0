"""--tensorboard (app/metrics/tensorboard.py): the scalars written to metrics.db come back
from TensorBoard's own event reader, tag by tag; a missing package is a clear error."""

from __future__ import annotations

import builtins

import pytest

from llamarl.app.metrics import events as metrics
from llamarl.app.metrics.tensorboard import TensorBoardMirror, summary_writer_class, tag


def read_scalars(path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar under ``path`` as TensorBoard reads it: tag -> [(step, value, wall_time)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value, e.wall_time) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_every_scalar_event_comes_back_with_its_step_value_and_time(tmp_path):
    pytest.importorskip("tensorboard")
    events = [
        metrics.scalar("loss", 0.5, role="trainer", step=1, t=1000.0),
        metrics.scalar("loss", 0.25, role="trainer", step=2, t=1001.0),
        metrics.scalar("idle_fraction", 0.1, role="generator", replica=1, step=2, t=1001.5),
        # No step: the count of the tag's earlier values stands in.
        metrics.scalar("gen/tokens_per_s", 120.0, role="generator", t=1000.5),
        metrics.scalar("gen/tokens_per_s", 130.0, role="generator", t=1001.2),
        metrics.weight_sync(2, "trainer", 1024, 0.01),  # not a scalar: skipped
    ]
    mirror = TensorBoardMirror(tmp_path)
    assert mirror.write(events[:3]) == 3
    assert mirror.write(events[3:]) == 2
    mirror.close()
    assert read_scalars(tmp_path / "tensorboard") == {
        "loss/trainer-0": [(1, 0.5, 1000.0), (2, 0.25, 1001.0)],
        "idle_fraction/generator-1": [(2, pytest.approx(0.1), 1001.5)],
        "gen/tokens_per_s/generator-0": [(0, 120.0, 1000.5), (1, 130.0, pytest.approx(1001.2))],
    }
    assert tag(events[2]) == "idle_fraction/generator-1"


def test_a_missing_package_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard" or name.startswith("tensorboard"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match="--tensorboard needs the tensorboard package: pip install tensorboard"):
        summary_writer_class()
