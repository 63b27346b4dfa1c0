"""``--max-staleness auto`` end to end: the bound moves, the change is in the metrics
database with its reason, and no rollout trained lagged more than the bound in force."""

from __future__ import annotations

import pytest
from torchx.specs import AppState

from llamarl.app import names
from app_launch import SMALL, launch, rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_auto_bound_changes_and_is_recorded(tiny_policy, tmp_path):
    """Two generators, faster than a trainer slowed down (a KL term, so every rollout is
    trained, one per micro-batch), wait on a bound of 1; the tiny policy's ratios stay
    tame, so the bound goes up."""
    with launch(tiny_policy, tmp_path, steps=6, num_generators=2, max_staleness="auto",
                extra=[*SMALL, "--eval-every", "100", "--staleness-cap", "3", "--kl-coef", "0.01",
                       "--micro-batch", "1"]) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        config = dict(rows(db, "SELECT key, value FROM meta"))["config"]
        assert '"max_staleness": "auto"' in config and '"mode": "async"' in config
        changes = rows(db, "SELECT step, previous, bound, reason FROM staleness_bounds ORDER BY t")
        assert changes, app.logs_tail()
        step, previous, bound, reason = changes[0]
        assert (previous, bound) == (1, 2) and "blocked" in reason and "ESS" in reason
        bounds = dict(rows(db, f"SELECT step, value FROM scalars WHERE name = '{names.STALENESS_BOUND}'"))
        assert sorted(bounds) == list(range(1, 7)) and bounds[1] == 1 and max(bounds.values()) <= 3
        assert bounds[step + 1] == bound, "the step after the decision trains under the new bound"
        blocked = rows(db, f"SELECT value FROM scalars WHERE name = '{names.STALENESS_BLOCKED}'")
        assert len(blocked) == 6 and all(0.0 <= b <= 1.0 for (b,) in blocked)
        for s, lag in rows(db, "SELECT step, staleness FROM staleness WHERE used = 1"):
            assert lag <= bounds[s], f"step {s} trained a rollout {lag} behind, over its bound {bounds[s]}"
        assert rows(db, f"SELECT COUNT(*) FROM scalars WHERE name = '{names.AIPO_ESS}'")[0][0] == 6
