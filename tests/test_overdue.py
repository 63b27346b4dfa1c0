"""Overdue slots (``llamarl.app.control.overdue``) over a real TCPStore on loopback: a
reserved group whose message is lost on the way is regenerated once the trainer has
waited ``deadline_s`` for it, never before; the groups the trainer received, and time
it spends not waiting, never count; a late original is dropped as a duplicate."""

from __future__ import annotations

import logging
import time

import pytest

from llamarl.app.control import membership, overdue, slots
from llamarl.app.rl.contract import GroupId, Rejections, Rollout, RolloutGroup
from role_processes import control, loopback_store, signed, wait_until

B = 4  # groups per step: synchronous, so the step needs every one
DEADLINE_S = 0.3


@pytest.fixture()
def store():
    store = loopback_store(timeout_s=30)
    for member in ("trainer/0", "generator/0"):
        role, replica = member.split("/")
        control(store, member).register(role, int(replica))
    return store


def group(seq: int, slot: int) -> RolloutGroup:
    gid = GroupId(0, seq)
    g = RolloutGroup(group_id=gid, version=0, rollouts=[
        Rollout(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[-1.0], version=0, group_id=gid)])
    g.slot = slot
    return g


def a_run(store) -> tuple[slots.SlotLedger, slots.Settlement, slots.SlotBudget, slots.HeldSlots]:
    """The controller's start, the trainer's settlement and one generator's budget and holdings."""
    ledger = slots.SlotLedger()
    slots.publish_start(signed(store), ledger, 0)
    settlement = slots.Settlement(signed(store, "trainer/0"), rank=0, world=1, ledger=ledger, max_staleness=0,
                                  rejections=Rejections("trainer/0"), emit=lambda events: None)
    gen = signed(store, "generator/0")
    return ledger, settlement, slots.SlotBudget(gen, groups_per_step=B, max_staleness=0), slots.HeldSlots(gen)


def deadlines(store, ledger: slots.SlotLedger, clock: overdue.WaitClock) -> overdue.Deadlines:
    return overdue.Deadlines(signed(store), ledger, clock, deadline_s=DEADLINE_S,
                             holders=lambda: ["generator/0", "trainer/0"])


def test_a_group_lost_on_the_way_is_regenerated_once_the_trainer_waited_out_its_deadline(store, caplog):
    ledger, settlement, budget, held = a_run(store)
    clock = overdue.WaitClock()
    watch = deadlines(store, ledger, clock)
    reserved = budget.slot_ids(budget.reserve(B, version=0))
    assert reserved == [0, 1, 2, 3]
    held.take(reserved)
    assert watch.poll() == []  # held by the generator
    for slot in reserved:
        held.passed(slot)  # in the queue now
    # The trainer's pipeline received three; the fourth's message was popped by someone else.
    settlement.received([group(i, i) for i in range(3)])
    assert slots.held_by(signed(store), "trainer/0") == [0, 1, 2]
    # Time the trainer spends not waiting for rollouts (a step, a checkpoint) never counts.
    assert watch.poll() == []
    time.sleep(DEADLINE_S + 0.1)
    assert watch.poll() == [] and watch.overdue == 0
    with clock:  # the trainer waits for its batch
        assert watch.poll() == []
        time.sleep(DEADLINE_S + 0.1)
        with caplog.at_level(logging.WARNING, logger="llamarl"):
            assert watch.poll() == [3], "only the slot nobody holds, never the three the trainer received"
    assert watch.overdue == 1
    # Returned as a lost executor's slots are: the controller's record, regenerated first.
    assert slots.lost_slots_waiting(store) == 1
    regenerator = signed(store, "generator/0")
    assert slots.take_lost_slots(regenerator, 8) == [3]
    # Regenerated, and lost again: overdue again, counted again, logged once per slot.
    held.take([3])
    held.passed(3)
    with clock:
        assert watch.poll() == []
        time.sleep(DEADLINE_S + 0.1)
        with caplog.at_level(logging.WARNING, logger="llamarl"):
            assert watch.poll() == [3]
    assert watch.overdue == 2
    assert [r.getMessage() for r in caplog.records if "overdue" in r.getMessage()] == [
        f"slot(s) 3 overdue: reserved, and neither held by an executor nor received by the trainer for "
        f"{DEADLINE_S:g} s of its waiting for rollouts (the group's message was lost on the way): they go back "
        f"to be regenerated"]
    # The regenerated group arrives and the step is settled: nothing is open any more.
    assert slots.take_lost_slots(regenerator, 8) == [3]
    settlement.received([group(3, 3)])
    assert [g.slot for g in settlement.settle([group(i, i) for i in range(4)], version=0)] == [0, 1, 2, 3]
    assert slots.held_by(signed(store), "trainer/0") == [], "settled groups leave the trainer's holdings"
    with clock:
        time.sleep(DEADLINE_S + 0.1)
        assert watch.poll() == []
    # The original shows up late after all: a duplicate, dropped, never trained twice.
    late = group(9, 3)
    settlement.received([late])
    assert settlement.settle([late], version=1) == [] and settlement.duplicates == 1
    assert ledger.state_dict() == {"frontier": 4, "done": []}


def test_a_slot_that_may_wait_in_the_lost_slots_queue_is_not_overdue(store):
    """A lost executor's slots wait there for a generator: nobody holds them, yet they
    are not lost; nor is a group the pipeline dropped unscored held any longer."""
    ledger, settlement, budget, held = a_run(store)
    clock = overdue.WaitClock()
    watch = deadlines(store, ledger, clock)
    held.take(budget.slot_ids(budget.reserve(B, version=0)))
    assert slots.return_held(signed(store), "generator/0") == B
    with clock:
        assert watch.poll() == []
        time.sleep(DEADLINE_S + 0.1)
        assert watch.poll() == [] and slots.lost_slots_waiting(store) == B
        assert slots.take_lost_slots(signed(store, "generator/0"), 8) == [0, 1, 2, 3]
        settlement.received([group(i, i) for i in range(B)])
        settlement.refused(group(0, 0))  # arrived without its scores: dropped
        assert watch.poll() == []  # the deadline starts now
        time.sleep(DEADLINE_S + 0.1)
        assert watch.poll() == [0]


def test_the_membership_watcher_returns_overdue_slots_while_the_trainer_waits(store):
    """The trainer is blocked in its pipeline's wait: the watcher's thread does it."""
    ledger, _, budget, held = a_run(store)
    clock = overdue.WaitClock()
    watch = membership.Membership(signed(store), {"generator": 1, "reward": 0}, watch_heartbeats=False)
    watch.deadlines = deadlines(store, ledger, clock)
    slot = budget.slot_ids(budget.reserve(1, version=0))
    held.take(slot)
    held.passed(slot[0])  # and lost on the way
    watch.start()
    try:
        with clock:
            wait_until(lambda: slots.lost_slots_waiting(store) == 1, "the overdue slot returned")
    finally:
        watch.stop()
    assert watch.deadlines.overdue == 1
    assert slots.take_lost_slots(signed(store, "generator/0"), 8) == slot
