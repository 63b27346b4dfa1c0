"""The slot lifecycle (``llamarl.app.control.slots``) over a real TCPStore on loopback:
reserve -> hold -> pass -> consume (trained, dropped as stale, duplicate) and
hold -> lose -> regenerate, with the budget's places given back and taken back."""

from __future__ import annotations

import pytest

from llamarl.app import names
from llamarl.app.control import slots
from llamarl.app.rl.contract import GroupId, Rejections, Rollout, RolloutGroup
from role_processes import control, loopback_store, signed

B = 2  # groups per step


@pytest.fixture()
def store():
    store = loopback_store(timeout_s=30)
    control(store, "trainer/0").register("trainer", 0)
    return store


def group(seq: int, slot: int | None, version: int = 0) -> RolloutGroup:
    gid = GroupId(0, seq)
    g = RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[-1.0], version=version, group_id=gid)])
    g.slot = slot
    return g


def trainer_side(store, ledger: slots.SlotLedger, events: list, **kw) -> slots.Settlement:
    return slots.Settlement(signed(store, "trainer/0"), rank=0, world=1, ledger=ledger, max_staleness=0,
                            rejections=Rejections("trainer/0"), emit=events.extend, **kw)


def test_a_slot_goes_from_reserved_to_consumed_and_a_lost_one_is_regenerated_once(store):
    events: list[dict] = []
    ledger = slots.SlotLedger()
    slots.publish_start(signed(store), ledger, 0)
    gen0, gen1 = signed(store, "generator/0"), signed(store, "generator/1")
    budget = slots.SlotBudget(gen0, groups_per_step=B, max_staleness=0, ledger=ledger)
    # reserve: the synchronous bound is one step's slots.
    assert budget.slot_ids(budget.reserve(8, version=0)) == [0, 1]
    assert slots.SlotBudget(gen1, groups_per_step=B, max_staleness=0).reserve(1, version=0) == range(0)
    # hold, then pass slot 0; generator 0 is lost holding slot 1.
    held = slots.HeldSlots(gen0)
    held.take([0, 1])
    held.passed(0)
    assert slots.return_held(signed(store), "generator/0") == 1
    assert slots.lost_slots_waiting(store) == 1
    # regenerate: outside the counter, once.
    assert slots.take_lost_slots(gen1, 8) == [1] and slots.take_lost_slots(gen1, 8) == []
    # consume: slot 0 and the regenerated slot 1 are trained.
    settle = trainer_side(store, ledger, events)
    batch = [group(1, 0), group(2, 1)]
    assert settle.settle(batch, version=0) == batch
    assert ledger.state_dict() == {"frontier": 2, "done": []}
    assert settle.freed == 0 and budget.dropped() == 0 and events == []


def test_a_stale_group_gives_its_place_back_and_a_second_copy_takes_one_back(store):
    events: list[dict] = []
    ledger = slots.SlotLedger()
    slots.publish_start(signed(store), ledger, 0)
    settle = trainer_side(store, ledger, events)
    budget = slots.SlotBudget(signed(store, "generator/0"), groups_per_step=B, max_staleness=0, ledger=ledger)
    assert budget.reserve(8, version=0) == range(0, 2)
    settle.on_drop(group(1, 0), lag=1)  # from the pipeline's thread: given back at once
    assert settle.freed == 1 and budget.dropped() == 1
    assert budget.reserve(8, version=0) == range(2, 3), "its place is filled again"
    # The step: slot 0 settled as dropped; slot 1 trained; a second copy of slot 1 (its
    # lost executor's group got out, and the regenerated one) is a duplicate.
    kept = settle.settle([group(2, 1), group(3, 1), group(4, None)], version=3)
    assert [g.group_id.seq for g in kept] == [2, 4], "a group with no slot is trained, never a duplicate"
    assert (settle.dropped, settle.duplicates) == (1, 1)
    assert settle.freed == 0 and budget.dropped() == 0, "the duplicate's batch place is taken back"
    assert ledger.state_dict() == {"frontier": 2, "done": []}
    assert [e["step"] for e in events] == [4], "the stale group's staleness, at the next version"
    assert settle.rejections.metrics() == {names.rejected_metric("too_old"): 1.0}
    # A stale second copy of a consumed slot: its place, given back, is taken back.
    settle.on_drop(group(5, 0), lag=2)
    assert budget.dropped() == 1
    assert settle.settle([], version=4) == [] and budget.dropped() == 0 and settle.dropped == 1


def test_a_resumed_run_restarts_the_counter_and_continues_the_places_given_back(store):
    """A checkpoint consumed slots 0-4 and 7 (5 and 6 were in flight) and the run had given
    back 3 places: the counter restarts at 6, counter values 6 and 7 fill slots 5 and 6
    first, and replica 0's dropped counter continues from 3."""
    ledger = slots.SlotLedger.from_state({"frontier": 5, "done": [7]})
    slots.publish_start(signed(store), ledger, 3)
    gen = signed(store, "generator/0")
    assert gen.get(names.RESERVED_KEY) == {"count": 6}
    assert gen.get(names.SLOTS_DONE_KEY) == {"frontier": 5, "done": [7]}
    assert slots.given_back(gen, ["trainer/0", "trainer/1"]) == 3
    budget = slots.SlotBudget(gen, groups_per_step=B, max_staleness=0, ledger=ledger)
    assert budget.slot_ids(budget.reserve(3, version=3)) == [5, 6, 8]
    settle = trainer_side(store, ledger, [], dropped=2, freed=3)
    settle.on_drop(group(1, 5), lag=1)
    assert gen.get(names.dropped_key("trainer/0")) == 4 and settle.dropped == 2  # counted at the settling
