"""A metrics batch from the queue is checked before it reaches SQLite
(``llamarl.app.metrics.events.checked_batch``): a signed batch that breaks the format is dropped and
counted by the trainer, never written and never fatal."""

from __future__ import annotations

import pytest

from llamarl.app.metrics import events as metrics


def every_kind() -> list[dict]:
    """One event of each type, as the executors make them."""
    return [metrics.scalar("loss", 0.5, role="trainer", step=3),
            metrics.interval("busy", "train", 1.0, 2.0, role="trainer"),
            metrics.staleness(3, 2, 1, True),
            metrics.weight_sync(2, "generator/0", 1024, 0.01),
            metrics.reward("math_verifier", None, step=3, reason="timeout")]


def batch(events) -> dict:
    return metrics.batch_message(events, sender="generator/1", stream=77, seq=3, attempt="a1")


def test_the_executors_events_pass_and_are_written(tmp_path):
    events = every_kind()
    assert metrics.checked_batch(batch(events)) == (("generator/1", 77, "a1"), 3, events)
    writer = metrics.MetricsWriter(tmp_path, run_id="t", config={})
    assert writer.write(events) == len(events)
    writer.close()


@pytest.mark.parametrize("msg, reason", [
    ({"events": []}, "missing_field"),  # no id
    ({**batch([]), "seq": "3"}, "wrong_type"),
    ({**batch([]), "stream": True}, "wrong_type"),
    ({**batch([]), "seq": -1}, "bad_value"),
    ({k: v for k, v in batch([]).items() if k != "attempt"}, "missing_field"),
    ({**batch([]), "attempt": 1}, "wrong_type"),
    ({k: v for k, v in batch([]).items() if k != "events"}, "missing_field"),
    ({**batch([]), "events": "loss"}, "wrong_type"),
    (batch([{"type": "pickle"}]), "bad_value"),
    (batch([[1, 2]]), "bad_value"),
    (batch([{k: v for k, v in metrics.scalar("loss", 1.0, role="trainer").items() if k != "name"}]),
     "missing_field"),
    (batch([{**metrics.scalar("loss", 1.0, role="trainer"), "value": "1.0"}]), "wrong_type"),
    (batch([{**metrics.scalar("loss", 1.0, role="trainer"), "value": None}]), "wrong_type"),
    (batch([{**metrics.staleness(1, 0, 1, True), "used": True}]), "wrong_type"),
    (batch([{**metrics.interval("idle", "wait", 0.0, 1.0, role="reward"), "what": {"x": 1}}]),
     "wrong_type"),
])
def test_a_batch_that_breaks_the_format_is_refused_with_a_reason(msg, reason):
    with pytest.raises(metrics.MalformedEvents) as err:
        metrics.checked_batch(msg)
    assert err.value.reason == reason


def test_a_database_locked_by_another_process_never_ends_the_run_and_nothing_is_lost(tmp_path, caplog):
    """An SQLite browser or a backup holding metrics.db's write lock: the writer keeps the
    events in memory, says once who holds the file, and writes them all when it is free."""
    import sqlite3
    import subprocess
    import sys

    writer = metrics.MetricsWriter(tmp_path, run_id="t", config={})
    # Another process takes the write lock and holds it until told to let go.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys\n"
         f"db = sqlite3.connect({str(tmp_path / metrics.DB_NAME)!r}, isolation_level=None)\n"
         "db.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.readline()\n"
         "db.execute('COMMIT')\n"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with caplog.at_level("WARNING", logger="llamarl"):
            assert writer.write(every_kind()) == 0
            writer.set_meta("last_checkpoint", "{}")
            assert writer.write(every_kind()) == 0
        assert writer.pending == 2 * len(every_kind())
        said = [r.getMessage() for r in caplog.records if "is locked by another process" in r.getMessage()]
        assert len(said) == 1 and f"pid {holder.pid} (python" in said[0], said
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        assert writer.write(every_kind()) == 3 * len(every_kind())
        assert writer.pending == 0
    finally:
        holder.kill()
    writer.close()
    db = sqlite3.connect(tmp_path / metrics.DB_NAME)
    assert db.execute("SELECT COUNT(*) FROM scalars").fetchone()[0] == 3
    assert db.execute("SELECT value FROM meta WHERE key = 'last_checkpoint'").fetchone()[0] == "{}"
    assert db.execute("SELECT COUNT(*) FROM meta WHERE key = 'finished_at'").fetchone()[0] == 1
