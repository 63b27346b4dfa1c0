"""The Streamlit app under streamlit.testing's AppTest, over fixture run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard_fixtures import LiveRun, make_run, make_runs_root

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return make_runs_root(tmp_path_factory.mktemp("runs"))


def start(monkeypatch, root, **query) -> AppTest:
    monkeypatch.setenv("LLAMARL_RUNS_DIR", str(root))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def charts(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


def assert_no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def test_run_page_draws_every_view(monkeypatch, runs_root):
    at = start(monkeypatch, runs_root, run="async-run")
    assert_no_exception(at)
    assert not at.error
    assert at.sidebar.selectbox(key="run").value == "async-run"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["step"] == "40" and metrics["last sync (v40)"].endswith(" s")
    assert float(metrics["mean staleness"]) > 0
    assert metrics["last checkpoint"] == "step 40"
    tabs = [t.label for t in at.tabs]
    assert tabs == ["Throughput", "Executors", "Off-policy", "Weight sync", "Learning", "Episodes", "Queues",
                    "Security", "All scalars", "What if"]
    drawn = {}
    for tab in tabs:  # only the open tab runs its queries, so open each in turn
        at.session_state["tab"] = tab
        at.run()
        assert_no_exception(at)
        assert not at.error
        drawn[tab] = charts(at)
    # Executors: idle share, idle over time, timeline, GPU utilisation and memory (this run's
    # executors are on GPUs; a CPU run has no GPU charts: test_cpu_runs_draw_no_gpu_charts).
    # Off-policy: staleness (2), the mismatch by lag (2), versions per episode; Episodes: 6 (the
    # fixture run has episodes); Weight sync: syncs, senders, quantization.
    assert drawn == {"Throughput": 4, "Executors": 5, "Off-policy": 5, "Weight sync": 3, "Learning": 7,
                     "Episodes": 6, "Queues": 2, "Security": 1, "All scalars": 0, "What if": 0}

    at.session_state["tab"] = "Learning"
    at.run()
    figures = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    (signal,) = [f for f in figures if "learns little" in f["layout"]["title"]["text"]]
    assert {t["name"] for t in signal["data"]} == {"frac_zero_var", "frac_no_answer", "frac_cut_off"}


def test_off_policy_tab_of_an_auto_run_shows_the_bound_and_every_change(monkeypatch, tmp_path):
    make_run(tmp_path / "auto-run", steps=8, auto=True)
    at = start(monkeypatch, tmp_path, run="auto-run")
    at.session_state["tab"] = "Off-policy"
    at.run()
    assert_no_exception(at)
    assert charts(at) == 7, "staleness (2), mismatch by lag (2), the bound and what it weighs (2), versions per episode (1)"
    changes = at.dataframe[0].value
    assert list(changes["bound"]) == [2, 1] and "ESS 0.812" in changes["reason"].iloc[1]
    assert any("auto: 2 change(s)" in c.value for c in at.caption)


def test_security_tab_totals_every_security_counter(monkeypatch, runs_root):
    """Whatever is counted under security/ (frames rejected by reason, weight versions
    refused, and any counter added later) is in the table, summed over the processes."""
    at = start(monkeypatch, runs_root, run="async-run")
    at.session_state["tab"] = "Security"
    at.run()
    assert_no_exception(at)
    totals = at.dataframe[0].value
    assert dict(zip(totals["name"], totals["count"])) == {
        "security/rejected_frames/bad_tag": 3.0, "security/rejected_frames/replay": 1.0,
        "security/weight_digest/mismatch": 1.0}
    assert charts(at) == 1
    # A run where nothing was refused says so instead of drawing empty charts.
    at = start(monkeypatch, runs_root, run="sync-run")
    at.session_state["tab"] = "Security"
    at.run()
    assert_no_exception(at)
    assert charts(at) == 0 and any("Nothing refused" in s.value for s in at.success)


def test_cpu_runs_draw_no_gpu_charts(monkeypatch, runs_root):
    at = start(monkeypatch, runs_root, run="sync-run")
    at.session_state["tab"] = "Executors"
    at.run()
    assert_no_exception(at)
    assert charts(at) == 3
    assert not any("GPU" in c.value for c in at.caption)


def test_timeline_window_can_be_changed(monkeypatch, runs_root):
    at = start(monkeypatch, runs_root, run="sync-run")
    at.session_state["tab"] = "Executors"
    at.run()
    before = charts(at)
    at.get("button_group")[0].set_value("whole run").run()
    assert_no_exception(at)
    assert charts(at) == before


@pytest.mark.parametrize("run_id, kind, phrase", [
    ("empty-run", "info", "no metrics.db yet"),
    ("meta-only-run", "info", "recorded no events yet"),
    ("old-schema-run", "error", "metrics schema 0"),
    ("corrupt-run", "error", "not a readable SQLite database"),
])
def test_broken_runs_show_a_message_not_a_traceback(monkeypatch, runs_root, run_id, kind, phrase):
    at = start(monkeypatch, runs_root, run="sync-run")
    at.sidebar.selectbox(key="run").select(run_id).run()
    assert_no_exception(at)
    messages = [e.value for e in (at.info if kind == "info" else at.error)]
    assert any(phrase in m for m in messages), messages
    assert charts(at) == 0


def test_compare_page_puts_runs_side_by_side(monkeypatch, runs_root):
    at = start(monkeypatch, runs_root, compare="sync-run,async-run")
    assert_no_exception(at)
    assert at.sidebar.radio(key="mode").value == "Compare runs"
    table = at.dataframe[0].value
    assert list(table["run"]) == ["sync-run", "async-run"]
    assert list(table["max_staleness"]) == [0, 2]
    assert charts(at) == 8
    # Broken runs among the compared ones are reported, the others still drawn.
    at.sidebar.multiselect(key="runs").select("corrupt-run").run()
    assert_no_exception(at)
    assert any("not a readable SQLite database" in e.value for e in at.error)
    assert charts(at) == 8


@pytest.mark.parametrize("make_root, kind, phrase", [
    (lambda tmp: tmp / "missing", "error", "does not exist"),
    (lambda tmp: tmp, "info", "No runs in"),
])
def test_missing_or_empty_runs_directory(monkeypatch, tmp_path, make_root, kind, phrase):
    at = start(monkeypatch, make_root(tmp_path))
    assert_no_exception(at)
    assert any(phrase in e.value for e in (at.info if kind == "info" else at.error))


def test_live_run_refreshes_while_it_is_written(monkeypatch, tmp_path):
    with LiveRun(tmp_path / "live-run") as live:
        at = start(monkeypatch, tmp_path, run="live-run")
        assert_no_exception(at)
        assert any("Following live run" in c.value for c in at.sidebar.caption)
        assert "live" in at.subheader[0].value
        first = int(at.metric[0].value)
        live.wait_for_steps(first + 3)
        at.run()
        assert_no_exception(at)
        assert int(at.metric[0].value) >= first + 3


def test_what_if_tab_puts_predictions_next_to_the_measured_run(monkeypatch, runs_root):
    at = start(monkeypatch, runs_root, run="sync-run")
    at.session_state["tab"] = "What if"
    at.run()
    assert_no_exception(at)
    table = at.dataframe[0].value
    assert list(table["case"])[:2] == ["measured", "predicted: as run"]
    assert "predicted: max_staleness 1" in set(table["case"]) and "predicted: 2 generators" in set(table["case"])
    by_case = dict(zip(table["case"], table["median step (s)"]))
    # The fixture's generators are the faster side: a bound of 1 overlaps them with training.
    assert by_case["predicted: max_staleness 1"] < by_case["predicted: as run"]
