"""Sharded weight sync, in real gloo processes on loopback: N trainer ranks (real FSDP2
``fully_shard`` on CPU for N > 1, each rank's shards then moved into one flat buffer per
dtype as the trainer's are; the plain flattened model for 1) each send their own
shard straight to every generator through the elastic weight plane; the generators'
weights equal the trainer's full state dict bit for bit. N = 3 gives uneven shards and
a rank with no rows of some parameters; with N = 2 a lost generator is regrouped out and
a restarted one rejoins, and a layout mismatch fails every rank clearly."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llamarl.app.control.transport import connect_store
from llamarl.app.rl import sharding
from llamarl.app.weights.epochs import elastic_sender
from llamarl.app.weights.group import WeightLayoutError, WeightSyncError
from llamarl.app.weights.layout import flatten_parameters_
from role_processes import forkserver_context, loopback_store, signed, subscribed, wait_until

pytestmark = pytest.mark.integration

DIED, RESTARTED, V2_SENT, DONE = "test/died", "test/restarted", "test/v2_sent", "test/done"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.randn(7))  # 3 ranks: rows 3, 3, 1
        self.proj = nn.Linear(8, 10)  # 3 ranks: rows 4, 4, 2
        self.wide = nn.Linear(96, 30, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.proj(h)).repeat(1, 10)[:, :96]
        return h + self.wide(x)[:, :8] * self.norm[:1]


class ShardedModel(nn.Module):
    """Llama-like parts with awkward row counts: 2 embedding rows (3 ranks: 1, 1, none),
    and a float64 head in a module of its own (FSDP2 gathers one dtype per group). The
    table's part (1.07 MB with 2 ranks) is packed with the rest: every part under a
    bucket is (``DEFAULT_ALONE_MB``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(2, 8)
        self.table = nn.Embedding(2200, 256)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 5, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.table(ids)[:, :8]
        for layer in self.layers:
            h = layer(h)
        return self.head(h.double())


def _trainer_model(store, rank: int, ranks: int) -> nn.Module:
    """The trainer's model: flattened for one rank (as llamarl.app.roles.trainer), FSDP2 for
    several, each rank's shards in one buffer per dtype (``sharding.flatten_shards_``)."""
    model = ShardedModel(seed=0)
    if ranks == 1:
        flatten_parameters_(model)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.PrefixStore("test/trainer_group", store), rank=rank,
                            world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    for module in (*model.layers, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharding.flatten_shards_(model)
    return model


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.tensor([[0, 1], [1, 1]]) if step % 2 else torch.tensor([[1, 0], [0, 0]])
    optimizer.zero_grad()
    model(ids.reshape(-1)).square().mean().backward()
    optimizer.step()


def _publish_full_state(store, model: nn.Module, version: int, rank: int) -> None:
    """Every rank (``full_tensor`` is a collective); rank 0 publishes the raw bytes."""
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if rank == 0:
            store.set(f"test/full/{version}/{name}", full.detach().contiguous().view(torch.uint8).numpy().tobytes())


def _trainer(store, rank: int, ranks: int, generators: int, versions: int, lose_generator: bool) -> str:
    """``lose_generator``: generator 1 dies after version 1, version 2 goes to the
    survivor, a restarted generator 1 rejoins for version 3."""
    model = _trainer_model(store, rank, ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    # llamarl.app.control.membership's part, played by the test: gone from its death until its restart.
    gone = lambda: {"generator/1"} if store.check([DIED]) and not store.check([RESTARTED]) else set()  # noqa: E731
    sender = elastic_sender(signed(store, f"trainer/{rank}"), list(model.named_parameters()), rank=rank, ranks=ranks,
                            num_generators=generators, timeout_s=30.0, gone=gone if rank == 0 else None,
                            should_stop=lambda: False)
    sender.start()
    sizes = []
    for version in range(1, versions + 1):
        _train_step(model, optimizer, version)
        _publish_full_state(store, model, version, rank)
        if lose_generator and version == 2:
            wait_until(lambda: store.check([DIED]), "generator 1 to die")
        if lose_generator and version == 3 and rank == 0:
            store.set(V2_SENT, "1")
            wait_until(lambda: 1 in sender.joiners(), "the restarted generator 1 to ask to join")
        sizes.append(sender.send(version).bytes)
        acks = [f"test/applied/{g}/{version}" for g in range(generators)
                if not (lose_generator and g == 1 and version == 2)]
        wait_until(lambda: store.check(acks), f"generators to apply version {version}")
    if rank == 0:
        store.set(DONE, "1")
    out = f"sent {versions} versions, {sizes[0]} bytes each"
    inner = sender._sender
    # One broadcast per dtype (float32, the float64 head), the shards' flat buffer sent as it
    # is; but the last rank's rows of the odd row counts are fewer than the others', and
    # FSDP2's padding after them leaves gaps in its buffer: its parts are packed.
    expected = (2, 0) if ranks > 1 and rank == ranks - 1 else (2, 2)
    assert (inner.broadcasts, inner.zero_copy_buckets) == expected, (inner.broadcasts, inner.zero_copy_buckets)
    if rank == 0:
        out += f"; epoch {sender.epoch} generators {sender.roster} regroups {sender.regroups}"
    if ranks > 1:
        dist.destroy_process_group()
    return out


def _generator(store, replica: int, versions: list[int], die_after: int | None = None) -> str:
    model = ShardedModel(seed=100 + replica)  # other weights than the trainer's
    applied = []
    with subscribed(store, replica, model) as subscriber:
        params = list(model.named_parameters())
        for version in versions:
            def newest() -> bool:
                if (v := subscriber.swap_into(model)) is not None:
                    applied.append(v)
                return applied[-1:] == [version]

            wait_until(newest, f"generator {replica} to apply version {version}")
            for name, p in params:
                expected = store.get(f"test/full/{version}/{name}")
                assert p.detach().contiguous().view(torch.uint8).numpy().tobytes() == expected, (version, name)
            store.set(f"test/applied/{replica}/{version}", "1")
            if version == die_after:
                store.set(DIED, "1")
                os._exit(0)  # no goodbye: a killed process
    return f"applied {applied}, bit for bit"


def _entry(role: str, index: int, port: int, results, ranks: int, generators: int, versions: int,
           lose_generator: bool) -> None:
    try:
        torch.set_num_threads(1)
        store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
        if role == "trainer":
            out = _trainer(store, index, ranks, generators, versions, lose_generator)
        elif role == "restarted":
            wait_until(lambda: store.check([V2_SENT]), "version 2 to be sent")
            store.set(RESTARTED, "1")
            out = _generator(store, index, [3])
        elif lose_generator and index == 1:
            out = _generator(store, index, [1], die_after=1)
        else:
            out = _generator(store, index, list(range(1, versions + 1)))
        results.put((f"{role}/{index}", out))
    except BaseException as e:
        results.put((f"{role}/{index}", f"ERROR {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run(ranks: int, generators: int, versions: int, lose_generator: bool = False) -> dict[str, str]:
    store = loopback_store(timeout_s=120)
    ctx = forkserver_context()
    results = ctx.Queue()
    roles = [("trainer", r) for r in range(ranks)] + [("generator", g) for g in range(generators)]
    roles += [("restarted", 1)] if lose_generator else []
    procs = [ctx.Process(target=_entry, args=(role, i, store.port, results, ranks, generators, versions,
                                              lose_generator)) for role, i in roles]
    for p in procs:
        p.start()
    out: dict[str, str] = {}
    try:
        for _ in range(len(roles) - (1 if lose_generator else 0)):  # a killed generator says nothing
            who, text = results.get(timeout=240)
            out[who] = text
            if text.startswith("ERROR"):  # the others may wait for it forever: stop now
                break
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert not any(t.startswith("ERROR") for t in out.values()), "\n".join(out.values())
    return out


@pytest.mark.parametrize("generators", [1, 2])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_generators_hold_the_trainers_full_weights_bit_for_bit(ranks, generators):
    out = _run(ranks, generators, versions=2)
    for g in range(generators):
        assert out[f"generator/{g}"] == "applied [1, 2], bit for bit", out
    # Each rank sent its own part only: together the whole model once.
    shard_bytes = [int(out[f"trainer/{r}"].split(", ")[1].split()[0]) for r in range(ranks)]
    total = sum(p.numel() * p.element_size() for p in ShardedModel(seed=0).parameters())
    assert sum(shard_bytes) == total, (shard_bytes, total)
    assert f"epoch 1 generators {list(range(generators))} regroups 0" in out["trainer/0"], out


def test_a_lost_generator_is_regrouped_out_and_a_restarted_one_rejoins_with_two_trainer_ranks():
    out = _run(ranks=2, generators=2, versions=3, lose_generator=True)
    # Version 2's send fails on the dead generator; both trainer ranks resend it in
    # epoch 2, to the survivor only, which gets versions 2 and 3 bit for bit. The
    # restarted generator 1 is taken in (epoch 3) for version 3.
    assert out["generator/0"] == "applied [1, 2, 3], bit for bit", out
    assert out["restarted/1"] == "applied [3], bit for bit", out
    assert "epoch 3 generators [0, 1] regroups 2" in out["trainer/0"], out
    assert out["trainer/1"].startswith("sent 3 versions"), out


def _mismatch_entry(role: str, index: int, port: int, results) -> None:
    """Two trainer ranks (FSDP2) and one generator whose model has another shape."""
    try:
        torch.set_num_threads(1)
        store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
        if role == "trainer":
            model = _trainer_model(store, index, 2)
            sender = elastic_sender(signed(store, f"trainer/{index}"), list(model.named_parameters()), rank=index, ranks=2, num_generators=1,
                                    timeout_s=30.0, gone=set if index == 0 else None, should_stop=lambda: False)
            try:
                sender.start()
                sender.send(1)
            finally:
                dist.destroy_process_group()
            out = "no error"
        else:
            model = ShardedModel(seed=1)
            model.layers[1].norm = nn.Parameter(torch.randn(8))  # another model config
            with subscribed(store, 0, model) as subscriber:
                wait_until(lambda: subscriber.latest_version() is not None, "an error")
            out = "no error"
        results.put((f"{role}/{index}", out))
    except BaseException as e:
        results.put((f"{role}/{index}", f"ERROR {type(e).__name__}: {e}"))


def test_a_layout_mismatch_fails_every_trainer_rank_and_the_generator():
    store = loopback_store(timeout_s=120)
    ctx = forkserver_context()
    results = ctx.Queue()
    roles = [("trainer", 0), ("trainer", 1), ("generator", 0)]
    procs = [ctx.Process(target=_mismatch_entry, args=(role, i, store.port, results)) for role, i in roles]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=120) for _ in roles)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    # Rank 0 meets the generator's layout first; rank 1 is told rank 0 gave up, at once.
    assert out["trainer/0"].startswith(f"ERROR {WeightLayoutError.__name__}"), out
    assert "layers.1.norm" in out["trainer/0"] and "[7]" in out["trainer/0"], out
    assert out["trainer/1"].startswith(f"ERROR {WeightSyncError.__name__}: trainer rank 0 gave up"), out
    assert out["generator/0"].startswith(f"ERROR {WeightSyncError.__name__}"), out
    assert "layers.1.norm" in out["generator/0"], out
