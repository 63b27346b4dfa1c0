"""The weight plane's two calls, in real gloo processes on loopback, each role with its real
runtime: ``Publisher.publish(version)`` on the trainer ranks and ``Subscriber.swap_into(model)``
on the generators, with the signed digest on. One trainer rank to two quantized generators
(int8, or bf16 without a quantized engine), one of them handed a version altered in flight;
and two FSDP2 trainer ranks to one generator."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from llamarl.app import names
from llamarl.app.control.runtime import Runtime
from llamarl.app.metrics import events as metrics
from llamarl.app.sampling import quantize_
from llamarl.app.sampling.kernels import int8_engine
from llamarl.app.weights.digest import TEST_CORRUPT_ENV
from llamarl.app.weights.layout import flatten_parameters_
from llamarl.app.weights.publisher import Publisher
from llamarl.app.weights.subscriber import Subscriber, _abandon_when
from role_processes import TEST_SECRET, loopback_store, run_roles
from test_sharded_weight_sync import ShardedModel, _publish_full_state, _train_step, _trainer_model

pytestmark = pytest.mark.integration

PRECISION = "int8" if int8_engine() is not None else "bf16"
VERSIONS = (1, 2, 3)
REFUSED = 2
"""Generator 1 receives this version altered in flight (the digest's test hook)."""
IDS = torch.tensor([[5, 9, 3, 7, 11, 2]])


def _wait(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def policy_at(version: int) -> LlamaForCausalLM:
    """The trainer's policy at ``version``: one base model, moved by a noise of its own per version."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * (version + 10) + i)))
    return model


@functools.lru_cache
@torch.no_grad()
def quantized_logits(version: int) -> torch.Tensor:
    """What a generator at ``PRECISION`` with the weights of ``version`` computes."""
    model = policy_at(version)
    quantize_(model, PRECISION).refresh()
    return model(IDS).logits


def _trainer(store) -> str:
    with Runtime.join("trainer", 0, store, TEST_SECRET) as rt:
        model = policy_at(0)
        flatten_parameters_(model)  # as the one-rank trainer does
        timeline = metrics.Timeline("trainer", 0)
        publisher = Publisher(rt, list(model.named_parameters()), rank=0, ranks=1, num_generators=2, timeout_s=30.0,
                              digest=True, gone=set, timeline=timeline)
        publisher.start()
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for version in VERSIONS:
            with torch.no_grad():
                for p, new in zip(model.parameters(), policy_at(version).parameters()):
                    p.copy_(new)
            stats = publisher.publish(version)
            assert (stats.version, stats.bytes) == (version, nbytes), stats
            assert stats.hashed_s is not None and stats.digest_wait_s is not None, stats
            assert rt.control.version() == version  # the version record, published by the same call
            record = rt.signed.get(names.weight_digest_key(version, 0), writers=("trainer/0",))
            assert record["version"] == version and len(record["digest"]) == 64, record
            _wait(lambda: store.check([f"test/ack/{g}/{version}" for g in (0, 1)]), f"the generators at {version}")
        store.set("test/done", "1")
        events = rt.take_metrics()
        syncs = [(e["version"], e["receiver"], e["bytes"]) for e in events if e["type"] == "weight_sync"]
        assert syncs == [(v, "trainer/0", nbytes) for v in VERSIONS], syncs
        digest_s = [(e["name"], e["step"]) for e in events if e["type"] == "scalar"]
        assert digest_s == [(n, v) for v in VERSIONS for n in (names.WEIGHT_DIGEST_S, names.WEIGHT_DIGEST_WAIT_S)]
        assert [e["what"] for e in timeline.drain()] == ["weight_sync", "weight_digest"] * len(VERSIONS)
        assert publisher.regroups == 0
        return f"published {list(VERSIONS)}"


def _generator(store, replica: int) -> str:
    if replica == 1:
        os.environ[TEST_CORRUPT_ENV] = f"1:{REFUSED}"
    with Runtime.join("generator", replica, store, TEST_SECRET) as rt:
        model = policy_at(-1)  # other weights than any version's
        timeline = metrics.Timeline("generator", replica)
        subscriber = Subscriber(rt, model, precision=PRECISION, timeout_s=30.0, digest=True, timeline=timeline)
        with pytest.raises(ValueError, match="the model it was built for"):
            subscriber.swap_into(policy_at(-1))
        subscriber.start()
        swapped = []
        try:
            for version in VERSIONS:
                if replica == 1 and version == REFUSED:
                    mismatch = names.weight_digest_metric("mismatch")
                    _wait(lambda: subscriber.digest_metrics().get(mismatch) == 1.0, "the altered version's refusal")
                    assert not subscriber.waiting() and subscriber.swap_into(model) is None
                    assert subscriber.latest_version() == swapped[-1]
                else:
                    _wait(subscriber.waiting, f"version {version} to be staged")
                    swapped.append(subscriber.swap_into(model))
                    assert swapped[-1] == version and subscriber.swap_into(model) is None
                with torch.no_grad():
                    logits = model(IDS).logits
                # Swapped in and quantized again from the new weights: the model computes
                # what a model built at that version does; kernels of the weights before differ.
                torch.testing.assert_close(logits, quantized_logits(swapped[-1]), rtol=1e-5, atol=1e-5)
                before = swapped[-2] if len(swapped) > 1 else -1
                assert not torch.allclose(logits, quantized_logits(before), atol=1e-3)
                store.set(f"test/ack/{replica}/{version}", "1")
            _wait(lambda: store.check(["test/done"]), "the trainer to finish")
            events = subscriber.events()
        finally:
            subscriber.close()
        syncs = [(e["version"], e["receiver"]) for e in events if e["type"] == "weight_sync"]
        assert syncs == [(v, f"generator/{replica}") for v in VERSIONS], syncs  # a refused version was received too
        quantized = [(e["name"], e["step"]) for e in events if e["type"] == "scalar"]
        assert quantized == [(names.WEIGHTS_QUANTIZE_S, v) for v in swapped], quantized
        assert [e["what"] for e in timeline.drain()] == ["quantize"] * len(swapped)
        return f"swapped {swapped}, refused {subscriber.digest_metrics()}"


def _one_trainer_two_generators(store, rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    return _trainer(store) if rank == 0 else _generator(store, rank - 1)


def test_publish_and_swap_into_carry_versions_digests_and_the_quantized_refresh():
    store = loopback_store(timeout_s=120)
    out = run_roles(_one_trainer_two_generators, 3, store.port, 240.0)
    assert [text for _, text in out] == [
        f"published {list(VERSIONS)}",
        f"swapped {list(VERSIONS)}, refused {{}}",
        f"swapped {[v for v in VERSIONS if v != REFUSED]}, refused "
        f"{{'{names.weight_digest_metric('mismatch')}': 1.0}}",
    ], out


def _sharded(store, rank: int, world_size: int) -> str:
    """Trainer ranks 0 and 1 (FSDP2) publish versions 1 and 2; rank 2 is generator 0."""
    torch.set_num_threads(1)
    if rank == 2:
        with Runtime.join("generator", 0, store, TEST_SECRET) as rt:
            model = ShardedModel(seed=100)
            subscriber = Subscriber(rt, model, precision="fp32", timeout_s=30.0, digest=True,
                                    timeline=metrics.Timeline("generator", 0))
            subscriber.start()
            try:
                for version in (1, 2):
                    _wait(lambda: subscriber.swap_into(model) == version, f"version {version}")
                    for name, p in model.named_parameters():
                        expected = store.get(f"test/full/{version}/{name}")
                        assert p.detach().contiguous().view(torch.uint8).numpy().tobytes() == expected, name
                    store.set(f"test/applied/{version}", "1")
                events = subscriber.events()
            finally:
                subscriber.close()
            return f"received {[(e['version'], e['receiver']) for e in events]}"
    with Runtime.join("trainer", rank, store, TEST_SECRET) as rt:
        model = _trainer_model(store, rank, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        publisher = Publisher(rt, list(model.named_parameters()), rank=rank, ranks=2, num_generators=1,
                              timeout_s=30.0, digest=True, gone=set if rank == 0 else None,
                              timeline=metrics.Timeline("trainer", rank))
        publisher.start()
        sent = []
        for version in (1, 2):
            _train_step(model, optimizer, version)
            _publish_full_state(store, model, version, rank)
            sent.append(publisher.publish(version).bytes)
            _wait(lambda: store.check([f"test/applied/{version}"]), f"the generator at {version}")
        receivers = {e["receiver"] for e in rt.take_metrics() if e["type"] == "weight_sync"}
        dist.destroy_process_group()
        return f"trainer/{rank} sent {len(sent)} versions as {receivers}, {sent[0]} bytes each"


def test_two_fsdp2_trainer_ranks_publish_their_shards_to_a_subscriber():
    store = loopback_store(timeout_s=120)
    out = dict(run_roles(_sharded, 3, store.port, 240.0))
    assert out[2] == "received [(1, 'generator/0'), (2, 'generator/0')]", out
    shard_bytes = [int(out[r].rsplit(", ", 1)[1].split()[0]) for r in (0, 1)]
    assert out[0].startswith("trainer/0 sent 2 versions as {'trainer/0'}"), out
    assert out[1].startswith("trainer/1 sent 2 versions as {'trainer/1'}"), out
    full = sum(p.numel() * p.element_size() for p in ShardedModel(seed=0).parameters())
    assert sum(shard_bytes) == full and min(shard_bytes) > 0, (shard_bytes, full)  # each its shard, no gather


def test_the_epoch_watchdog_gives_the_epoch_up_when_the_store_is_gone():
    """At a cancel the store's host dies first: the watchdog's stop check then raises
    (broken pipe). It gives the epoch's groups up and ends, with no traceback of its own."""
    def store_gone() -> bool:
        raise dist.DistNetworkError("Broken pipe")

    abandoned, received = threading.Event(), threading.Event()
    _abandon_when(abandoned, store_gone, received)
    assert abandoned.is_set()
