"""Signed control keys (``llamarl.app.control.signed``) against a real store on loopback: a write that is
not this app's, is meant for another key or is a replay is ignored and counted; the
store listens on the interface it is told to, not on every one."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from llamarl.app.control import membership
from llamarl.app import names
from llamarl.app.control import slots
from llamarl.app.control.slots import SlotBudget
from llamarl.app.control.signed import USER, SignedStore, key_kind
from llamarl.app.control.transport import Control, EVERY_INTERFACE, connect_store, host_store
from role_processes import control, loopback_store, signed

OTHER_SECRET = bytes(32)


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def counts(reader: Control | SignedStore) -> dict[str, float]:
    signed_store = reader.signed if isinstance(reader, Control) else reader
    return signed_store.rejections.metrics()


def test_a_forged_stop_is_ignored_and_counted_once(store):
    trainer, gen = control(store), control(connect_store(f"127.0.0.1:{store.port}", 10), "generator/0")
    for forged in (b"stop now", SignedStore(store, OTHER_SECRET, "trainer/0").seal(names.STOP_KEY, {
            "reason": "forged", "finished": True})):
        store.set(names.STOP_KEY, forged)
        assert not gen.stopped() and not gen.stopped(), "read twice, counted once"
    assert counts(gen) == {"security/rejected_writes/stop": 2.0}
    # A stop signed with the app's secret still lands over the forged value.
    trainer.request_stop("finished 3 steps", finished=True)
    assert gen.stopped() and gen.stop_reason() == "finished 3 steps" and gen.stop_finished()
    # ...and a forged value written after it changes nothing for a role that has read it.
    store.set(names.STOP_KEY, b"garbage")
    assert gen.stop_reason() == "finished 3 steps"


def test_only_the_controller_can_call_a_stop_finished(store):
    """A user's stop and a member's failure stop the run, and no role then exits 0."""
    user = Control(signed(store, USER))
    user.request_stop("stopped by me", finished=True)
    reader = control(store, "generator/0")
    assert reader.stop_reason() == "stopped by me" and not reader.stop_finished()


def test_a_record_moved_to_another_key_or_replayed_is_ignored(store):
    trainer, gen = control(store), control(store, "generator/0")
    trainer.set_version(3)
    old = store.get(names.VERSION_KEY)
    trainer.set_version(4)
    assert gen.version() == 4
    store.set(names.VERSION_KEY, old)  # replayed: an older record of the same writer
    assert gen.version() == 4
    store.set(names.STOP_KEY, old)  # moved: signed for the version key
    assert not gen.stopped()
    assert counts(gen) == {"security/rejected_writes/version": 1.0, "security/rejected_writes/stop": 1.0}


def test_a_replayed_heartbeat_does_not_keep_a_dead_member_alive(store):
    trainer, gen = control(store), control(store, "generator/0")
    gen.register("generator", 0)
    assert trainer.last_heartbeats()["generator/0"] < 1
    first = store.get(names.heartbeat_key("generator/0"))
    gen.heartbeat("generator", 0)
    trainer.last_heartbeats()
    store.set(names.heartbeat_key("generator/0"), first)  # the killed member's old beat, replayed
    import time
    time.sleep(0.3)
    assert trainer.last_heartbeats()["generator/0"] >= 0.3, "a replayed beat does not move"
    assert counts(trainer) == {"security/rejected_writes/heartbeat": 1.0}


def test_forged_membership_and_failure_entries_are_ignored(store):
    trainer = control(store)
    control(store, "generator/0").register("generator", 0)
    # A member name appended without its record, a failure named with a forged record.
    store.append(names.MEMBERS_KEY, ";generator/7;")
    store.append(names.MEMBERS_KEY, "garbage-with-no-delimiter")
    store.set(names.failure_key("generator/0"), b"forged failure")
    store.append(names.FAILED_KEY, ";generator/0;")
    store.set(names.gone_key("generator/0"), b"forged")
    store.append(names.GONE_KEY, ";generator/0;")
    assert trainer.members() == ["generator/0"]
    assert trainer.failures() == {} and trainer.dead_members(max_age_s=60) == []
    assert trainer.gone() == set()
    # The garbage before it does not swallow the next real name.
    control(store, "generator/1").register("generator", 1)
    assert trainer.members() == ["generator/0", "generator/1"]
    assert counts(trainer) == {"security/rejected_writes/membership": 2.0,
                               "security/rejected_writes/failure": 1.0}


def test_a_published_record_overwritten_is_published_again(store):
    trainer = signed(store)
    trainer.put(names.CONFIG_KEY, {"run_dir": "/runs/a"}, keep=True)
    store.set(names.CONFIG_KEY, b"forged config")
    reader = signed(store, "generator/0")
    assert reader.get(names.CONFIG_KEY) is None, "nothing authentic yet to read"
    assert trainer.reassert() == [names.CONFIG_KEY]
    assert reader.get(names.CONFIG_KEY) == {"run_dir": "/runs/a"}
    assert trainer.reassert() == []
    assert counts(reader) == counts(trainer) == {"security/rejected_writes/config": 1.0}


def test_the_slot_counter_survives_a_forged_and_a_replayed_value(store):
    control(store).register("trainer", 0)
    signed(store).put(names.RESERVED_KEY, {"count": 0})
    gen = SlotBudget(signed(store, "generator/0"), groups_per_step=4, max_staleness=1)
    assert gen.reserve(3, version=0) == range(0, 3)
    early = store.get(names.RESERVED_KEY)
    assert gen.reserve(3, version=0) == range(3, 6)
    store.set(names.RESERVED_KEY, b"999999")  # "every slot is taken": the generators would stall
    assert gen.reserve(1, version=0) == range(6, 7)
    store.set(names.RESERVED_KEY, early)  # an older count, replayed: slots would be handed out twice
    assert gen.reserve(5, version=0) == range(7, 8)
    # A forged dropped-groups counter does not widen the bound.
    store.set(names.dropped_key("trainer/0"), b"1000")
    assert gen.reserve(5, version=0) == range(0)
    assert counts(gen.signed) == {"security/rejected_writes/slots": 3.0}


def test_lost_slots_and_held_lists_take_signed_records_only(store):
    queue = names.queue_key(names.LOST_SLOTS)
    store.queue_push(queue, b"5")
    controller = signed(store)
    item = controller.seal(queue, 6)
    store.queue_push(queue, item)
    store.queue_push(queue, item)  # replayed
    gen = signed(store, "generator/0")
    assert slots.take_lost_slots(gen, 8) == [6]
    assert counts(gen) == {"security/rejected_writes/lost_slots": 2.0}
    # A held list forged for a member returns nothing to regenerate when it is lost.
    store.set(names.held_key("generator/1"), b"[1, 2, 3]")
    watch = membership.Membership(controller, {"generator": 2})
    assert slots.return_held(watch.signed, "generator/1") == 0
    assert counts(controller) == {"security/rejected_writes/held": 1.0}


def test_key_kinds_name_the_metric():
    assert key_kind(names.heartbeat_key("generator/0")) == "heartbeat"
    assert key_kind(names.dropped_key("trainer/1")) == "slots"
    assert key_kind("weights/roster/3") == "weights"
    assert key_kind(names.queue_key(names.LOST_SLOTS)) == "lost_slots"


# --------------------------------------------------------------------------- binding


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (what others could reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the route's source
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def reachable(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((address, port)) == 0


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost"])
def test_a_store_bound_to_loopback_is_not_reachable_on_another_address(bind):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    store = host_store(0, bind=bind)
    assert reachable("127.0.0.1", store.port)
    assert not reachable(address, store.port), f"the store answers on {address}"
    client = connect_store(f"{bind}:{store.port}", timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_torch_alone_listens_everywhere_whatever_host_it_is_given():
    """Why ``host_store`` binds a socket of its own: the reason, measured (torch 2.13)."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    plain = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    assert reachable(address, plain.port)
    everywhere = host_store(0, bind=EVERY_INTERFACE)
    assert reachable(address, everywhere.port) and reachable("127.0.0.1", everywhere.port)


def test_a_bind_address_that_does_not_resolve_says_so():
    with pytest.raises(OSError, match="does not resolve"):
        host_store(0, bind="no-such-host.invalid", resolve_timeout_s=0.0)


def test_forged_exit_and_dataset_check_acknowledgements_are_ignored(store):
    """The controller keeps the store up until each member acknowledged the stop, and
    starts only once each generator checked its prompts: neither can be cut short."""
    trainer = control(store)
    store.set(names.exited_key("generator/0"), b"1")
    store.set(names.data_checked_key("generator/0"), signed(store, "generator/1").seal(
        names.data_checked_key("generator/0"), "fingerprint"))  # another member's record
    assert not trainer.exited("generator/0")
    assert trainer.signed.record(names.data_checked_key("generator/0"), writers=("generator/0",)) is None
    control(store, "generator/0").mark_exited("generator", 0)
    assert trainer.exited("generator/0")
    assert counts(trainer) == {"security/rejected_writes/membership": 2.0}


def test_a_read_that_lost_a_race_with_another_thread_is_not_a_replay(store):
    """Clones (one per thread) share the reader state: a value one thread read before
    another thread read and accepted a newer one is stale, not replayed, and not counted;
    the newest accepted record is the answer."""
    writer = signed(store, "trainer/0")
    reader = signed(store, "generator/0")
    other_thread = reader.clone()
    writer.put(names.VERSION_KEY, 1)
    read_first = store.get(names.VERSION_KEY)  # this thread's read, not yet opened
    writer.put(names.VERSION_KEY, 2)
    assert other_thread.record(names.VERSION_KEY).value == 2
    assert reader.open(names.VERSION_KEY, read_first).value == 2
    assert counts(reader) == {}
    store.set(names.VERSION_KEY, read_first)  # the same old record, now in the store: a replay
    assert reader.record(names.VERSION_KEY).value == 2
    assert counts(reader) == {"security/rejected_writes/version": 1.0}
