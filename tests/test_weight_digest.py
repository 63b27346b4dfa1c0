"""The signed weight digest (``llamarl.app.weights.digest``), one per trainer rank: the same digest
whatever memory the bytes sit in (a sender's separate parameters, a flat buffer, a
generator's staging), a changed byte changes it, and a generator refuses a version whose
bytes from any trainer rank do not match that rank's signed record, keeping the one it
has and naming the rank (real gloo weight groups, in processes: one trainer rank with the
test hook altering a version in flight; 2 and 3 FSDP2 ranks, uneven shards, one of which
sends bytes other than those it signed)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import pytest
import torch

from llamarl.app import names
from llamarl.app.weights import digest as weight_digest
from llamarl.app.weights.digest import Digest, DigestCheck, ShardDigest, digest, run_pieces
from llamarl.app.weights.layout import Layout
from llamarl.app.weights.group import init_weight_group
from llamarl.app.weights.layout import flatten_parameters_
from llamarl.app.weights.receiver import WeightReceiver
from llamarl.app.weights.sender import WeightSender
from llamarl.app.weights.subscriber import swap_staged
from role_processes import loopback_store, run_roles, signed, weight_member
from test_weight_sync import BUCKET_MB, _assert_same, flattened, model_params

def runs_of(params) -> list[list[torch.Tensor]]:
    return run_pieces(params, Layout(params, int(BUCKET_MB * 2**20)))


@pytest.mark.parametrize("chunk_bytes", [weight_digest.CHUNK_BYTES, 1000])  # 1000: cuts inside tensors
def test_the_digest_is_the_bytes_whatever_memory_they_sit_in(monkeypatch, chunk_bytes):
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", chunk_bytes)
    apart = runs_of(model_params(3))  # separate allocations (some not contiguous)
    flat = runs_of(flattened(model_params(3)))  # views of the flat buffers
    assert digest(apart) == digest(flat)
    whole = [torch.cat(pieces) for pieces in apart]  # one tensor per run: what a generator stages
    assert digest(whole) == digest(apart)
    # Other cuts of the same bytes: two pieces per run, split anywhere.
    halves = [[w[:w.numel() // 3], w[w.numel() // 3:]] for w in whole]
    assert digest(halves) == digest(whole)


def test_one_changed_byte_or_another_order_changes_the_digest():
    runs = [torch.cat(pieces) for pieces in runs_of(flattened(model_params(3)))]
    before = digest(runs)
    runs[0].view(torch.uint8)[12345] ^= 1
    assert digest(runs) != before
    assert digest(runs[::-1]) != digest(runs)


def test_a_run_of_pieces_of_several_dtypes_is_refused():
    with pytest.raises(ValueError, match="one dtype"):
        digest([[torch.zeros(2), torch.zeros(2, dtype=torch.float64)]])


def test_a_hash_thread_that_never_finishes_fails_the_digest_at_its_deadline(monkeypatch):
    """Every wait has a deadline: a digest whose hash thread is stuck raises, naming it."""
    stuck = threading.Event()
    monkeypatch.setattr(weight_digest, "HASH_WAIT_S", 0.2)
    monkeypatch.setattr(weight_digest, "_chunk_digest", lambda pieces: stuck.wait(30))
    h = Digest([torch.float32])
    h.update(0, torch.ones(4))
    try:
        with pytest.raises(TimeoutError, match="weight-digest thread is stuck"):
            h.hexdigest()
    finally:
        stuck.set()


def test_the_digest_is_the_definition_worked_by_hand(monkeypatch):
    """SHA-256 over the chunk size, then per run its dtype and byte count and the SHA-256
    of each CHUNK_BYTES slice of its bytes (a chunk never spans two runs)."""
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", 8)
    f32 = torch.arange(5, dtype=torch.float32)  # 20 bytes: chunks of 8, 8, 4
    i64 = torch.tensor([7], dtype=torch.int64)  # 8 bytes: one chunk
    raw = f32.numpy().tobytes()
    sha = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    by_hand = hashlib.sha256(b"llamarl weights v1, chunks of 8\0")
    by_hand.update(b"torch.float32:20\0" + sha(raw[:8]) + sha(raw[8:16]) + sha(raw[16:]))
    by_hand.update(b"torch.bfloat16:0\0")  # an empty run: its head only
    by_hand.update(b"torch.int64:8\0" + sha(i64.numpy().tobytes()))
    assert digest([[f32[:3], f32[3:]], torch.empty(0, dtype=torch.bfloat16), i64]) == by_hand.hexdigest()


def _cuts(t: torch.Tensor, g: torch.Generator) -> list[torch.Tensor]:
    """``t`` (flat) in pieces cut at random, empty ones among them."""
    at, out = 0, []
    while at < t.numel():
        n = int(torch.randint(0, 40, (1,), generator=g))
        out.append(t[at:at + n])
        at += n
    return out + [t[t.numel():]]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("chunk_bytes", [weight_digest.CHUNK_BYTES, 100, 7])  # 7: cuts inside elements too
def test_the_digest_fed_piece_by_piece_is_the_digest_of_the_whole(monkeypatch, chunk_bytes, deferred):
    """What a generator hashes as each broadcast lands is ``digest()`` of the whole runs:
    odd cuts across chunk boundaries, several dtypes, empty pieces, an empty run and
    runs never fed (they count as empty)."""
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    runs = [torch.randn(301, generator=g), torch.randn(77, generator=g).bfloat16(),
            torch.empty(0, dtype=torch.float16), torch.randint(-9, 9, (53,), generator=g),
            torch.randn(10, generator=g).double()]
    fed = Digest([r.dtype for r in runs], deferred=deferred)
    for k, run in enumerate(runs[:-1]):  # the last run fed nothing...
        for piece in _cuts(run, g):
            fed.update(k, piece)
    assert fed.hexdigest() == digest(runs[:-1] + [runs[-1][:0]])  # ...is an empty run
    assert fed.hexdigest() != digest(runs)
    with pytest.raises(ValueError, match="in order"):
        fed.update(0, runs[0])  # run 0 after run 3
    with pytest.raises(ValueError, match="one dtype"):
        Digest([torch.float32]).update(0, runs[1])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_byte_the_hook_flips_as_it_lands_is_refused(store, monkeypatch, overlap):
    """The test hook flips the first byte of a rank's first piece as it is fed, before
    its chunk is hashed: with chunks far smaller than a piece, a flip after the hashing
    would pass unseen."""
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", 64)
    monkeypatch.setenv(weight_digest.TEST_CORRUPT_ENV, "0:4:1")  # generator 0, version 4, trainer rank 1
    g = torch.Generator().manual_seed(1)
    senders = [[torch.randn(100, generator=g)], [torch.randn(500, generator=g), torch.randn(9, generator=g).half()]]
    sent = [digest(runs) for runs in senders]
    check = DigestCheck(signed(store, "generator/0"), 0, wait_s=5.0, overlap=overlap)
    for version in (4, 5):
        for rank, hexdigest in enumerate(sent):
            signed(store, f"trainer/{rank}").put(names.weight_digest_key(version, rank),
                                                 {"version": version, "rank": rank, "ranks": 2, "digest": hexdigest})
        staged = [[t.clone() for t in runs] for runs in senders]
        arriving = check.start(version, [[t.dtype for t in runs] for runs in staged])
        for rank, runs in enumerate(staged):
            for k, run in enumerate(runs):
                for piece in _cuts(run, g):
                    arriving.feed(rank, k, [piece])
        if version == 4:
            assert not arriving.taken() and check.refused == {1: "mismatch"}
            flipped, before = staged[1][0].view(torch.uint8), senders[1][0].view(torch.uint8)
            assert torch.equal(flipped[:4], ~before[:4])  # its first element's bytes, in place
            assert torch.equal(flipped[4:], before[4:]) and torch.equal(staged[0][0], senders[0][0])
        else:  # the hook alters that version only
            assert arriving.taken()
    assert check.metrics() == {"security/weight_digest/mismatch": 1.0}


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def test_a_generator_takes_only_weights_that_match_every_ranks_signed_record(store, caplog):
    params = flattened(model_params(1))
    runs = runs_of(params)
    rank0 = ShardDigest(signed(store, "trainer/0"), params, rank=0, ranks=2)
    # A record is looked for until ``wait_s`` as a generator does (once in four full runs
    # under load a record just put read as absent with no wait at all).
    check = DigestCheck(signed(store, "generator/0"), 0, wait_s=0.5)
    theirs = [[torch.zeros(3)]]  # trainer rank 1's runs (one float run)
    with caplog.at_level(logging.ERROR, logger="llamarl"):
        assert not check(1, [runs, theirs])  # nothing published yet
        assert check.refused == {0: "no_record", 1: "no_record"}
        rank0.publish(1, digest(runs))
        signed(store, "trainer/1").put(names.weight_digest_key(1, 1), {"version": 1, "rank": 1, "ranks": 2, "digest": digest(theirs)})
        assert check(1, [runs, theirs])  # signed by trainer/1 for rank 1: taken
        altered = [[t.clone() for t in pieces] for pieces in runs]
        altered[1][0].view(torch.uint8)[0] ^= 0x80
        assert not check(1, [altered, theirs]) and check.refused == {0: "mismatch"}
        assert not check(1, [runs, [[torch.ones(3)]]]) and check.refused == {1: "mismatch"}
        # Rank 1's record written by rank 0, one copied to another version's key, and one
        # not signed with the app's secret: none is rank 1's word for version 2 / 3.
        signed(store, "trainer/0").put(names.weight_digest_key(2, 1),
                                       {"version": 2, "rank": 1, "ranks": 2, "digest": digest(theirs)})
        rank0.publish(2, digest(runs))
        assert not check(2, [runs, theirs]) and check.refused == {1: "bad_record"}
        store.set(names.weight_digest_key(3, 1), store.get(names.weight_digest_key(1, 1)))
        store.set(names.weight_digest_key(3, 0), signed(store, "trainer/0", secret=bytes(32)).seal(
            names.weight_digest_key(3, 0), {"version": 3, "rank": 0, "ranks": 2, "digest": digest(runs)}))
        assert not check(3, [runs, theirs]) and check.refused == {0: "bad_record", 1: "bad_record"}
    assert check.metrics() == {"security/weight_digest/no_record": 1.0, "security/weight_digest/mismatch": 2.0,
                               "security/weight_digest/bad_record": 2.0}
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 3, refusals  # once per reason
    assert "trainer rank 0's shard (mismatch)" in refusals[1] and "altered in flight" in refusals[1]
    assert "trainer rank 1's shard (bad_record)" in refusals[2]
    assert check.new_counts() == check.metrics() and check.new_counts() == {}  # reported once a change


def test_old_records_are_deleted_as_new_ones_are_published(store):
    rank = ShardDigest(signed(store, "trainer/1"), model_params(0), rank=1, ranks=2)
    for version in range(10):
        rank.publish(version, "d")
    kept = [v for v in range(10) if store.check([names.weight_digest_key(v, 1)])]
    assert kept == [6, 7, 8, 9]


def test_a_record_is_published_once_hashed_though_the_send_has_not_returned(store, monkeypatch):
    """A trainer rank's hashing thread publishes the record as soon as the hash is done, not
    after the send returns: a send that fails on a lost generator is resent in a new
    weight group, and a generator that received the version whole in the old group waits
    for the record before it joins the new one (waiting for the resend, it was refused as
    ``no_record`` after a regroup). Here the send never returns; the generator, done
    first, waits for the record, which comes with the hash."""
    params = flattened(model_params(2))
    hashing = threading.Event()
    whole_digest = weight_digest.digest
    monkeypatch.setattr(weight_digest, "digest", lambda runs: hashing.wait(30) and whole_digest(runs))
    rank0 = ShardDigest(signed(store, "trainer/0"), params, rank=0, ranks=1)
    pending = rank0.start(5)
    check = DigestCheck(signed(store, "generator/0"), 0, wait_s=30.0)
    assert not store.check([names.weight_digest_key(5, 0)])  # the generator will wait for it
    later = threading.Timer(0.2, hashing.set)
    later.start()
    try:
        assert check(5, [runs_of(params)]) and not check.counts
    finally:
        later.join()
    assert pending.wait() >= 0.0
    stopped = DigestCheck(signed(store, "generator/0"), 0, wait_s=60.0, should_stop=lambda: True)
    assert not stopped(6, [runs_of(params)]) and stopped.refused == {0: "no_record"}


def _wait_checked(store, version: int) -> None:
    """A trainer rank: until the generator has checked ``version``."""
    deadline = time.monotonic() + 60
    while not store.check([f"test/checked/{version}"]):
        assert time.monotonic() < deadline, f"the generator never checked version {version}"
        time.sleep(0.005)


def _received(receiver: WeightReceiver, version: int) -> tuple[int | None, int | None]:
    """The generator: once ``version`` is received (taken or refused), its newest staged
    version and what a swap applies."""
    deadline = time.monotonic() + 60
    while not [s for s in receiver.pop_stats() if s.version == version]:
        assert time.monotonic() < deadline, f"version {version} never arrived"
        time.sleep(0.005)
    return receiver.latest_version(), swap_staged(receiver)


def _refuse_an_altered_version(store, rank: int, world_size: int) -> str:
    # Chunks far smaller than a bucket: the generator hashes each as its bucket lands, so
    # the hook's flip is seen only if it comes before (both sides cut alike).
    weight_digest.CHUNK_BYTES = 1000
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=30)
    if rank == 0:
        live = flattened(model_params(0))
        sender = WeightSender(group, live, bucket_mb=BUCKET_MB)
        shard = ShardDigest(signed(store, "trainer/0"), live, rank=0, ranks=1)
        for version in (1, 2, 3):
            with torch.no_grad():
                for (_, p), (_, new) in zip(live, model_params(version)):
                    p.copy_(new)
            pending = shard.start(version)  # hashed while the weights are on the wire
            sender.send(version)
            pending.wait()
            _wait_checked(store, version)
        return "sent"
    os.environ[weight_digest.TEST_CORRUPT_ENV] = "0:2,5:3"  # generator 0, version 2 (and another's)
    live = flattened(model_params(0, seed=7))
    check = DigestCheck(signed(store, "generator/0"), 0, wait_s=30.0)
    receiver = WeightReceiver(group, live, bucket_mb=BUCKET_MB, verify=check)
    receiver.start_background()
    outcome = []
    for version in (1, 2, 3):
        outcome.append(_received(receiver, version))
        _assert_same(live, model_params(1 if version == 2 else version))  # 2 refused: 1 kept
        store.set(f"test/checked/{version}", "1")
    receiver.stop_background()
    assert check.metrics() == {"security/weight_digest/mismatch": 1.0} and check.refused == {0: "mismatch"}
    return repr(outcome)


@pytest.mark.integration
def test_a_generator_refuses_a_version_altered_in_flight_and_keeps_its_own(store):
    results = dict(run_roles(_refuse_an_altered_version, 2, store.port, 120))
    assert results[0] == "sent", results
    # Version 2 (altered) is never staged nor applied; version 3 is.
    assert results[1] == repr([(1, 1), (1, None), (3, 3)]), results


def _tamper_one_shard(store, index: int, world_size: int, tampered: int) -> str:
    """Processes 0..N-1: FSDP2 trainer ranks, each with a weight group of its own to the
    generator (process N). Version 2: rank ``tampered`` signs its shard's digest, then
    sends other bytes (one value changed: what an attacker on its group's wire does)."""
    from test_sharded_weight_sync import ShardedModel, _publish_full_state, _train_step, _trainer_model

    ranks = world_size - 1
    torch.set_num_threads(1)
    if index < ranks:
        model = _trainer_model(store, index, ranks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        params = list(model.named_parameters())
        group = init_weight_group(signed(store, f"trainer/{index}"), 0, 2, torch.device("cpu"), timeout_s=60,
                                  prefix=f"test/w/{index}")
        sender = WeightSender(group, params, rank=index, ranks=ranks)
        shard = ShardDigest(signed(store, f"trainer/{index}"), params, rank=index, ranks=ranks)
        for version in (1, 2, 3):
            _train_step(model, optimizer, version)
            _publish_full_state(store, model, version, index)
            if version == 2 and index == tampered:
                shard.now(version)  # the digest of the true shard...
                local = next(p.to_local() for _, p in params if p.to_local().numel())
                with torch.no_grad():
                    local.view(-1)[0] += 1.0  # ...and other bytes on the wire
                    sender.send(version)
                    local.view(-1)[0] -= 1.0
            else:
                pending = shard.start(version)
                sender.send(version)
                pending.wait()
            _wait_checked(store, version)
        torch.distributed.destroy_process_group()
        return "sent"
    model = ShardedModel(seed=100)
    flatten_parameters_(model)
    live = list(model.named_parameters())
    check = DigestCheck(signed(store, "generator/0"), 0, wait_s=60.0)
    groups = (init_weight_group(signed(store, "generator/0"), 1, 2, torch.device("cpu"), timeout_s=60, prefix=f"test/w/{r}")
              for r in range(ranks))
    receiver = WeightReceiver(groups, live, verify=check)
    receiver.start_background()
    outcome = []
    for version in (1, 2, 3):
        outcome.append(_received(receiver, version))
        shown = 1 if version == 2 else version  # 2 refused: 1 kept
        for name, p in live:
            assert p.detach().contiguous().view(torch.uint8).numpy().tobytes() == store.get(
                f"test/full/{shown}/{name}"), (version, name)
        if version == 2:
            outcome.append(dict(check.refused))
        store.set(f"test/checked/{version}", "1")
    receiver.stop_background()
    outcome.append(check.metrics())
    return repr(outcome)


@pytest.mark.integration
@pytest.mark.parametrize("ranks, tampered", [(2, 0), (3, 2)])  # 3: uneven shards, rank 2's the smallest
def test_a_shard_sent_other_than_signed_is_refused_naming_its_trainer_rank(store, ranks, tampered):
    results = dict(run_roles(_tamper_one_shard, ranks + 1, store.port, 180, tampered))
    assert all(results[r] == "sent" for r in range(ranks)), results
    assert results[ranks] == repr([(1, 1), (1, None), {tampered: "mismatch"}, (3, 3),
                                   {"security/weight_digest/mismatch": 1.0}]), results


@pytest.mark.gpu
def test_a_cuda_run_has_the_digest_of_its_host_copy(monkeypatch):
    """On CUDA each chunk is copied to the host to be hashed: the digest is the bytes',
    wherever they live (a generator on GPU checks a trainer on GPU, or on CPU)."""
    monkeypatch.setattr(weight_digest, "CHUNK_BYTES", 1 << 20)
    runs = [torch.randn(3_000_000, device="cuda"), torch.randn(70_000, device="cuda").bfloat16()]
    assert digest(runs) == digest([r.cpu() for r in runs])
    assert digest([[r[:12345], r[12345:]] for r in runs]) == digest(runs)  # pieces on the GPU
