"""One step's bookkeeping (``llamarl.app.rl.steps``), shared by the local loop and the trainer."""

from __future__ import annotations

import pytest

from llamarl.app import names
from llamarl.app.rl import steps
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup
from llamarl.app.rewards import RewardResult


EOS = 2


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
                               skipped=1, dropped=2, idle_fraction=0.5, eos_id=EOS)
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
                                consumed_version=3, skipped=2, dropped=0, idle_fraction=0.0, eos_id=EOS)
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


def texts_group(seq: int, completions: list[tuple[str, bool]], rewards: list[float]) -> RolloutGroup:
    """A group of completions given as (text, ended with EOS), with their rewards."""
    gid = GroupId(0, seq)
    return RolloutGroup(group_id=gid, version=0, rollouts=[
        Rollout(prompt_ids=[1], completion_ids=[5, 6, EOS] if ended else [5, 6, 7], behaviour_logprobs=[-1.0] * 3,
                version=0, group_id=gid, completion=text, result=RewardResult(r, {"v": r}))
        for (text, ended), r in zip(completions, rewards)])


def test_the_shares_that_say_why_a_step_learns_little():
    groups = [
        # answers in both formats, one cut off: the rewards differ, so this group has signal
        texts_group(0, [("3 + 4 = 7\n#### 7", True), ("\\boxed{8}", True), ("3 + 4 = 7 and then", False)],
                    [1.0, 0.0, 0.0]),
        # '#### N' written literally is no answer; every reward equal: zero advantage
        texts_group(1, [("#### N", True), ("The answer is 5.", False), ("#### 5", True)], [0.0, 0.0, 0.0]),
        texts_group(2, [("#### 9", True), ("#### 9", True)], [1.0, 1.0]),
        texts_group(3, [("no", False)], [0.0]),  # a group of one: advantage 0
    ]
    values = steps.step_values(groups=groups, train=None, t_train=0.0, step_s=1.0, consumed_version=0,
                               skipped=0, dropped=0, idle_fraction=0.0, eos_id=EOS)
    assert values[names.FRAC_ZERO_VAR] == 3 / 4
    assert values[names.FRAC_NO_ANSWER] == 4 / 9  # "and then", "#### N", "The answer is 5.", "no"
    assert values[names.FRAC_CUT_OFF] == 3 / 9
    # an episode's environment tokens at the end do not make it cut off: the policy's last token is EOS
    episode = Rollout(prompt_ids=[1], completion_ids=[5, EOS, 8, 8], behaviour_logprobs=[-1.0] * 4,
                      policy_mask=[True, True, False, False], version=0, completion="#### 1")
    assert not steps.cut_off(episode, EOS) and steps.cut_off(groups[0].rollouts[2], EOS)
    train = {"loss": 0.5, "response_len": 3.0}
    line = steps.summary(4, 10, groups, {**values, **train, names.DROPPED_STALE: 0})
    assert "zero-adv groups 0.75 no answer 0.44 cut off 0.33" in line


def test_a_first_step_without_any_answer_warns_and_names_the_flags():
    none_parse = [texts_group(0, [("#### N", True), ("I think it is 7", False)], [0.0, 0.0])]
    values = steps.step_values(groups=none_parse, train=None, t_train=0.0, step_s=1.0, consumed_version=0,
                               skipped=0, dropped=0, idle_fraction=0.0, eos_id=EOS)
    warning = steps.no_answer_warning(1, values, max_new_tokens=48)
    assert warning is not None and warning.startswith("step 1: no completion has a final answer")
    for flag in ("--system-prompt", "--chat-template", "--max-new-tokens"):
        assert flag in warning
    assert "50% of the completions were cut off at 48 tokens" in warning
    one_parses = [texts_group(0, [("#### N", True), ("so #### 7", True)], [0.0, 1.0])]
    values = steps.step_values(groups=one_parses, train=None, t_train=0.0, step_s=1.0, consumed_version=0,
                               skipped=0, dropped=0, idle_fraction=0.0, eos_id=EOS)
    assert steps.no_answer_warning(1, values, max_new_tokens=48) is None
