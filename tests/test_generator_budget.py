"""The generators' staleness budget (``llamarl.app.control.slots.SlotBudget``) over a real TCPStore.

Slot n (0-based) trains at step n // B + 1, so a generator holding weights of version v
may fill slots below (v + 1 + max_staleness) * B (+ the groups the trainer dropped) and
no rollout it makes can be more than ``max_staleness`` stale when it trains.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from llamarl.app import names
from llamarl.app.control import slots
from llamarl.app.control.slots import SlotBudget, SlotLedger
from llamarl.app.roles.generator import batch_seed
from llamarl.app.control.transport import connect_store, host_store
from role_processes import control, signed

B = 4  # groups per step


@pytest.fixture()
def store():
    store = host_store(0, None, timeout_s=30, bind="127.0.0.1")
    # What trainer replica 0 does before any generator starts.
    control(store, "trainer/0").register("trainer", 0)
    signed(store).put(names.RESERVED_KEY, {"count": 0})
    return store


def drop(store, total: int) -> None:
    """The trainer's signed count of the groups it dropped so far."""
    signed(store).put(names.dropped_key("trainer/0"), total)


def generator(store, replica: int = 0):
    return signed(store, f"generator/{replica}")


def client(store):
    return connect_store(f"127.0.0.1:{store.port}", timeout_s=10)


def cap(version: int, max_staleness: int, dropped: int = 0) -> int:
    return (version + 1 + max_staleness) * B + dropped


def test_reserve_stops_at_the_staleness_cap(store):
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=1)
    first = budget.reserve(100, version=0)
    assert first == range(0, cap(0, 1))
    # Slot n trains at step n // B + 1 with the trainer at version n // B: lag <= 1.
    assert max(n // B for n in first) - 0 == 1
    assert budget.reserve(1, version=0) == range(0), "no slot past the cap at the same version"
    assert budget.reserve(3, version=1) == range(8, 11)
    assert budget.reserve(3, version=1) == range(11, 12), "a partial grant up to the cap"
    assert budget.reserve(3, version=1) == range(0)


def test_dropped_groups_are_handed_out_again(store):
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=0)
    assert budget.reserve(100, version=0) == range(0, 4)
    drop(store, 3)  # the trainer dropped three stale groups
    assert budget.reserve(100, version=0) == range(4, 7)
    assert budget.reserve(100, version=0) == range(0)


def test_batch_places_taken_by_second_copies_are_taken_back(store):
    """A step's batch held the regenerated twin of a slot already trained: that place
    was used without a counted slot, so the trainer's net count goes below zero and the
    generators fill one place fewer (else one group too many stays in flight)."""
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=0)
    assert budget.reserve(100, version=0) == range(0, 4)
    drop(store, -1)
    assert budget.reserve(100, version=1) == range(4, 7)  # (1 + 1) * 4 - 1
    drop(store, 0)  # then a stale group given back
    assert budget.reserve(100, version=1) == range(7, 8)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_a_twin_in_a_batch_leaves_no_group_too_many_in_flight(store, max_staleness):
    """The loop of one fast generator and the trainer, with the real budget and ledger
    and the trainer's arithmetic: a stale group gives its place back when dropped, the
    settling takes back one place per second copy (``slots_taken_back``). At step 5 the
    twin of a trained slot (a lost executor's group that got out, and its regeneration)
    takes a place in a batch. The trainer never waits for a group the budget forbids, and
    after the step that follows no group is ever too stale again. (Were the twin's place
    given back instead, one group too many would stay in flight and a group would turn
    stale every step or two for the rest of the run.)"""
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=max_staleness)
    ledger, fifo, version, net, stale_after, trained = SlotLedger(), [], 0, 0, [], 0
    for step in range(1, 31):
        fifo += [(slot, version) for slot in budget.reserve(100, version)]
        if step == 5:
            fifo.insert(0, (0, version))  # slot 0 trained at step 1: the twin
        stale, batch = [], []
        while len(batch) < B:
            if not fifo:  # the generator fills what the stale drops gave back
                fifo += [(slot, version) for slot in budget.reserve(100, version)]
            assert fifo, f"step {step}: the trainer waits for a group the budget forbids"
            slot, made_with = fifo.pop(0)
            if version - made_with > max_staleness:
                stale.append(slot)
                net += 1  # given back at once
                drop(store, net)
            else:
                batch.append(slot)
        first = ledger.consume_across_ranks(stale + batch)
        net -= slots.slots_taken_back(first[:len(stale)], first[len(stale):])
        drop(store, net)
        trained += sum(first[len(stale):])
        if step > 6:
            stale_after += stale
        version += 1
    assert stale_after == []
    assert trained == 30 * B - 1  # the twin used one place


def test_random_reservations_never_exceed_the_bound(store):
    rng = random.Random(0)
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=2)
    version, dropped, granted = 0, 0, 0
    for _ in range(300):
        action = rng.random()
        if action < 0.2:
            version += 1
        elif action < 0.3:
            dropped += 1
            drop(store, dropped)
        else:
            slots = budget.reserve(rng.randint(1, 6), version)
            if slots:
                assert slots.start == granted, "slots are handed out back to back"
            granted += len(slots)
            assert granted <= cap(version, 2, dropped)
    assert granted > cap(0, 2), "the budget grew with the versions"


def _reserve_until_empty(store_addr: str, version: int, max_staleness: int, out: list[range],
                         barrier: threading.Barrier) -> None:
    store = connect_store(store_addr, timeout_s=10)  # one connection per "generator"
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=max_staleness)
    barrier.wait()
    while slots := budget.reserve(1, version):
        out.append(slots)


@pytest.mark.parametrize("max_staleness", [0, 3])
def test_concurrent_reservations_never_overlap(store, max_staleness):
    """Four generators race on their own store connections (as separate processes do):
    every slot up to the cap is handed out exactly once."""
    version = 5
    results: list[list[range]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)
    threads = [threading.Thread(target=_reserve_until_empty,
                                args=(f"127.0.0.1:{store.port}", version, max_staleness, out, barrier))
               for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a reservation hung"
    slots = [n for out in results for r in out for n in r]
    assert len(slots) == len(set(slots)), "two generators got the same slot"
    assert sorted(slots) == list(range(cap(version, max_staleness)))
    assert sum(bool(out) for out in results) >= 2, "the race did not happen: one thread took all"


def test_synchronous_budget_gives_exactly_the_next_step(store):
    """max_staleness = 0: weights of version v fill exactly the B slots of step v + 1,
    whichever generator asks, however much it asks for."""
    generators = [SlotBudget(generator(client(store), i), groups_per_step=B, max_staleness=0) for i in range(2)]
    for version in range(4):
        got: list[int] = []
        for _ in range(5):
            for budget in generators:
                got += list(budget.reserve(3, version))
        step_slots = range(version * B, (version + 1) * B)
        assert got == list(step_slots)
        assert {n // B + 1 for n in got} == {version + 1}


def test_after_a_resume_the_slots_lost_in_flight_come_first(store):
    """Resumed at step 2 (B=4, max_staleness 1): the checkpoint consumed slots 0-6 and 8;
    7 was in flight at the crash. The counter restarts at the 8 consumed, and the same
    staleness cap hands out 7 first, then fresh slots from 9: none twice, none skipped."""
    ledger = SlotLedger()
    for slot in [*range(7), 8]:
        ledger.consume(slot)
    signed(store).put(names.RESERVED_KEY, {"count": ledger.count})
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=1, ledger=ledger)
    reserved = budget.reserve(100, version=2)
    assert reserved == range(8, cap(2, 1))
    assert budget.slot_ids(reserved) == [7, *range(9, 16)]
    assert budget.reserve(1, version=2) == range(0)


def test_slots_lost_with_an_executor_come_back_outside_the_counter(store):
    """A synchronous step whose generator died holding two of its slots: the counter is at
    its cap, yet the survivor gets those two slots back to regenerate, once each."""
    from llamarl.app.control import membership

    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=0)
    assert budget.reserve(100, version=0) == range(0, 4)
    dead = slots.HeldSlots(generator(store, 1))
    dead.take([2, 3])
    assert budget.reserve(1, version=0) == range(0), "the step's slots are all reserved"
    watch = membership.Membership(signed(store), {"generator": 2})  # takes generator/1 out:
    assert slots.return_held(watch.signed, "generator/1") == 2
    assert slots.lost_slots_waiting(store) == 2
    survivor = generator(store, 0)
    assert slots.take_lost_slots(survivor, 8) == [2, 3]
    assert slots.take_lost_slots(survivor, 8) == []
    assert budget.reserve(1, version=0) == range(0), "the counter did not move"


def test_a_batch_seed_depends_on_its_slot_not_on_the_generator_or_its_history():
    seeds = {batch_seed(0, slot) for slot in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert batch_seed(0, 7) == batch_seed(0, 7)
    assert batch_seed(1, 7) != batch_seed(0, 7)
    a, b = (torch.Generator().manual_seed(batch_seed(3, 12)) for _ in range(2))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_auto_budget_follows_the_controllers_signed_bound(store):
    """--max-staleness auto: the bound is the controller's signed record, read at each
    reservation; a record another member wrote is ignored."""
    budget = SlotBudget(generator(store), groups_per_step=B, max_staleness=1, auto=True)
    assert budget.reserve(100, version=0) == range(0, cap(0, 1)), "no record yet: the config's start bound"
    signed(store).put(names.STALENESS_BOUND_KEY, {"bound": 3, "version": 0})
    assert budget.reserve(100, version=0) == range(cap(0, 1), cap(0, 3)), "raised: further ahead at once"
    signed(store, "generator/1").put(names.STALENESS_BOUND_KEY, {"bound": 9, "version": 0})
    assert budget.reserve(100, version=0) == range(0), "a generator's record is not the controller's"
    signed(store).put(names.STALENESS_BOUND_KEY, {"bound": 1, "version": 1})
    assert budget.reserve(100, version=1) == range(0), "lowered: wait until the trainer catches up"
    assert budget.reserve(100, version=3) == range(cap(0, 3), cap(3, 1))
    fixed = SlotBudget(generator(store, 2), groups_per_step=B, max_staleness=1)
    assert fixed.reserve(100, version=4) == range(cap(3, 1), cap(4, 1)), "a fixed bound reads no record"
