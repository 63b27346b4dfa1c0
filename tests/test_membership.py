"""``app.membership`` against a real store on loopback: which executors are gone, what
their loss returns for regeneration, and when a loss is fatal."""

from __future__ import annotations

import json
import time

import pytest

from app import health, membership, names
from app.contract import Rejections
from app.transport import Control, StoreQueue
from role_processes import loopback_store

GONE_S = 0.3
SECRET = bytes(range(32))


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def _register(control: Control, **replicas: int) -> None:
    for role, n in replicas.items():
        for r in range(n):
            control.register(role, r)


def _beat(control: Control, *members: str) -> None:
    for m in members:
        role, replica = m.split("/")
        control.heartbeat(role, int(replica))


def test_a_silent_generator_is_taken_out_and_its_held_slots_go_back(store):
    control = Control(store)
    _register(control, generator=2, trainer=1)
    held = membership.HeldSlots(store, "generator/1")
    held.take([7, 8, 9])
    held.passed(8)  # its group is in the queue: not lost
    watch = membership.Membership(store, {"generator": 2, "reward": 0}, SECRET, gone_after_s=GONE_S)
    assert watch.poll() == []  # first sight: everyone fresh
    time.sleep(GONE_S + 0.1)
    _beat(control, "generator/0", "trainer/0")
    assert watch.poll() == ["generator/1"]
    assert watch.gone() == {"generator/1"} and watch.tolerated("generator/1")
    assert watch.alive("generator") == ["generator/0"] and watch.lost_groups() == 2
    assert int(store.add(names.LOST_KEY, 0)) == 2
    assert membership.lost_slots_waiting(store) == 2
    assert membership.take_lost_slots(store, 8, SECRET, Rejections("test")) == [7, 9]
    assert membership.take_lost_slots(store, 8, SECRET, Rejections("test")) == []
    # The health check of every trainer rank skips it from now on; the app is healthy.
    health.check_health(control, timeout_s=GONE_S)


def test_a_member_whose_heartbeat_moves_again_is_back(store):
    control = Control(store)
    _register(control, generator=2)
    watch = membership.Membership(store, {"generator": 2}, SECRET, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    _beat(control, "generator/0")
    assert watch.poll() == ["generator/1"]
    control.register("generator", 1)  # the scheduler restarted it, same replica id
    watch.poll()
    assert watch.gone() == set() and watch.rejoined == ["generator/1"]
    assert watch.alive("generator") == ["generator/0", "generator/1"]


@pytest.mark.parametrize("role, what", [("generator", "generator"), ("reward", "reward executor")])
def test_the_last_of_its_role_is_not_tolerated(store, role, what):
    control = Control(store)
    _register(control, generator=1, reward=1)
    watch = membership.Membership(store, {"generator": 1, "reward": 1}, SECRET, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    other = "reward/0" if role == "generator" else "generator/0"
    _beat(control, other)
    assert watch.poll() == []
    assert watch.gone() == set()
    with pytest.raises(health.AppFailed, match=rf"^{role}/0 failed: gone: .* it was the last {what}"):
        health.check_health(control)


def test_an_unreadable_held_list_regenerates_nothing(store):
    control = Control(store)
    _register(control, reward=2)
    store.set(names.held_key("reward/1"), json.dumps(["x", -1, True, 3]))
    watch = membership.Membership(store, {"reward": 2}, SECRET, gone_after_s=GONE_S)
    watch.poll()
    time.sleep(GONE_S + 0.1)
    _beat(control, "reward/0")
    watch.poll()
    assert membership.take_lost_slots(store, 8, SECRET, Rejections("test")) == [3]  # only the well-formed slot id


def test_a_lost_slot_not_pushed_by_the_watcher_is_dropped_and_counted(store):
    """A slot id pushed by anyone without the secret (or a signed frame without a slot id)
    would make a generator sample a prompt outside the counter: dropped, counted."""
    queue = membership.lost_slots_queue(store, SECRET)
    store.queue_push(queue.key, b"12")  # the plain decimal the queue used to carry
    StoreQueue(store, names.LOST_SLOTS, bytes(32), maxlen=8).push({"slot": 13}, timeout_s=5)
    queue.push({"slot": "14"}, timeout_s=5)
    queue.push({"slot": 15}, timeout_s=5)
    rejections = Rejections("generator/0")
    assert membership.take_lost_slots(store, 8, SECRET, rejections) == [15]
    assert dict(rejections.counts) == {"malformed_frame": 1, "bad_tag": 1, "bad_value": 1}


def test_the_watcher_thread_takes_a_member_out(store):
    control = Control(store)
    _register(control, generator=2)
    watch = membership.Membership(store, {"generator": 2}, SECRET, gone_after_s=GONE_S)
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while "generator/1" not in watch.gone():
            assert time.monotonic() < deadline, "the watcher never took generator/1 out"
            _beat(control, "generator/0")
            time.sleep(0.05)
    finally:
        watch.stop()
    assert control.gone() == {"generator/1"}
