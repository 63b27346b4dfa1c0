"""The signed weight digest (``app.weight_digest``): the same digest whatever the sender's
memory layout, a changed byte changes it, and a generator refuses a version whose bytes
do not match the trainer's signed record, keeping the one it has (a real gloo weight
group, in processes, with the test hook altering one version in flight)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from app import frames, names, weight_digest
from app.weight_digest import DigestCheck, digest, publish, sent_runs
from app.weight_layout import Layout
from app.weight_sync import WeightReceiver, WeightSender, init_weight_group
from role_processes import loopback_store, run_roles, weight_member
from test_weight_sync import BUCKET_MB, _assert_same, flattened, model_params

SECRET = bytes(range(32))


def runs_of(params) -> list[torch.Tensor]:
    return sent_runs(params, Layout(params, int(BUCKET_MB * 2**20)))


@pytest.mark.parametrize("chunk_bytes", [weight_digest.CHUNK_BYTES, 1000])  # 1000: cuts inside tensors
def test_the_digest_is_the_same_for_packed_and_flat_senders(monkeypatch, chunk_bytes):
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", chunk_bytes)
    packed = runs_of(model_params(3))  # separate allocations: packed copies
    flat = runs_of(flattened(model_params(3)))  # views of the flat buffers
    assert digest(packed) == digest(flat)
    received = [torch.empty_like(r).copy_(r) for r in flat]  # what a generator stages
    assert digest(received) == digest(flat)


def test_one_changed_byte_or_another_order_changes_the_digest():
    runs = runs_of(flattened(model_params(3)))
    before = digest(runs)
    runs[0].view(torch.uint8)[12345] ^= 1
    assert digest(runs) != before
    assert digest(runs[::-1]) != digest(runs)


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def test_a_generator_takes_only_weights_that_match_the_signed_record(store, caplog):
    runs = runs_of(flattened(model_params(1)))
    check = DigestCheck(store, SECRET, 0)
    with caplog.at_level(logging.ERROR, logger="llamarl"):
        assert not check(1, runs)  # nothing published yet
        publish(store, SECRET, 1, digest(runs))
        assert check(1, runs)
        altered = [r.clone() for r in runs]
        altered[1].view(torch.uint8)[0] ^= 0x80
        assert not check(1, altered) and not check(1, altered)
        # A record for another version, or one not signed with the app's secret.
        store.set(names.weight_digest_key(2), frames.encode({"version": 1, "digest": digest(runs)}, SECRET))
        assert not check(2, runs)
        store.set(names.weight_digest_key(3), frames.encode({"version": 3, "digest": digest(runs)}, bytes(32)))
        assert not check(3, runs)
    assert check.metrics() == {"security/weight_digest/no_record": 1.0, "security/weight_digest/mismatch": 2.0,
                               "security/weight_digest/bad_record": 2.0}
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 3 and "altered in flight" in refusals[1]  # once per reason
    assert check.new_counts() == check.metrics() and check.new_counts() == {}  # reported once a change


def test_old_records_are_deleted_as_new_ones_are_published(store):
    for version in range(10):
        publish(store, SECRET, version, "d")
    kept = [v for v in range(10) if store.check([names.weight_digest_key(v)])]
    assert kept == [6, 7, 8, 9]


def _refuse_an_altered_version(store, rank: int, world_size: int) -> str:
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=30)
    if rank == 0:
        live = flattened(model_params(0))
        sender = WeightSender(group, live, bucket_mb=BUCKET_MB)
        layout = Layout(live, int(BUCKET_MB * 2**20))
        for version in (1, 2, 3):
            with torch.no_grad():
                for (_, p), (_, new) in zip(live, model_params(version)):
                    p.copy_(new)
            publish(store, SECRET, version, digest(sent_runs(live, layout)))
            sender.send(version)
            deadline = time.monotonic() + 30
            while not store.check([f"test/checked/{version}"]):
                assert time.monotonic() < deadline, f"generator never checked version {version}"
                time.sleep(0.005)
        return "sent"
    os.environ[weight_digest.TEST_CORRUPT_ENV] = "0:2,5:3"  # generator 0, version 2 (and another's)
    live = flattened(model_params(0, seed=7))
    check = DigestCheck(store, SECRET, 0)
    receiver = WeightReceiver(group, live, bucket_mb=BUCKET_MB, verify=check)
    receiver.start_background()
    outcome = []
    for version in (1, 2, 3):
        deadline = time.monotonic() + 30
        while not [s for s in receiver.pop_stats() if s.version == version]:
            assert time.monotonic() < deadline, f"version {version} never arrived"
            time.sleep(0.005)
        outcome.append((receiver.latest_version(), receiver.swap_if_newer()))
        _assert_same(live, model_params(1 if version == 2 else version))  # 2 refused: 1 kept
        store.set(f"test/checked/{version}", "1")
    receiver.stop_background()
    assert check.metrics() == {"security/weight_digest/mismatch": 1.0}
    return repr(outcome)


@pytest.mark.integration
def test_a_generator_refuses_a_version_altered_in_flight_and_keeps_its_own(store):
    results = dict(run_roles(_refuse_an_altered_version, 2, store.port, 120))
    assert results[0] == "sent", results
    # Version 2 (altered) is never staged nor applied; version 3 is.
    assert results[1] == repr([(1, 1), (1, None), (3, 3)]), results


@pytest.mark.gpu
def test_a_cuda_run_has_the_digest_of_its_host_copy(monkeypatch):
    """On CUDA each chunk is copied to the host to be hashed: the digest is the bytes',
    wherever they live (a generator on GPU checks a trainer on GPU, or on CPU)."""
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", 1 << 20)
    runs = [torch.randn(3_000_000, device="cuda"), torch.randn(70_000, device="cuda").bfloat16()]
    assert digest(runs) == digest([r.cpu() for r in runs])
