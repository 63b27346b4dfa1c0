"""The rollout contract (``llamarl.app.rl.contract``): one wire format, checked field by field."""

from __future__ import annotations

import logging

import pytest
import torch

from llamarl.app.rl.contract import (GroupId, MalformedMessage, Rejections, Rollout, RolloutGroup, from_message,
                          to_message)
from llamarl.app.rewards import RewardResult
from llamarl.app.control.frames import decode, encode

SECRET = bytes(range(32))


def make_group(G: int = 3, *, version: int = 5, scored: bool = False) -> RolloutGroup:
    gid = GroupId(2, 17)
    group = RolloutGroup(group_id=gid, version=version, sent_at=123.5, rollouts=[
        Rollout(prompt_ids=[5, 6, 7], completion_ids=[10 + i] * (i + 1),
                behaviour_logprobs=[-0.1234567 * (i + 1)] * (i + 1), version=version, group_id=gid,
                prompt="Q: 3 + 4?", completion=f"#### {i}", task={"answer": 7.0, "level": 1})
        for i in range(G)])
    if scored:
        group.attach([RewardResult(1.0, {"math_verifier": 1.0}),
                      RewardResult(None, {}, "timeout", {"math_verifier": "timeout"}),
                      RewardResult(0.0, {"math_verifier": 0.0})][:G])
    return group


def wire(group: RolloutGroup) -> dict:
    """The message as a receiver sees it: through an encoded and decoded frame."""
    return decode(encode(to_message(group), SECRET), SECRET)


def test_a_group_round_trips_exactly_through_the_wire_format():
    sent = make_group(scored=True)
    got = from_message(wire(sent), vocab_size=32, group_size=3)
    assert (got.group_id, got.version, got.sent_at) == (GroupId(2, 17), 5, 123.5)
    for a, b in zip(sent.rollouts, got.rollouts):
        assert torch.equal(b.prompt_ids, a.prompt_ids) and torch.equal(b.completion_ids, a.completion_ids)
        # float32 on the wire: exactly what the sampler recorded (itself float32).
        assert b.behaviour_logprobs.dtype == torch.float32 and torch.equal(b.behaviour_logprobs, a.behaviour_logprobs)
        assert b.policy_mask.all() and b.segment_versions.tolist() == [5] and b.oldest_version == 5
        assert (b.prompt, b.completion, b.task) == (a.prompt, a.completion, a.task)
        assert b.result == a.result and b.reward == a.reward
        assert b.group_id == GroupId(2, 17) and b.advantage is None


def test_rollouts_hold_tensors_and_from_message_hands_back_the_decoded_ones():
    r = make_group().rollouts[1]  # built from lists: converted once
    assert (r.prompt_ids.dtype, r.completion_ids.dtype, r.behaviour_logprobs.dtype, r.policy_mask.dtype) == (
        torch.int64, torch.int64, torch.float32, torch.bool)
    ids = torch.tensor([10, 11], dtype=torch.int64)
    assert Rollout(prompt_ids=ids, completion_ids=ids, behaviour_logprobs=[-1.0, -1.0], version=0).completion_ids is ids
    msg = wire(make_group())
    got = from_message(msg)
    assert all(r.prompt_ids is msg["prompt_ids"] for r in got.rollouts)  # one tensor for the group's prompt
    assert all(r.completion_ids is ids and r.behaviour_logprobs is lp
               for r, ids, lp in zip(got.rollouts, msg["completion_ids"], msg["logprobs"]))


def make_episode(version: int = 5, versions: tuple[int, int] = (3, 5)) -> RolloutGroup:
    """One rollout of two policy turns around an environment's answer (tokens 2..4)."""
    gid = GroupId(2, 18)
    mask = torch.tensor([True, True, False, False, False, True, True])
    return RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[5, 6, 7], completion_ids=[10, 11, 20, 21, 22, 12, 13],
                behaviour_logprobs=[-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -2.0], policy_mask=mask,
                segment_versions=list(versions), version=version, group_id=gid)])


def test_an_episode_of_several_segments_round_trips_and_counts_its_oldest_segment():
    sent = make_episode()
    msg = wire(sent)
    assert msg["policy_mask"][0].dtype == torch.bool and msg["segment_versions"][0].tolist() == [3, 5]
    got = from_message(msg, vocab_size=32).rollouts[0]
    assert torch.equal(got.policy_mask, sent.rollouts[0].policy_mask)
    assert got.segment_versions.tolist() == [3, 5] and got.oldest_version == 3 and got.policy_tokens == 4
    assert got.token_versions().tolist() == [3, 3, 3, 3, 3, 5, 5]
    assert from_message(msg).oldest_version == 3 and from_message(msg).version == 5
    # A single-turn group sends neither field: absent means one policy segment of "version".
    assert not {"policy_mask", "segment_versions"} & set(wire(make_group()))
    # One segment at an older version: the versions travel without a mask.
    old = from_message(wire(RolloutGroup(group_id=GroupId(1, 1), version=4, rollouts=[
        Rollout(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[-1.0], segment_versions=[2], version=4,
                group_id=GroupId(1, 1))])))
    assert old.rollouts[0].segment_versions.tolist() == [2] and old.oldest_version == 2


def test_each_episode_of_a_group_keeps_its_own_task_on_the_wire():
    """An episode's reward lives in its task: a group of episodes scored 1 and 0 must
    arrive scored 1 and 0, or every group has zero variance and nothing is learnt."""
    group = make_group(G=2)
    group.rollouts[0].task = {"answer": 7.0, "env_reward": 1.0, "turns": 2}
    group.rollouts[1].task = {"answer": 7.0, "env_reward": 0.0, "turns": 3}
    got = from_message(wire(group), vocab_size=32)
    assert [r.task for r in got.rollouts] == [r.task for r in group.rollouts]
    assert "tasks" not in wire(make_group())  # single-turn rollouts share the row's task: sent once
    msg = wire(group)
    msg["tasks"][1] = [0.0]
    with pytest.raises(MalformedMessage) as err:
        from_message(msg)
    assert (err.value.reason, err.value.field) == ("wrong_type", "tasks[1]")
    msg["tasks"] = msg["tasks"][:1]
    with pytest.raises(MalformedMessage) as err:
        from_message(msg)
    assert (err.value.reason, err.value.field) == ("wrong_length", "tasks")


@pytest.mark.parametrize("edit, reason, field", [
    (lambda m: m["policy_mask"].__setitem__(0, m["policy_mask"][0][:-1]), "wrong_length", "policy_mask[0]"),
    (lambda m: m["policy_mask"].__setitem__(0, m["policy_mask"][0].long()), "wrong_type", "policy_mask[0]"),
    (lambda m: m["policy_mask"][0].fill_(False), "bad_value", "policy_mask[0]"),
    (lambda m: m.update(policy_mask=[]), "wrong_length", "policy_mask"),
    (lambda m: m["segment_versions"].__setitem__(0, m["segment_versions"][0][:1]), "wrong_length",
     "segment_versions[0]"),
    (lambda m: m["segment_versions"].__setitem__(0, m["segment_versions"][0].int()), "wrong_type",
     "segment_versions[0]"),
    (lambda m: m["segment_versions"][0].fill_(6), "bad_value", "segment_versions[0]"),
    (lambda m: m["segment_versions"][0].fill_(-1), "bad_value", "segment_versions[0]"),
    (lambda m: m.pop("policy_mask"), "wrong_length", "segment_versions[0]"),  # 2 versions for 1 segment
])
def test_an_episode_that_breaks_the_contract_is_refused_naming_the_field(edit, reason, field):
    msg = wire(make_episode())
    edit(msg)
    with pytest.raises(MalformedMessage) as err:
        from_message(msg, vocab_size=32)
    assert (err.value.reason, err.value.field) == (reason, field)


def test_the_slot_travels_when_the_generator_set_one():
    group = make_group()
    assert "slot" not in wire(group) and from_message(wire(group)).slot is None
    group.slot = 41
    assert from_message(wire(group)).slot == 41


def test_an_unscored_group_has_no_results():
    got = from_message(wire(make_group()))
    assert not got.scored and all(r.reward is None for r in got.rollouts)


def _break(edit) -> dict:
    msg = wire(make_group(scored=True))
    edit(msg)
    return msg


@pytest.mark.parametrize("edit, reason, field", [
    (lambda m: m.pop("prompt_ids"), "missing_field", "prompt_ids"),
    (lambda m: m.pop("logprobs"), "missing_field", "logprobs"),
    (lambda m: m.pop("kind"), "missing_field", "kind"),
    (lambda m: m.update(kind="metrics"), "bad_value", "kind"),
    (lambda m: m.update(version="5"), "wrong_type", "version"),
    (lambda m: m.update(version=True), "wrong_type", "version"),
    (lambda m: m.update(seq=-1), "bad_value", "generator/seq/version"),
    (lambda m: m.update(slot=-1), "bad_value", "slot"),
    (lambda m: m.update(slot=2.0), "wrong_type", "slot"),
    (lambda m: m.update(prompt=None), "wrong_type", "prompt"),
    (lambda m: m.update(task=[1]), "wrong_type", "task"),
    (lambda m: m["completion_ids"].__setitem__(0, [10]), "wrong_type", "completion_ids[0]"),
    (lambda m: m["completion_ids"].__setitem__(1, torch.tensor([10, 10], dtype=torch.int32)),
     "wrong_type", "completion_ids[1]"),
    (lambda m: m["logprobs"].__setitem__(2, m["logprobs"][2][:-1]), "wrong_length", "logprobs[2]"),
    (lambda m: m["logprobs"].__setitem__(1, m["logprobs"][1].double()), "wrong_type", "logprobs[1]"),
    (lambda m: m["logprobs"][0].fill_(float("nan")), "bad_value", "logprobs[0]"),
    (lambda m: m["logprobs"][0].fill_(0.5), "bad_value", "logprobs[0]"),
    (lambda m: m["completion_ids"][0].fill_(99), "bad_value", "completion_ids[0]"),
    (lambda m: m["completion_ids"].__setitem__(0, torch.tensor([], dtype=torch.int64)),
     "wrong_length", "completion_ids[0]"),
    (lambda m: m.update(completions=m["completions"][:2]), "wrong_length", "completions"),
    (lambda m: m.update(logprobs=m["logprobs"][:2]), "wrong_length", "logprobs"),
    (lambda m: m["results"][0].update(total="1"), "wrong_type", "results[0].total"),
    (lambda m: m["results"][0].update(total=float("inf")), "bad_value", "results[0]"),
    (lambda m: m["results"][1].update(total=1.0), "bad_value", "results[1]"),
    (lambda m: m["results"][0].pop("components"), "missing_field", "results[0].components"),
])
def test_a_message_that_breaks_the_contract_is_refused_naming_the_field(edit, reason, field):
    with pytest.raises(MalformedMessage) as err:
        from_message(_break(edit), vocab_size=32, group_size=3)
    assert (err.value.reason, err.value.field) == (reason, field)
    assert field in str(err.value)
    assert str(err.value).count("malformed rollout message") == 1


def test_rejections_count_by_reason_and_log_each_kind_once(caplog):
    bad = _break(lambda m: m["logprobs"].__setitem__(0, m["logprobs"][0][:0]))
    good = wire(make_group())
    rejections = Rejections("trainer/0")
    with caplog.at_level(logging.WARNING, logger="llamarl"):
        groups = rejections.decode([bad, good, bad, bad], group_size=3)
    assert [g.group_id for g in groups] == [GroupId(2, 17)]
    assert dict(rejections.counts) == {"wrong_length": 3}
    assert rejections.metrics() == {"security/rejected_frames/wrong_length": 3.0}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "logprobs[0]" in lines[0] and "trainer/0" in lines[0]


def test_a_group_refuses_rollouts_of_another_group_or_version():
    group = make_group()
    stray = Rollout(prompt_ids=[5, 6, 7], completion_ids=[1], behaviour_logprobs=[-1.0], version=4,
                    group_id=GroupId(2, 17))
    with pytest.raises(ValueError, match="share the group's id, version and prompt"):
        RolloutGroup(group_id=group.group_id, version=5, rollouts=group.rollouts + [stray])
    with pytest.raises(ValueError, match="2 reward results for 3 rollouts"):
        group.attach([RewardResult(1.0, {}), RewardResult(1.0, {})])
