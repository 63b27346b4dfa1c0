"""llamarl.dashboard.data against run directories written by llamarl.app.metrics.events (tests/dashboard_fixtures.py)."""

from __future__ import annotations

import sqlite3

import pandas as pd
import pytest

from llamarl.app.metrics import events as m
from llamarl.dashboard import charts, data, database
from dashboard_fixtures import LiveRun, make_run, make_runs_root


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return make_runs_root(tmp_path_factory.mktemp("runs"))


def raw(run_dir, sql: str) -> pd.DataFrame:
    """The table as written, read without llamarl.dashboard.data, to check its aggregates against."""
    with sqlite3.connect(run_dir / m.DB_NAME) as db:
        return pd.read_sql_query(sql, db)


def test_list_runs_reports_every_run_and_why_it_cannot_be_shown(runs_root):
    infos = {i.run_id: i for i in data.list_runs(runs_root)}
    assert {k: i.status for k, i in infos.items()} == {
        "sync-run": "ok", "async-run": "ok", "meta-only-run": "empty", "empty-run": "no metrics",
        "old-schema-run": "old schema", "corrupt-run": "corrupt"}
    assert infos["corrupt-run"].message and infos["old-schema-run"].message
    assert infos["sync-run"].config["max_staleness"] == 0
    assert infos["empty-run"].config["max_staleness"] == 2  # from config.json, no database
    assert not infos["sync-run"].live  # events from a fixed clock in the past
    assert infos["old-schema-run"].label == "old-schema-run · old schema"


def test_unreadable_metrics_are_named_and_never_hide_the_other_runs(tmp_path):
    make_run(tmp_path / "good-run", steps=3)
    (tmp_path / "dir-run" / m.DB_NAME).mkdir(parents=True)
    text_run = make_run(tmp_path / "text-run", steps=3)
    with sqlite3.connect(text_run / m.DB_NAME) as db:
        db.execute("UPDATE scalars SET t = 'yesterday' WHERE rowid = (SELECT MAX(rowid) FROM scalars)")
    infos = {i.run_id: i for i in data.list_runs(tmp_path)}
    assert infos["good-run"].status == "ok"
    assert infos["dir-run"].status == "corrupt" and "is not a file" in infos["dir-run"].message
    assert infos["text-run"].status == "corrupt"
    assert "'yesterday' where an event time (a number) belongs" in infos["text-run"].message


def test_list_runs_of_missing_root_is_a_typed_error(tmp_path):
    with pytest.raises(data.RunNotFound, match="does not exist"):
        data.list_runs(tmp_path / "nope")
    assert data.list_runs(tmp_path) == []


@pytest.mark.parametrize("name, error, level, phrase", [
    ("empty-run", data.NoMetricsYet, "info", "no metrics.db yet"),
    ("corrupt-run", data.CorruptDatabase, "error", "not a readable SQLite database"),
    ("old-schema-run", data.SchemaMismatch, "error", "schema 0"),
    ("no-such-run", data.RunNotFound, "error", "does not exist"),
])
def test_broken_runs_raise_typed_errors_with_messages(runs_root, name, error, level, phrase):
    with pytest.raises(error, match=phrase) as info:
        data.open_run(runs_root / name)
    assert info.value.level == level


def test_zero_byte_database_is_a_run_still_starting(tmp_path):
    (tmp_path / m.DB_NAME).write_bytes(b"")
    with pytest.raises(data.NoMetricsYet):
        data.open_run(tmp_path)


def test_auto_bound_changes_and_the_largest_bound(tmp_path):
    with data.open_run(make_run(tmp_path / "auto", steps=8, auto=True)) as run:
        assert run.auto_staleness and run.max_staleness == 2
        changes = run.bound_changes()
        assert list(changes[["step", "previous", "bound"]].itertuples(index=False, name=None)) == [(3, 1, 2), (6, 2, 1)]
    # A database from before the table existed opens, with no change.
    run_dir = make_run(tmp_path / "old", steps=2)
    with sqlite3.connect(run_dir / m.DB_NAME) as db:
        db.execute("DROP TABLE staleness_bounds")
    with data.open_run(run_dir) as run:
        assert run.bound_changes().empty and not run.auto_staleness


def test_missing_table_of_current_version_is_a_schema_mismatch(tmp_path):
    run_dir = make_run(tmp_path / "r", steps=2)
    with sqlite3.connect(run_dir / m.DB_NAME) as db:
        db.execute("DROP TABLE rewards")
    with pytest.raises(data.SchemaMismatch, match="rewards"):
        data.open_run(run_dir)


def test_meta_only_run_opens_and_every_query_is_empty(runs_root):
    with data.open_run(runs_root / "meta-only-run") as run:
        assert run.is_empty() and run.max_staleness == 2
        assert run.headline() == data.Headline()
        for frame in (run.scalar_series(["loss"]), run.scalar_series(prefix="queue/"), run.intervals(),
                      run.idle_fractions(), run.staleness_histogram(), run.staleness_by_step(),
                      run.weight_sync(), run.rewards(), run.queue_depths()):
            assert frame.empty
        # The figure builders accept what an empty run returns.
        charts.timeline_figure(run.intervals())
        charts.line_figure(run.scalar_series(["loss"]), "loss")


def test_connection_is_read_only(runs_root):
    db, _ = database.connect(runs_root / "sync-run")  # what open_run reads through
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.execute("DELETE FROM scalars")
    finally:
        db.close()


def test_headline_of_sync_and_async_runs(runs_root):
    with data.open_run(runs_root / "sync-run") as sync, data.open_run(runs_root / "async-run") as asyn:
        hs, ha = sync.headline(), asyn.headline()
    assert hs.step == ha.step == 40
    assert hs.mean_staleness == 0.0 and ha.mean_staleness > 0
    assert hs.last_sync_version == 40 and hs.last_sync_s > 0
    assert hs.gen_tokens_per_s > 0 and hs.train_tokens_per_s > 0
    # Only the async run saved a checkpoint.
    assert hs.last_checkpoint_step is None and hs.last_checkpoint_path is None
    assert ha.last_checkpoint_step == 40
    assert ha.last_checkpoint_path == str(runs_root / "async-run" / "checkpoints" / "step-40")
    # Overlapping generation with training is the point of the async design.
    assert ha.idle_fraction < hs.idle_fraction


def test_staleness_aggregates_match_the_rows(runs_root):
    run_dir = runs_root / "async-run"
    rows = raw(run_dir, "SELECT * FROM staleness")
    with data.open_run(run_dir) as run:
        hist, steps, bound = run.staleness_histogram(), run.staleness_by_step(), run.max_staleness
    assert bound == 2
    expected = rows.groupby("staleness")["used"].agg(["sum", "count"])
    assert list(hist["staleness"]) == list(expected.index)
    assert list(hist["used"]) == list(expected["sum"])
    assert list(hist["used"] + hist["dropped"]) == list(expected["count"])
    assert (hist.loc[hist["staleness"] > bound, "used"] == 0).all()  # nothing over the bound trained on
    assert len(steps) == rows["step"].nunique()
    assert steps["mean"].max() <= bound
    assert steps["mean"].mean() == pytest.approx(
        rows[rows.used == 1].groupby("step")["staleness"].mean().mean())


def test_idle_fractions_match_the_intervals(runs_root):
    run_dir = runs_root / "sync-run"
    rows = raw(run_dir, "SELECT * FROM intervals").assign(d=lambda f: f.t1 - f.t0)
    with data.open_run(run_dir) as run:
        idle = run.idle_fractions().set_index(["role", "replica"])
    for (role, replica), g in rows.groupby(["role", "replica"]):
        assert idle.loc[(role, replica), "idle_fraction"] == pytest.approx(
            g.loc[g.kind == "idle", "d"].sum() / g["d"].sum())


def test_intervals_window_and_merging(runs_root):
    with data.open_run(runs_root / "async-run") as run:
        whole = run.intervals()
        window = run.intervals(start_s=30.0)
        merged = run.intervals(max_rows=10, buckets=20)
        idle = run.idle_fractions()
        n_intervals = run.counts()["intervals"]
    assert len(whole) == n_intervals
    assert set(whole["busy_fraction"]) == {0.0, 1.0} and (whole["n"] == 1).all()
    assert window["t1"].min() >= 30.0 and len(window) < len(whole)
    lanes = len(idle)
    assert len(merged) <= lanes * 20 and merged["n"].sum() == len(whole)
    assert merged["busy_fraction"].between(0, 1).all()
    # Time-weighted busy share survives merging.
    busy_merged = (merged["busy_fraction"] * merged["n"]).sum() / merged["n"].sum()
    assert busy_merged == pytest.approx(1 - idle["idle_s"].sum() / idle["total_s"].sum(), abs=0.05)


def test_scalar_series_downsamples_in_sql_and_keeps_the_mean(tmp_path):
    run_dir = make_run(tmp_path / "long", steps=1200)
    rows = raw(run_dir, "SELECT * FROM scalars WHERE name = 'loss'")
    with data.open_run(run_dir) as run:
        loss = run.scalar_series(["loss"], max_points=100)
        gen = run.scalar_series(["gen/tokens_per_s"], max_points=100)
        gen_sum = run.scalar_series(["gen/tokens_per_s"], max_points=100, replicas="sum")
        tail = run.scalar_series(["loss"], since_s=loss["t"].iloc[-1] - 5)
    assert 90 <= len(loss) <= 100 and loss["n"].sum() == len(rows)
    assert (loss["value"] * loss["n"]).sum() / loss["n"].sum() == pytest.approx(rows["value"].mean())
    assert loss["t"].is_monotonic_increasing and loss["step"].iloc[-1] == 1200
    assert len(gen) <= 200 and set(gen["replica"]) == {0, 1}
    assert (gen_sum["replica"] == -1).all() and len(gen_sum) <= 100
    assert gen_sum["value"].mean() == pytest.approx(2 * gen["value"].mean(), rel=0.02)
    assert 0 < len(tail) < len(loss)


def test_weight_sync_rewards_and_queues(runs_root):
    run_dir = runs_root / "async-run"
    with data.open_run(run_dir) as run:
        sync = run.weight_sync()
        strided = run.weight_sync(max_points=8)
        receivers = run.weight_sync_receivers()
        senders = run.weight_sync_senders()
        by_sender = run.weight_sync_by_sender()
        rewards = run.rewards()
        reasons = run.quarantine_reasons()
        queues = run.queue_depths()
        names = run.scalar_names()
    assert list(sync["version"]) == list(range(1, 41)) and (sync["receivers"] == 2).all()
    assert (sync["seconds_max"] >= sync["seconds_mean"]).all() and (sync["gbytes_per_s"] > 0).all()
    assert len(strided) <= 8
    assert set(receivers["receiver"]) == {"generator0", "generator1"}
    # Per sender: each trainer rank's shard, half the model each, every version.
    assert list(senders["sender"]) == ["trainer/0", "trainer/1"] and (senders["syncs"] == 40).all()
    assert senders["bytes_per_sync"].sum() == sync["bytes"].iloc[0]
    assert len(by_sender) == 80 and set(by_sender["sender"]) == {"trainer/0", "trainer/1"}
    assert set(rewards["component"]) == {"correctness", "format"}
    nulls = raw(run_dir, "SELECT COUNT(*) AS n FROM rewards WHERE value IS NULL")["n"][0]
    assert rewards["quarantined"].sum() == reasons["n"].sum() == nulls
    assert set(queues["queue"]) == {"prompts", "rollouts"}
    assert {"gen/tokens_per_s", "train/tokens_per_s", "loss", "kl", "eval/accuracy"} <= set(names)


def test_security_counts_are_the_highest_count_of_each_process(runs_root):
    with data.open_run(runs_root / "async-run") as run:
        counts = run.security_counts()
    assert [tuple(r) for r in counts.itertuples(index=False)] == [
        ("security/rejected_frames/bad_tag", "trainer", 0, 3.0),
        ("security/rejected_frames/replay", "trainer", 0, 1.0),
        ("security/weight_digest/mismatch", "generator", 1, 1.0)]
    with data.open_run(runs_root / "sync-run") as run:
        assert run.security_counts().empty


def test_live_run_is_read_while_it_is_written(tmp_path):
    run_dir = tmp_path / "live"
    with LiveRun(run_dir) as live:
        with data.open_run(run_dir) as run:
            assert run.is_live()
            first = run.headline().step
            live.wait_for_steps(first + 5)
            assert run.headline().step > first  # the same read-only connection sees new commits
            assert run.scalar_series(["loss"])["n"].sum() >= first + 5
        assert [i.live for i in data.list_runs(tmp_path)] == [True]


def test_a_resumed_run_is_one_run_with_a_marker_and_no_lost_steps_twice(tmp_path):
    """The trainer's writer resumed at step 2 (saved at t=102): what the crashed attempt
    recorded after the checkpoint is gone, the resumed steps are there once, marked."""
    run_dir = tmp_path / "r"
    writer = m.MetricsWriter(run_dir, run_id="r", config={"max_staleness": 1})
    writer.write([m.scalar("loss", float(s), role="trainer", step=s, t=100.0 + s) for s in range(1, 5)]
                 + [m.scalar("gen/tokens_per_s", 1.0, role="generator", t=t) for t in (101.0, 103.5)]
                 + [m.staleness(s, s - 1, 1, True) | {"t": 100.0 + s} for s in range(1, 5)]
                 + [m.interval("busy", "train", 101.0, 101.5, role="trainer"),
                    m.interval("busy", "train", 103.0, 103.5, role="trainer")])
    writer.close(finished=False)
    again = m.MetricsWriter(run_dir, run_id="r", config={"max_staleness": 1})
    again.resume_at(2, 102.0)
    again.write([m.scalar("loss", -float(s), role="trainer", step=s, t=200.0 + s) for s in (3, 4)])
    again.close()
    with data.open_run(run_dir) as run:
        loss = run.scalar_series(["loss"])
        assert list(loss["step"]) == [1, 2, 3, 4] and list(loss["value"]) == [1.0, 2.0, -3.0, -4.0]
        assert list(run.scalar_series(["gen/tokens_per_s"])["t"]) == [101.0 - run.t0]
        assert len(run.intervals()) == 1
        assert list(raw(run_dir, "SELECT step FROM staleness")["step"]) == [1, 2]
        ((step, t),) = run.resumes()
        assert step == 2 and t > 0
        assert not run.is_live()  # finished after the resume
        fig = charts.line_figure(loss, "loss", markers=[(t, "resumed at step 2")])
        assert fig.layout.shapes[0].x0 == t and fig.layout.annotations[0].text == "resumed at step 2"
    # Resumed before any checkpoint (step 0): nothing of the earlier attempts is kept.
    third = m.MetricsWriter(run_dir, run_id="r", config={"max_staleness": 1})
    third.resume_at(-1, 0.0)
    third.close(finished=False)
    with data.open_run(run_dir) as run:
        assert run.is_empty() and [s for s, _ in run.resumes()] == [2, 0]
