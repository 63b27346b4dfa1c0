"""The weight plane's own keys are signed records (``llamarl.app.weights.group``): a forged presence,
layout document or sync announcement is ignored and counted, and the sync goes through,
in real gloo processes on loopback. Without the signature, the forged presence would
have let the generator start the backend's rendezvous alone, the forged layout document
would have failed the generator (``WeightLayoutError``), and the forged announcements
would have had it wait inside a collective the trainer had not started."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from llamarl.app import names
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import connect_store
from llamarl.app.weights.epochs import ElasticSender
from llamarl.app.weights.group import init_weight_group
from llamarl.app.weights.receiver import WeightReceiver
from llamarl.app.weights.sender import WeightSender
from llamarl.app.weights.subscriber import swap_staged
from role_processes import TEST_SECRET, loopback_store, run_roles, signed, wait_until, weight_member
from test_weight_sync import BUCKET_MB, _assert_same, flattened, model_params

pytestmark = pytest.mark.integration

OTHER_SECRET = bytes(32)
MEMBERS = ["trainer/0", "generator/0"]
PLANE = names.WEIGHT_PLANE_PREFIX + "/"


def _plane_key(key: str) -> str:
    return PLANE + key


def _counted_key(n: int) -> str:
    return f"test/counted/{n}"


def _announce_counts(store, member: SignedStore, stop: threading.Event) -> None:
    """Publish each new count of the weight-plane writes ``member`` refused (``test/counted/<n>``),
    so the trainer forges the next key only once the generator has refused the last one."""
    store = store.clone()
    told = 0
    while not stop.is_set():
        n = member.rejections.counts["weights"]
        while told < n:
            told += 1
            store.set(_counted_key(told), "1")
        time.sleep(0.005)


def _sync_past_forged_keys(store, rank: int, world_size: int) -> str:
    """Each of the trainer's keys holds a forged value before the trainer writes it; the
    trainer writes it only once the generator has refused the forged one."""
    member = weight_member(store, rank)
    if rank == 1:
        stop = threading.Event()
        watcher = threading.Thread(target=_announce_counts, args=(store, member, stop), daemon=True)
        watcher.start()
        group = init_weight_group(member, 1, 2, torch.device("cpu"), timeout_s=30, members=MEMBERS)
        live = flattened(model_params(0, seed=7))
        receiver = WeightReceiver(group, live, bucket_mb=BUCKET_MB)
        receiver.start_background()
        wait_until(lambda: receiver.latest_version() == 2, "version 2")
        swap_staged(receiver)
        receiver.stop_background()
        stop.set()
        watcher.join()
        _assert_same(live, model_params(2))
        return f"applied 2, refused {member.rejections.metrics()}"
    wait_until(lambda: store.check([_counted_key(1)]), "the generator to refuse the forged presence")
    group = init_weight_group(member, 0, 2, torch.device("cpu"), timeout_s=30, members=MEMBERS)
    assert group.path.backend == "gloo", "the forged presence said cuda"
    wait_until(lambda: store.check([_counted_key(2)]), "the generator to refuse the forged layout")
    live = model_params(0)
    sender = WeightSender(group, live, bucket_mb=BUCKET_MB)
    wait_until(lambda: store.check([_counted_key(3)]), "the generator to refuse the forged announcement")
    sender.send(1)
    # Garbage where the next announcement goes: the generator must not start sync 2 on it.
    group.store.set(names.weight_sync_announce_key(2), b"2")
    wait_until(lambda: store.check([_counted_key(4)]), "the generator to refuse the garbage announcement")
    with torch.no_grad():
        for (_, p), (_, new) in zip(live, model_params(2)):
            p.copy_(new)
    sender.send(2)
    return "sent 1, 2"


def test_forged_weight_plane_keys_are_ignored_counted_and_the_sync_goes_through():
    store = loopback_store(timeout_s=60)
    # The app's secret but another member: a generator may not say where the trainer is.
    store.set(_plane_key(names.weight_rank_present_key(0)),
              SignedStore(store, TEST_SECRET, "generator/0").seal(_plane_key(names.weight_rank_present_key(0)),
                                                                   "cuda:7"))
    store.set(_plane_key(names.weight_layout_key(1, 0)), b'{"fingerprint": 1, "params": []}')  # unsigned
    announce = _plane_key(names.weight_sync_announce_key(1))
    store.set(announce, SignedStore(store, OTHER_SECRET, "trainer/0").seal(announce, 1))  # another secret
    results = dict(run_roles(_sync_past_forged_keys, 2, store.port, 120))
    assert results[0] == "sent 1, 2", results[0]
    assert results[1] == "applied 2, refused {'security/rejected_writes/weights': 4.0}", results[1]


def test_a_forged_presence_keeps_no_missing_generator_in_the_next_epoch():
    store = loopback_store(timeout_s=30)
    sender = ElasticSender(signed(store), model_params(0), num_generators=3, timeout_s=1.0,
                           gone=set, should_stop=lambda: False)
    sender.epoch = 1
    group = names.weight_epoch_prefix(1) + "/"
    signed(store, "generator/0").prefixed(names.weight_epoch_prefix(1)).put(names.weight_rank_present_key(1), "cpu")
    store.set(group + names.weight_rank_present_key(2), b"cpu")  # generator 1 never came
    other = group + names.weight_rank_present_key(3)  # generator 2's place, signed by generator 0
    store.set(other, SignedStore(connect_store(f"127.0.0.1:{store.port}", 10), TEST_SECRET, "generator/0").seal(
        other, "cpu"))
    assert sender._present([0, 1, 2]) == [0]
    assert sender.plane.rejections.metrics() == {names.rejected_write_metric("weights"): 2.0}
