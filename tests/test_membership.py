"""``llamarl.app.control.membership`` against a real store on loopback: which executors are gone, what
their loss returns for regeneration, and when a loss is fatal."""

from __future__ import annotations

import time

import pytest

from llamarl.app.control import health
from llamarl.app.control import membership
from llamarl.app.control import slots
from llamarl.app import names
from role_processes import control, loopback_store, signed

GONE_S = 0.3


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def _register(store, **replicas: int) -> None:
    """Each member registers as itself (its heartbeat record is signed by it)."""
    for role, n in replicas.items():
        for r in range(n):
            control(store, names.member(role, r)).register(role, r)


def _beat(store, *members: str) -> None:
    for m in members:
        role, replica = m.split("/")
        control(store, m).heartbeat(role, int(replica))


def test_a_silent_generator_is_taken_out_and_its_held_slots_go_back(store):
    trainer = control(store)
    _register(store, generator=2, trainer=1)
    held = slots.HeldSlots(signed(store, "generator/1"))
    held.take([7, 8, 9])
    held.passed(8)  # its group is in the queue: not lost
    watch = membership.Membership(signed(store), {"generator": 2, "reward": 0}, gone_after_s=GONE_S)
    assert watch.poll() == []  # first sight: everyone fresh
    time.sleep(GONE_S + 0.1)
    _beat(store, "generator/0", "trainer/0")
    assert watch.poll() == ["generator/1"]
    assert watch.gone() == {"generator/1"} and watch.tolerated("generator/1")
    assert watch.alive("generator") == ["generator/0"] and watch.lost_groups() == 2
    assert slots.lost_slots_waiting(store) == 2
    survivor = signed(store, "generator/0")
    assert slots.take_lost_slots(survivor, 8) == [7, 9]
    assert slots.take_lost_slots(survivor, 8) == []
    # The health check of every trainer rank skips it from now on; the app is healthy.
    health.check_health(trainer, timeout_s=GONE_S)


def test_a_member_whose_heartbeat_moves_again_is_back(store):
    _register(store, generator=2)
    watch = membership.Membership(signed(store), {"generator": 2}, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    _beat(store, "generator/0")
    assert watch.poll() == ["generator/1"]
    control(store, "generator/1").register("generator", 1)  # the scheduler restarted it, same replica id
    watch.poll()
    assert watch.gone() == set() and watch.rejoined == ["generator/1"]
    assert watch.alive("generator") == ["generator/0", "generator/1"]


@pytest.mark.parametrize("role, what", [("generator", "generator"), ("reward", "reward executor")])
def test_the_last_of_its_role_is_not_tolerated(store, role, what):
    trainer = control(store)
    _register(store, generator=1, reward=1)
    watch = membership.Membership(signed(store), {"generator": 1, "reward": 1}, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    other = "reward/0" if role == "generator" else "generator/0"
    _beat(store, other)
    assert watch.poll() == []
    assert watch.gone() == set()
    with pytest.raises(health.AppFailed, match=rf"^{role}/0 failed: gone: .* it was the last {what}"):
        health.check_health(trainer)


def test_an_unreadable_held_list_regenerates_nothing(store):
    _register(store, reward=2)
    signed(store, "reward/1").put(names.held_key("reward/1"), ["x", -1, True, 3])
    watch = membership.Membership(signed(store), {"reward": 2}, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    _beat(store, "reward/0")
    watch.poll()
    assert slots.take_lost_slots(signed(store, "reward/0"), 8) == [3]  # only the well-formed slot id


def test_the_watcher_thread_takes_a_member_out(store):
    trainer = control(store)
    _register(store, generator=2)
    watch = membership.Membership(signed(store), {"generator": 2}, gone_after_s=GONE_S)
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while "generator/1" not in watch.gone():
            assert time.monotonic() < deadline, "the watcher never took generator/1 out"
            _beat(store, "generator/0")
            time.sleep(0.05)
    finally:
        watch.stop()
    assert trainer.gone() == {"generator/1"}
