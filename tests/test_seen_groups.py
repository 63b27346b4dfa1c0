"""Replays and versions from the future (``llamarl.app.control.seen_groups``), and the flood guard of
``llamarl.app.rl.contract.Rejections``: pure, in-process."""

from __future__ import annotations

import random

import pytest

from llamarl.app.rl.contract import FrameFlood, GroupId, Rejections, Rollout, RolloutGroup, to_message
from llamarl.app.control.seen_groups import (FUTURE_VERSION, INCARNATION_SHIFT, REPLAY, TOO_OLD, Admission, SeenIds, first_seq,
                              taken_by_other_ranks)


def group(generator: int, seq: int, version: int = 0) -> RolloutGroup:
    gid = GroupId(generator, seq)
    return RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[1, 2], completion_ids=[3], behaviour_logprobs=[-1.0], version=version,
                group_id=gid)])


def test_an_id_is_new_once_per_generator():
    seen = SeenIds()
    assert seen.add(0, 5) and seen.add(1, 5)  # the same seq of another generator is another group
    assert not seen.add(0, 5) and not seen.add(1, 5)


def test_out_of_order_ids_are_each_taken_once_and_memory_stays_bounded():
    seen = SeenIds(window=64)
    order = list(range(10_000))
    # Arrival order shuffled within blocks of 32: what reward executors and lookahead do.
    for start in range(0, len(order), 32):
        block = order[start:start + 32]
        random.Random(start).shuffle(block)
        order[start:start + 32] = block
    assert all(seen.add(3, s) for s in order)
    assert not any(seen.add(3, s) for s in order)  # every second copy refused, old or recent
    assert seen.remembered() <= 65


def test_an_id_older_than_the_window_counts_as_seen():
    seen = SeenIds(window=10)
    assert seen.add(0, 100)
    assert not seen.add(0, 89)  # 11 below the newest: forgotten, so refused
    assert seen.add(0, 90)  # within the window: a late group, taken


def test_a_restarted_generator_numbers_its_groups_apart_from_its_earlier_process():
    assert first_seq(1) == 0 and first_seq(2) == 1 << INCARNATION_SHIFT
    with pytest.raises(ValueError):
        first_seq(0)
    seen = SeenIds(window=10)
    assert all(seen.add(0, s) for s in range(100))
    # The new process's groups are new; the old process's last groups, still queued, too.
    assert all(seen.add(0, first_seq(2) + s) for s in range(100))
    assert seen.add(0, 100)


def test_admission_refuses_a_replay_and_a_version_from_the_future():
    published = {"v": 3}
    admit = Admission(current_version=lambda: 2, published_version=lambda: published["v"])
    assert admit(group(0, 1, version=2)) is None
    reason, detail = admit(group(0, 1, version=2))
    assert reason == REPLAY and "(0, 1)" in detail
    # Above this rank's version but published already (another rank counts a step late).
    assert admit(group(0, 2, version=3)) is None
    reason, detail = admit(group(0, 3, version=4))
    assert reason == FUTURE_VERSION and "version 4" in detail and "published 3" in detail
    # A refused group is not remembered: the same id with a valid version is taken.
    assert admit(group(0, 3, version=3)) is None


def test_admission_reads_the_store_once_per_new_version():
    reads, published = [], {"v": 2}

    def read() -> int:
        reads.append(published["v"])
        return published["v"]

    admit = Admission(published_version=read)  # a reward executor: no version of its own
    assert [admit(group(0, s, version=2)) for s in range(5)] == [None] * 5
    assert reads == [2]
    assert admit(group(0, 5, version=3))[0] == FUTURE_VERSION and reads == [2, 2]
    published["v"] = 3
    assert admit(group(0, 6, version=3)) is None and admit(group(0, 7, version=1)) is None
    assert reads == [2, 2, 3]


def test_rejections_decode_counts_what_admission_refuses():
    rejections = Rejections("trainer/0")
    msgs = [to_message(group(0, s, version=v)) for s, v in [(0, 0), (0, 0), (1, 9), (2, 1)]]
    got = rejections.decode(msgs, Admission(current_version=lambda: 1))
    assert [g.group_id.seq for g in got] == [0, 2]
    assert rejections.metrics() == {"security/rejected_frames/replay": 1.0,
                                    "security/rejected_frames/future_version": 1.0}


def test_a_flood_of_rejections_in_a_row_is_an_error_naming_it():
    rejections = Rejections("reward/0", flood_frames=5)
    for _ in range(4):
        rejections("bad_tag", "queue 'rollouts': bad tag")
    rejections.accepted()  # a valid message between: no flood
    for _ in range(4):
        rejections("bad_tag", "queue 'rollouts': bad tag")
    with pytest.raises(FrameFlood, match=r"reward/0: 5 messages rejected in a row .*'bad_tag': 8, 'malformed_frame': 1"):
        rejections("malformed_frame", "queue 'rollouts': garbage")


def test_too_old_groups_are_counted_but_are_no_flood(caplog):
    rejections = Rejections("trainer/0", flood_frames=3)
    for _ in range(10):  # a stream of stale groups: the run is slow, not attacked
        rejections.counted(TOO_OLD, "group (0, 1) of policy version 0 is 3 versions behind")
    assert rejections.metrics() == {"security/rejected_frames/too_old": 10.0}
    assert caplog.text.count("dropped a message (too_old)") == 1
    rejections("bad_tag", "bad tag")
    rejections("bad_tag", "bad tag")
    with pytest.raises(FrameFlood):  # the streak of real rejections is its own
        rejections("bad_tag", "bad tag")


def test_replays_of_one_valid_frame_are_a_flood_too():
    rejections = Rejections("trainer/0", flood_frames=3)
    msg = to_message(group(0, 0))
    admit = Admission()
    rejections.decode([msg, msg, msg], admit)
    with pytest.raises(FrameFlood):
        rejections.decode([msg], admit)


def test_a_regenerated_lost_slot_is_not_a_replay_and_a_replay_never_reaches_the_ledger():
    """Slot 17's group got out just before its reward executor died, and generator 1
    regenerated the slot: a new group (new id) for the same slot. Admission takes both; the
    slot ledger keeps the first and calls the second a duplicate. A replayed copy of the
    first is refused by admission, so the ledger never counts it."""
    from llamarl.app.control.slots import SlotLedger

    original, regenerated = group(0, 5), group(1, 30)
    original.slot = regenerated.slot = 17
    admit, ledger, duplicates = Admission(current_version=lambda: 0), SlotLedger(), []
    for g in (original, original, regenerated):
        if admit(g) is not None:
            continue
        try:
            ledger.consume(g.slot)
        except ValueError:
            duplicates.append(g.group_id)
    assert duplicates == [GroupId(1, 30)] and ledger.count == 1


def test_a_copy_that_reached_another_trainer_rank_is_found_at_the_exchange():
    """Rank 0 and rank 1 each admitted one copy of (0, 7): the lower rank keeps it. Rank 0
    trained (0, 1) at step 1; a copy rank 1 admitted before it knew is refused at step 2."""
    seen = [SeenIds(), SeenIds()]
    step1 = [[(0, 1), (0, 7)], [(1, 4), (0, 7)]]
    assert [taken_by_other_ranks(step1, r, seen[r]) for r in (0, 1)] == [set(), {(0, 7)}]
    step2 = [[(0, 2)], [(1, 5), (0, 1)]]
    assert [taken_by_other_ranks(step2, r, seen[r]) for r in (0, 1)] == [set(), {(0, 1)}]
    assert (1, 4) in seen[0] and (1, 5) in seen[0] and (0, 2) in seen[1] and (9, 9) not in seen[1]
