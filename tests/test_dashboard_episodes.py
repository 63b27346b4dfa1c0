"""The Episodes view (llamarl.dashboard.episodes) over a run directory holding what a real
generator's ``SlotEpisodes`` recorded, and the view in the Streamlit app under AppTest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from llamarl.app import names
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.envs.slots import SlotEpisodes
from llamarl.app.metrics import events as m
from llamarl.app.model.policy import create_default_policy
from llamarl.dashboard import data, episodes
from dashboard_fixtures import make_run

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def recorded():
    """Two generator batches of real guess-the-number episodes: their env/ metrics."""
    gen = GeneratorConfig(env="guess_number(high=5)", max_new_tokens=3, max_turns=2)
    slots = SlotEpisodes(*create_default_policy(), TrainerConfig(group_size=2, seed=1), gen)
    out = []
    try:
        for batch in ([0, 1], [2, 3]):
            groups = slots.groups(batch, version=3, rng=torch.Generator().manual_seed(0), generator_id=0,
                                  first_seq=batch[0], stop=lambda: False)
            out.append((slots.metrics(), [r for g in groups for r in g.rollouts]))
    finally:
        slots.close()
    return out


@pytest.fixture(scope="module")
def run_dir(recorded, tmp_path_factory):
    """A run whose generator wrote ``recorded`` per batch, with its busy intervals."""
    path = tmp_path_factory.mktemp("runs") / "episode-run"
    writer = m.MetricsWriter(path, run_id=path.name, config={"max_staleness": 1})
    try:
        writer.set_meta("started_at", repr(T0))
        for i, (metrics, _) in enumerate(recorded):
            t = T0 + 10 * i
            writer.write([m.scalar(k, v, role="generator", t=t + 2) for k, v in metrics.items()]
                         + [m.interval("busy", "generate", t, t + 2, role="generator"),
                            m.interval("busy", "train", t + 2, t + 5, role="trainer")])
    finally:
        writer.close()
    return path


def test_the_generator_records_episode_lengths_and_versions(recorded):
    metrics, rollouts = recorded[-1]
    lengths = {k: v for k, v in metrics.items() if k.startswith(names.ENV_EPISODE_TOKENS_PREFIX)}
    versions = {k: v for k, v in metrics.items() if k.startswith(names.ENV_EPISODE_VERSIONS_PREFIX)}
    assert sum(lengths.values()) == sum(versions.values()) == metrics["env/episodes"] == 8
    assert versions == {names.ENV_EPISODE_VERSIONS_PREFIX + "1": 8.0}  # one version per batch
    for r in rollouts:  # each episode in the bucket (b/2, b]
        b = 1 << max(0, len(r.completion_ids) - 1).bit_length()
        assert lengths[f"{names.ENV_EPISODE_TOKENS_PREFIX}{b}"] >= 1 and (b == 1 or b // 2 < len(r.completion_ids) <= b)


def test_the_view_reads_the_latest_totals_and_rates(recorded, run_dir):
    last = recorded[-1][0]
    with data.open_run(run_dir) as run:
        assert episodes.has_episodes(run)
        ends = episodes.totals(run, episodes.ENDS_PREFIX)
        assert dict(zip(ends["key"], ends["value"])) == {
            k[len(episodes.ENDS_PREFIX):]: v for k, v in last.items() if k.startswith(episodes.ENDS_PREFIX)}
        lengths = episodes.totals(run, names.ENV_EPISODE_TOKENS_PREFIX)
        assert list(lengths["key"].astype(int)) == sorted(lengths["key"].astype(int))  # numeric order
        assert lengths["value"].sum() == 8
        rates = episodes.per_episode(run)
        turns = rates[rates["name"] == "turns per episode"].sort_values("t")["value"].tolist()
        assert turns[-1] == pytest.approx(last["env/episode_turns"] / last["env/episodes"])
        timing = episodes.time_per_batch(run).set_index("what")["seconds"]
        assert timing["generation (per batch)"] == pytest.approx(2.0)
        assert timing["training (per step)"] == pytest.approx(3.0)
        assert timing["environment steps (per batch, summed)"] == pytest.approx(last["env/env_step_s"] / 2)
        assert len(episodes.versions_figure(run).data) == 1


def test_the_app_draws_the_episodes_tab(monkeypatch, run_dir, tmp_path):
    make_run(tmp_path / "plain-run", steps=3, mode="sync")  # no episodes: the tab says so
    shutil.copytree(run_dir, tmp_path / run_dir.name)
    monkeypatch.setenv("LLAMARL_RUNS_DIR", str(tmp_path))
    for run_id, drawn in (("episode-run", 6), ("plain-run", 0)):
        at = AppTest.from_file(APP, default_timeout=60)
        at.query_params["run"] = run_id
        at.session_state["tab"] = "Episodes"
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert len(at.get("plotly_chart")) == drawn
        assert any("no episodes" in i.value for i in at.info) == (not drawn)
