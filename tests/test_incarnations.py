"""Generator incarnations (``llamarl.app.control.incarnations``) against a real store on loopback: drawn,
registered under the run attempt in a signed record; a forged or another attempt's record
is not believed, and a group captured before a resume is refused as a replay."""

from __future__ import annotations

from llamarl.app import names
from llamarl.app.rl.contract import Rejections, to_message
from llamarl.app.control.incarnations import INCARNATIONS, Incarnations, admission, register
from llamarl.app.control.seen_groups import REPLAY, first_seq, incarnation_of
from llamarl.app.control.signed import SignedStore
from role_processes import TEST_SECRET, loopback_store, signed
from test_seen_groups import group

OLD, NEW = "attempt-before-the-resume", "attempt-after-the-resume"


def test_every_incarnation_numbers_groups_that_fit_an_int64_and_name_it_back():
    for incarnation in (1, 2, INCARNATIONS):
        assert incarnation_of(first_seq(incarnation)) == incarnation
        assert incarnation_of(first_seq(incarnation) + 2**32 - 1) == incarnation
    assert first_seq(INCARNATIONS) + 2**32 - 1 < 2**63


def test_a_restarted_generator_is_known_with_its_earlier_process():
    store = loopback_store(timeout_s=30)
    first = register(signed(store, "generator/0"), 0, NEW)
    second = register(signed(store, "generator/0"), 0, NEW)  # a new process: a new signer state
    assert first != second
    reader = Incarnations(signed(store), NEW)
    # The reader met neither process before: the earlier one's last groups are still taken.
    assert reader.known(0, first) and reader.known(0, second)
    assert not reader.known(1, first)  # another replica's groups name their own processes
    assert not Incarnations(signed(store), OLD).known(0, second)  # another attempt's reader


def test_a_forged_or_another_attempts_incarnation_record_is_ignored_and_counted():
    store = loopback_store(timeout_s=30)
    # An authentic record of the attempt before the resume (the same secret), at its key.
    stale = register(signed(store, "generator/0"), 0, OLD)
    reader = Incarnations(signed(store), NEW)
    assert not reader.known(0, stale)
    key = names.incarnation_key("generator/0", 7)
    store.set(key, b'{"attempt": "%s"}' % NEW.encode())  # unsigned
    assert not reader.known(0, 7)
    # Signed with the app's secret, but by another generator: not its to write.
    store.set(key, SignedStore(store, TEST_SECRET, "generator/1").seal(key, {"attempt": NEW}))
    assert not reader.known(0, 7)
    assert reader.signed.rejections.metrics() == {names.rejected_write_metric("incarnation"): 2.0}
    # A new process's record, overwritten before any reader met it, is put back by its
    # writer (each heartbeat reasserts), and then known.
    generator = signed(store, "generator/0")
    fresh = register(generator, 0, NEW)
    store.set(names.incarnation_key("generator/0", fresh), b"forged")
    assert not reader.known(0, fresh)
    assert generator.reassert() == [names.incarnation_key("generator/0", fresh)]
    assert reader.known(0, fresh) and not reader.known(0, stale)


def test_a_group_captured_before_a_resume_is_refused_and_does_not_hold_up_the_new_process():
    """Before the resume generator 0 made groups (0, first_seq(old) + k); the resumed run's
    store is new, its seen-id sets empty. Replayed into it, the captured groups are refused
    as replays, so they neither train nor lift the generator's seen-id floor: the new
    process's groups are all taken."""
    before, after = loopback_store(timeout_s=30), loopback_store(timeout_s=30)
    old = register(signed(before, "generator/0"), 0, OLD)
    captured = [to_message(group(0, first_seq(old) + k, version=1)) for k in (0, 9000)]
    new = register(signed(after, "generator/0"), 0, NEW)
    genuine = [to_message(group(0, first_seq(new) + k, version=1)) for k in range(3)]
    rejections = Rejections("trainer/0")
    admit = admission(signed(after), NEW, current_version=lambda: 1, published_version=lambda: 1)
    taken = rejections.decode(captured + genuine + captured, admit)
    assert [g.group_id.seq - first_seq(new) for g in taken] == [0, 1, 2]
    assert rejections.metrics() == {names.rejected_metric(REPLAY): 4.0}
    # Without the attempt check (the seen-id sets alone) the captured groups would be trained.
    from llamarl.app.control.seen_groups import Admission

    assert [g.group_id.seq for g in Rejections("trainer/0").decode(captured, Admission(current_version=lambda: 1))] \
        == [first_seq(old), first_seq(old) + 9000]
