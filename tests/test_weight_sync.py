"""Weight plane: trainer -> generators broadcast over gloo, in real processes on loopback."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from llamarl.app.weights.group import WeightGroup, WeightLayoutError, WeightSyncError, init_weight_group
from llamarl.app.weights.layout import flatten_parameters_
from llamarl.app.weights.receiver import WeightReceiver
from llamarl.app.weights.sender import WeightSender
from llamarl.app.weights.subscriber import swap_staged
from role_processes import forkserver_context, loopback_store, role_entry as _entry, run_roles as _run, wait_until, weight_member

pytestmark = pytest.mark.integration

BUCKET_MB = 0.01  # ~10 KB buckets: several buckets, one parameter larger than a bucket


def model_params(version: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The trainer's parameters at ``version``: mixed dtypes and shapes, non-contiguous ones."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(64, 48, generator=g) + version),  # 12 KB > one bucket
        ("layers.0.attn.wq", torch.randn(16, 16, generator=g) * version),
        ("layers.0.norm.weight", torch.full((16,), float(version))),
        ("layers.0.mlp.w_bf16", (torch.randn(32, 16, generator=g) + version).bfloat16()),
        ("layers.0.mlp.w_t", (torch.randn(16, 24, generator=g) - version).t()),  # non-contiguous
        ("rope.positions", torch.arange(10, dtype=torch.int64) + version),
        ("scale", torch.tensor(float(version))),  # 0-d
    ] + [(f"layers.{i}.mlp.w_t", (torch.randn(48, 40, generator=g) + i * version).t())
         for i in (1, 2, 3)]  # 7.5 KB each, not contiguous: one packed bucket each but the first


def flattened(params: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``params`` as a generator holds them: views of one flat buffer per dtype."""
    flatten_parameters_([p for _, p in params])
    return params


@pytest.fixture()
def store():
    return loopback_store(timeout_s=60)


# --------------------------------------------------------------------------- three versions


def _sync_three_versions(store, rank: int, world_size: int) -> str:
    """The trainer's params are separate allocations, so its float32 run is packed; generator
    1 applies each version as it arrives, the others only after the trainer is done."""
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=30)
    if rank == 0:
        live = model_params(0)
        sender = WeightSender(group, live, bucket_mb=BUCKET_MB)
        sizes = []
        for version in (1, 2, 3):
            with torch.no_grad():
                for (_, p), (_, new) in zip(live, model_params(version)):
                    p.copy_(new)
            stats = sender.send(version)
            assert stats.version == version and stats.seconds > 0
            # bf16 and int64: one tensor each, sent whole. float32: separate allocations,
            # so bucket by bucket: embed (a bucket of its own) as it is, then three packed
            # buckets (the third reuses the first packing buffer).
            assert sender.zero_copy_buckets == 3 and sender.layout.n_buckets == 6
            sizes.append(stats.bytes)
            wait_until(lambda: group.store.check([f"test/applied/{version}"]), "generator 1")
        # Reaching here proves generators 2 and 3 did not hold the trainer up: they are
        # "decoding" (sleeping) until this key appears.
        group.store.set("test/trainer_done", "1")
        nbytes = sum(p.numel() * p.element_size() for _, p in live)
        assert sizes == [nbytes] * 3 and sender.layout.n_buckets > len(sender.layout.runs)
        return "sent 1,2,3"

    live = flattened(model_params(0, seed=100 + rank))  # generators start from other weights
    receiver = WeightReceiver(group, live, bucket_mb=BUCKET_MB)
    receiver.start_background()
    applied = []
    if rank == 1:
        for version in (1, 2, 3):
            wait_until(lambda: receiver.latest_version() == version, f"version {version}")
            # Staging only: the live weights are untouched until swap_staged().
            assert not torch.equal(live[0][1], model_params(version)[0][1])
            applied.append(swap_staged(receiver))
            _assert_same(live, model_params(version))
            group.store.set(f"test/applied/{version}", "1")
    else:
        def trainer_done() -> bool:
            receiver.latest_version()  # raises if the background receiver failed
            return group.store.check(["test/trainer_done"])

        def swapped_to_3() -> bool:
            if (v := swap_staged(receiver)) is not None:
                applied.append(v)
            return applied[-1:] == [3]

        wait_until(trainer_done, "the trainer to finish")
        wait_until(swapped_to_3, "version 3 in the model")
    assert [s.version for s in receiver.pop_stats()] == [1, 2, 3]
    receiver.stop_background()
    _assert_same(live, model_params(3))
    assert swap_staged(receiver) is None  # nothing newer
    # A new epoch's receiver starts by staging the newest version again (its ``applied``
    # unset): the version the model holds already is not swapped in a second time.
    receiver.staging.applied = None
    assert swap_staged(receiver, held=3) is None and not receiver.waiting()
    assert applied == sorted(set(applied)) and applied[-1] == 3, applied
    return f"applied {applied}"


def _assert_same(live, expected) -> None:
    for (name, p), (_, q) in zip(live, expected):
        assert p.dtype == q.dtype and torch.equal(p, q), name


def test_trainer_to_three_generators_three_versions(store):
    results = _run(_sync_three_versions, 4, store.port, 120)
    assert [r for r, _ in results] == [0, 1, 2, 3]
    for rank, outcome in results:
        assert not outcome.startswith("ERROR"), f"rank {rank}: {outcome}"
    assert results[1][1] == "applied [1, 2, 3]"
    assert results[2][1].startswith("applied") and results[3][1].startswith("applied")


def test_receiver_refuses_params_that_are_not_one_flat_buffer():
    # Checked before the group is used: this group has no backend and no store.
    group = WeightGroup(backend=None, store=None, rank=1, world_size=2,
                        device=torch.device("cpu"), timeout_s=1)
    with pytest.raises(ValueError, match="flatten_parameters_"):
        WeightReceiver(group, model_params(0))


# --------------------------------------------------------------------------- failures


def _mismatched_layout(store, rank: int, world_size: int) -> str:
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=20)
    params = model_params(0)
    if rank == 0:
        WeightSender(group, params, bucket_mb=BUCKET_MB)
        return "no error"
    params[1] = ("layers.0.attn.wq", torch.zeros(16, 8))  # a different model config
    WeightReceiver(group, flattened(params), bucket_mb=BUCKET_MB)
    return "no error"


def test_layout_mismatch_fails_clearly_on_both_sides(store):
    results = dict(_run(_mismatched_layout, 2, store.port, 90))
    for rank in (0, 1):
        assert results[rank].startswith(f"ERROR {WeightLayoutError.__name__}"), results[rank]
        assert "layers.0.attn.wq" in results[rank] and "[16, 16]" in results[rank]
    assert "generator rank 1" in results[0] and "trainer" in results[1]


def _receiver_dies(store, rank: int, world_size: int) -> str:
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=5)
    params = model_params(0)
    if rank == 0:
        sender = WeightSender(group, params, bucket_mb=BUCKET_MB)
        sender.send(1)
        wait_until(lambda: group.store.check(["test/rank2_gone"]), "rank 2 to go")
        t0 = time.monotonic()
        try:
            sender.send(2)
        except WeightSyncError as e:
            return f"raised after {time.monotonic() - t0:.1f}s: {e}"
        return "no error"
    receiver = WeightReceiver(group, flattened(params), bucket_mb=BUCKET_MB)
    receiver.start_background()
    wait_until(lambda: receiver.latest_version() == 1, "version 1")
    if rank == 2:
        group.store.set("test/rank2_gone", "1")
        os._exit(0)  # dies without a word; its result never arrives
    try:
        # rank 1 may get version 2 whole: the trainer can send to it before noticing rank 2
        wait_until(lambda: receiver.latest_version() == 2, "version 2 or an error")
    except WeightSyncError as e:
        return f"receiver raised: {e}"
    receiver.stop_background()
    return "no error"


def test_sender_errors_instead_of_hanging_when_a_receiver_died(store):
    ctx = forkserver_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(_receiver_dies, r, 3, store.port, results))
             for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=90) for _ in range(2))  # rank 2 says nothing
    for p in procs:
        p.join(30)
    assert got[0].startswith("raised after"), got[0]
    assert "weight sync of version 2" in got[0]
    assert got[1].startswith("receiver raised") or got[1] == "no error"


# --------------------------------------------------------------------------- flattened models


class TinyLM(nn.Module):
    """Tied input/output embeddings (one Parameter in two modules) and a second dtype."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 16)  # 3.2 KB: larger than one test bucket
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        h_BTD = torch.relu(self.proj(self.norm(self.embed(ids_BT))))
        return self.head(h_BTD) / self.temperature.float()


def _train_step(model: TinyLM, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids_BT = torch.arange(12).reshape(2, 6) * (step + 1) % 50
    loss = nn.functional.cross_entropy(model(ids_BT).flatten(0, 1), ids_BT.roll(1).flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _views_of(model: nn.Module, flats: list[torch.Tensor]) -> bool:
    ptrs = {f.dtype: f.untyped_storage().data_ptr() for f in flats}
    return all(p.untyped_storage().data_ptr() == ptrs[p.dtype] for p in model.parameters())


def test_flatten_parameters_keeps_values_ties_and_views_through_optimizer_steps():
    model = TinyLM(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids_BT = torch.arange(12).reshape(2, 6)
    logits_before = model(ids_BT).detach()

    flats = flatten_parameters_(model)

    assert sorted(str(f.dtype) for f in flats) == ["torch.float32", "torch.float64"]
    assert model.head.weight is model.embed.weight  # the tie is one object, flattened once
    float_numel = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    assert next(f for f in flats if f.dtype == torch.float32).numel() == float_numel
    assert _views_of(model, flats)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert torch.equal(model(ids_BT).detach(), logits_before)

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(2):
        _train_step(model, optimizer, step)
    assert _views_of(model, flats)  # AdamW updated the views in place
    flat32 = next(f for f in flats if f.dtype == torch.float32)
    offset = 0
    for n, p in model.named_parameters():
        if p.dtype == torch.float32:
            assert torch.equal(flat32[offset:offset + p.numel()], p.detach().reshape(-1)), n
            offset += p.numel()
    assert not torch.equal(model.embed.weight, before["embed.weight"])


def _sync_flattened_training(store, rank: int, world_size: int) -> str:
    """Version 1: initial weights; 2: after an AdamW step; 3: one parameter rebound elsewhere."""
    torch.set_num_threads(1)  # the generator replays the trainer's steps bit for bit
    group = init_weight_group(weight_member(store, rank), rank, world_size, torch.device("cpu"), timeout_s=30)

    def trainer_states():
        model = TinyLM(seed=0)
        flatten_parameters_(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        yield model
        _train_step(model, optimizer, 0)
        yield model
        model.proj.bias.data = model.proj.bias.detach() + 1  # no longer a view: packed
        yield model

    if rank == 0:
        zero_copy = []
        for version, model in enumerate(trainer_states(), start=1):
            if version == 1:
                sender = WeightSender(group, list(model.named_parameters()), bucket_mb=0.002)
            sender.send(version)
            zero_copy.append(sender.zero_copy_buckets)
            acks = [f"test/applied/{r}/{version}" for r in range(1, world_size)]
            wait_until(lambda: group.store.check(acks), f"generators to apply {version}")
        # version 3: the float32 run is no longer one buffer, so it goes bucket by bucket,
        # and the bucket holding proj.bias is packed; embed's bucket and float64 need no copy
        n = sender.layout.n_buckets
        assert n > 2 and zero_copy == [n, n, n - 1], (zero_copy, n)
        return "sent 1,2,3"

    live = TinyLM(seed=rank)  # generators start from other weights
    flats = flatten_parameters_(live)
    receiver = WeightReceiver(group, list(live.named_parameters()), bucket_mb=0.002)
    receiver.start_background()
    for version, expected in enumerate(trainer_states(), start=1):
        wait_until(lambda: swap_staged(receiver) == version, f"version {version}")
        assert _views_of(live, flats)  # the swap copied into the flat buffers in place
        for (name, p), (_, q) in zip(live.named_parameters(), expected.named_parameters()):
            assert torch.equal(p, q), f"version {version}: {name}"
        assert live.head.weight is live.embed.weight
        group.store.set(f"test/applied/{rank}/{version}", "1")
    receiver.stop_background()
    return "received 1,2,3"


def test_flattened_trainer_syncs_zero_copy_and_carries_optimizer_updates(store):
    results = _run(_sync_flattened_training, 3, store.port, 120)
    assert results == [(0, "sent 1,2,3"), (1, "received 1,2,3"), (2, "received 1,2,3")], results
