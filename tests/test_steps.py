"""One step's bookkeeping (``llamarl.app.rl.steps``), shared by the local loop and the trainer."""

from __future__ import annotations

import pytest

from llamarl.app import names
from llamarl.app.rl import steps
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup
from llamarl.app.rewards import RewardResult


def group(seq: int, rewards: list[float | None], *, version: int = 0) -> RolloutGroup:
    gid = GroupId(0, seq)
    return RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[1, 2], completion_ids=[3] * (i + 1), behaviour_logprobs=[-1.0] * (i + 1),
                version=version, group_id=gid,
                result=RewardResult(r, {"v": r}) if r is not None
                else RewardResult(None, {}, "raised:KeyError", {"v": "raised:KeyError"}))
        for i, r in enumerate(rewards)])


def test_usable_leaves_out_quarantined_rollouts():
    groups = [group(0, [1.0, None, 0.0]), group(1, [None, None])]
    assert [len(r.completion_ids) for r in steps.usable(groups)] == [1, 3]


def test_a_batch_without_a_usable_rollout_is_skipped_and_three_in_a_row_end_the_run():
    guard = steps.SkipGuard()
    broken, fine = [group(0, [None, None])], [group(1, [1.0, None])]
    assert guard.should_skip(broken, step=1)
    assert guard.should_skip(broken, step=2)
    assert not guard.should_skip(fine, step=3)  # a usable batch resets the run of skips
    assert guard.should_skip(broken, step=4) and guard.should_skip(broken, step=5)
    assert guard.skipped == 4
    with pytest.raises(RuntimeError, match=r"step 6: every rollout of the last 3 batches.*"
                                           r"raised:KeyError: \d+.*check --rewards"):
        guard.should_skip(broken, step=6)


def test_step_values_name_every_scalar_and_skip_throughput_for_a_skipped_step():
    groups = [group(0, [1.0, 0.0], version=2), group(1, [1.0, 1.0], version=3)]
    train = {"loss": 0.5, "ratio_mean": 1.1, "ratio_max": 2.0, "frac_truncated": 0.25,
             "response_len": 1.5, "grad_norm": 0.3}
    values = steps.step_values(groups=groups, train=train, t_train=2.0, step_s=4.0, consumed_version=3,
                               skipped=1, dropped=2, idle_fraction=0.5)
    assert values[names.AIPO_RATIO_MEAN] == 1.1 and values[names.AIPO_FRAC_TRUNCATED] == 0.25
    assert values[names.TRAIN_TOKENS_PER_S] == (1 + 2 + 1 + 2) / 2.0
    assert values[names.TRAIN_SAMPLES_PER_S] == 4 / 2.0
    assert values[names.TRAIN_STEPS_PER_MIN] == 15.0 and values[names.TRAIN_VERSION] == 4
    assert values[names.FRAC_ZERO_VAR] == 0.5  # the second group's rewards are all equal
    assert (values[names.TRAIN_SKIPPED_STEPS], values[names.DROPPED_STALE]) == (1, 2)
    events, values = steps.step_events(7, groups, values, consumed_version=3, reward_names=["v"],
                                       role="trainer")
    assert (values[names.STALENESS_MEAN], values[names.STALENESS_MAX]) == (0.5, 1)
    lags = sorted(e["staleness"] for e in events if e["type"] == "staleness")
    assert lags == [0, 0, 1, 1]
    scalars = {e["name"]: e["value"] for e in events if e["type"] == "scalar"}
    assert scalars[names.reward_metric("v")] == 0.75 and scalars[names.QUARANTINED_TOTAL] == 0.0

    skipped = steps.step_values(groups=[group(2, [None])], train=None, t_train=0.0, step_s=1.0,
                                consumed_version=3, skipped=2, dropped=0, idle_fraction=0.0)
    assert names.TRAIN_TOKENS_PER_S not in skipped and names.LOSS not in skipped
    events, skipped = steps.step_events(8, [group(2, [None])], skipped, consumed_version=3,
                                        reward_names=["v"], role="trainer")
    assert not [e for e in events if e["type"] == "staleness"] and names.STALENESS_MEAN not in skipped
    assert "skipped" in steps.summary(8, 10, [group(2, [None])], skipped)


def test_staleness_counts_a_rollouts_oldest_policy_segment():
    (single,) = group(0, [1.0], version=4).rollouts
    episode = Rollout(prompt_ids=[1, 2], completion_ids=[3, 9, 9, 4], behaviour_logprobs=[-1.0, 0.0, 0.0, -1.0],
                      policy_mask=[True, False, False, True], segment_versions=[2, 4], version=4)
    rows, values = steps.staleness([single, episode], consumed_version=5, step=6)
    assert [(row["version"], row["staleness"]) for row in rows] == [(4, 1), (2, 3)]
    assert values == {names.STALENESS_MEAN: 2.0, names.STALENESS_MAX: 3}
