"""The app with --env: generators run guess-the-number episodes, the trainer trains on
them (environment tokens masked) with the env_reward component, the generators'
episode counts reach the metrics database, and held-out evaluation plays the game too."""

import pytest
from torchx.specs import AppState

from app_launch import SMALL, launch, rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_app_trains_on_episodes(tiny_policy, tmp_path):
    extra = [*SMALL, "--env", "guess_number(high=5)", "--max-turns", "3", "--max-episode-tokens", "48",
             "--max-new-tokens", "8"]
    with launch(tiny_policy, tmp_path, steps=2, num_generators=1, rewards="env_reward", extra=extra) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        generator = dict(rows(db, "SELECT name, max(value) FROM scalars WHERE role = 'generator' "
                                  "AND name LIKE 'env/%' GROUP BY name"))
        assert generator["env/episodes"] > 0 and generator["env/episode_turns"] >= generator["env/episodes"]
        assert sum(v for k, v in generator.items() if k.startswith("env/episode_end/")) == generator["env/episodes"]
        assert {c for (c,) in rows(db, "SELECT DISTINCT component FROM rewards")} >= {"env_reward"}
        evals = dict(rows(db, "SELECT name, value FROM scalars WHERE step = 0 AND name LIKE 'eval/%'"))
        assert evals["eval/episode_turns"] >= 1 and 0 <= evals["eval/accuracy"] <= 1, evals
