"""Weight plane: trainer -> generators broadcast over gloo, in real processes on loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch
from torch import nn

from app.transport import connect_store, host_store
from app.weight_sync import (
    WeightLayoutError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    flatten_parameters_,
    init_weight_group,
)

pytestmark = pytest.mark.integration

BUCKET_MB = 0.01  # ~10 KB buckets: several buckets, one parameter larger than a bucket


def model_params(version: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The trainer's parameters at ``version``: mixed dtypes, shapes and a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(64, 48, generator=g) + version),  # 12 KB > one bucket
        ("layers.0.attn.wq", torch.randn(16, 16, generator=g) * version),
        ("layers.0.norm.weight", torch.full((16,), float(version))),
        ("layers.0.mlp.w_bf16", (torch.randn(32, 16, generator=g) + version).bfloat16()),
        ("layers.0.mlp.w_t", (torch.randn(16, 24, generator=g) - version).t()),  # non-contiguous
        ("rope.positions", torch.arange(10, dtype=torch.int64) + version),
        ("scale", torch.tensor(float(version))),  # 0-d
    ]


def _run(role_fn, world_size: int, port: int, timeout_s: float, *args) -> list[tuple[int, str]]:
    """Run ``role_fn(rank, ...)`` in ``world_size`` spawned processes; their outcomes by rank."""
    ctx = _mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(role_fn, rank, world_size, port, results, *args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in procs:
            out.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return sorted(out)


def _entry(role_fn, rank, world_size, port, results, *args) -> None:
    try:
        store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
        results.put((rank, role_fn(store, rank, world_size, *args)))
    except BaseException as e:
        results.put((rank, f"ERROR {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _mp_context():
    # A forkserver that has imported torch once: each role process then starts in a
    # fraction of a second instead of importing torch again (2 cores).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "app.transport", "app.weight_sync"])
    return ctx


@pytest.fixture()
def store():
    return host_store(0, None, timeout_s=60, host="127.0.0.1")


# --------------------------------------------------------------------------- three versions


def _sync_three_versions(store, rank: int, world_size: int) -> str:
    group = init_weight_group(store, rank, world_size, torch.device("cpu"), timeout_s=30)
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
            sizes.append(stats.bytes)
        # Reaching here proves the background receivers did not hold the trainer up: their
        # generators are "decoding" (sleeping) until this key appears.
        group.store.set("test/trainer_done", "1")
        nbytes = sum(p.numel() * p.element_size() for _, p in live)
        assert sizes == [nbytes] * 3 and len(sender.layout.buckets) > 2
        return "sent 1,2,3"

    live = model_params(0, seed=100 + rank)  # generators start from different weights
    mode = {1: "foreground", 2: "background-single", 3: "background-double"}[rank]
    receiver = WeightReceiver(group, live, bucket_mb=BUCKET_MB,
                              double_buffer=mode == "background-double")
    applied = []
    if mode == "foreground":
        for version in (1, 2, 3):
            stats = receiver.recv(timeout_s=30)
            assert stats.version == version
            # Staging only: the live weights are untouched until apply().
            assert not torch.equal(live[0][1], model_params(version)[0][1])
            applied.append(receiver.apply())
            _assert_same(live, model_params(version))
    else:
        receiver.start_background()
        deadline = time.monotonic() + 30
        while not group.store.check(["test/trainer_done"]):
            receiver.latest_version()  # raises if the background receiver failed
            assert time.monotonic() < deadline, "trainer never finished sending"
            time.sleep(0.01)  # decoding, not looking at weights
        while receiver.applied_version != 3 and time.monotonic() < deadline:
            if (v := receiver.swap_if_newer()) is not None:
                applied.append(v)
            time.sleep(0.005)
        assert receiver.latest_version() == 3
        assert [s.version for s in receiver.pop_stats()] == [1, 2, 3]
        receiver.stop_background()
        _assert_same(live, model_params(3))
        assert receiver.swap_if_newer() is None  # nothing newer
    assert applied == sorted(set(applied)) and applied[-1] == 3, applied
    return f"{mode} applied {applied}"


def _assert_same(live, expected) -> None:
    for (name, p), (_, q) in zip(live, expected):
        assert p.dtype == q.dtype and torch.equal(p, q), name


def test_trainer_to_three_generators_three_versions(store):
    results = _run(_sync_three_versions, 4, store.port, 120)
    assert [r for r, _ in results] == [0, 1, 2, 3]
    for rank, outcome in results:
        assert not outcome.startswith("ERROR"), f"rank {rank}: {outcome}"
    assert results[1][1] == "foreground applied [1, 2, 3]"
    assert results[2][1].startswith("background-single applied")
    assert results[3][1].startswith("background-double applied")


# --------------------------------------------------------------------------- failures


def _mismatched_layout(store, rank: int, world_size: int) -> str:
    group = init_weight_group(store, rank, world_size, torch.device("cpu"), timeout_s=20)
    params = model_params(0)
    if rank == 0:
        WeightSender(group, params, bucket_mb=BUCKET_MB)
        return "no error"
    params[1] = ("layers.0.attn.wq", torch.zeros(16, 8))  # a different model config
    WeightReceiver(group, params, bucket_mb=BUCKET_MB)
    return "no error"


def test_layout_mismatch_fails_clearly_on_both_sides(store):
    results = dict(_run(_mismatched_layout, 2, store.port, 90))
    for rank in (0, 1):
        assert results[rank].startswith(f"ERROR {WeightLayoutError.__name__}"), results[rank]
        assert "layers.0.attn.wq" in results[rank] and "[16, 16]" in results[rank]
    assert "generator rank 1" in results[0] and "trainer" in results[1]


def _receiver_dies(store, rank: int, world_size: int) -> str:
    group = init_weight_group(store, rank, world_size, torch.device("cpu"), timeout_s=5)
    params = model_params(0)
    if rank == 0:
        sender = WeightSender(group, params, bucket_mb=BUCKET_MB)
        sender.send(1)
        while not group.store.check(["test/rank2_gone"]):
            time.sleep(0.01)
        t0 = time.monotonic()
        try:
            sender.send(2)
        except WeightSyncError as e:
            return f"raised after {time.monotonic() - t0:.1f}s: {e}"
        return "no error"
    receiver = WeightReceiver(group, params, bucket_mb=BUCKET_MB)
    receiver.recv(timeout_s=20)
    if rank == 2:
        group.store.set("test/rank2_gone", "1")
        os._exit(0)  # dies without a word; its result never arrives
    try:
        receiver.recv(timeout_s=20)
    except WeightSyncError as e:
        return f"receiver raised: {e}"
    return "no error"


def test_sender_errors_instead_of_hanging_when_a_receiver_died(store):
    ctx_timeout = 90
    ctx = _mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(_receiver_dies, r, 3, store.port, results))
             for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=ctx_timeout) for _ in range(2))  # rank 2 says nothing
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
    group = init_weight_group(store, rank, world_size, torch.device("cpu"), timeout_s=30)

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
        n = len(sender.layout.buckets)
        assert n > 2 and zero_copy[:2] == [n, n] and 0 < zero_copy[2] < n, (zero_copy, n)
        return "sent 1,2,3"

    live = TinyLM(seed=rank)  # generators start from other weights
    flats = flatten_parameters_(live)
    receiver = WeightReceiver(group, list(live.named_parameters()), bucket_mb=0.002)
    for version, expected in enumerate(trainer_states(), start=1):
        assert receiver.recv(timeout_s=30).version == version
        receiver.apply()
        assert _views_of(live, flats)  # apply copied into the flat buffers in place
        for (name, p), (_, q) in zip(live.named_parameters(), expected.named_parameters()):
            assert torch.equal(p, q), f"version {version}: {name}"
        assert live.head.weight is live.embed.weight
    return "received 1,2,3"


def test_flattened_trainer_syncs_zero_copy_and_carries_optimizer_updates(store):
    results = _run(_sync_flattened_training, 3, store.port, 120)
    assert results == [(0, "sent 1,2,3"), (1, "received 1,2,3"), (2, "received 1,2,3")], results
