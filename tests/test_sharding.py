"""The FSDP2 trainer (llamarl.app.rl.sharding) in real gloo processes on loopback: a step on 2 ranks
is the step one process takes on the same rollouts, whatever each rank's share; the
training state saves sharded and resumes.

Tolerance: the sharded step adds the same per-rollout terms as one process, in another
order (each rank's micro-batches are other subsets, padded to other lengths, and the
ranks' gradients meet in a reduce-scatter), so float32 rounding differs: relative 1e-5
on losses, gradients and parameters is ~100 float32 ulps, far below any real
difference (a rollout counted twice, a wrong normaliser or an averaged instead of summed
gradient change them by 10% or more).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from llamarl.app.rl import step as rl
from llamarl.app.rl import sharding
from llamarl.app.state import train_state
from llamarl.app.rl.contract import GroupId
from tiny_models import PAD, VOCAB, tiny_llama
from role_processes import loopback_store, run_roles

GROUP = 4
TOL = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.integration


def _model():
    return tiny_llama()


def _groups(n: int, seed: int = 0) -> list[list[rl.Rollout]]:
    """``n`` groups of ``GROUP`` rollouts: prompts of 2..5 tokens, completions of 1..7,
    made-up behaviour log-probs, versions 0 and 1 in turn; group 1 has equal rewards
    (advantage 0: not passed)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(n):
        prompt = torch.randint(3, VOCAB, (2 + k % 4,), generator=g).tolist()
        rollouts = []
        for i in range(GROUP):
            c = 1 + (k * 5 + i * 3) % 7
            rollouts.append(rl.Rollout(
                prompt_ids=prompt, completion_ids=torch.randint(3, VOCAB, (c,), generator=g).tolist(),
                behaviour_logprobs=(-torch.rand(c, generator=g) * 2 - 3).tolist(), version=k % 2,
                group_id=GroupId(0, k), advantage=0.0 if k == 1 else float(i % 3) - 0.9))
        groups.append(rollouts)
    return groups


# Each rank's share of 6 groups, as group indices.
SHARES = {
    "even": [[0, 1, 2], [3, 4, 5]],
    "uneven": [[0, 2, 3, 4, 5], [1]],  # rank 1: one group, all advantages 0 (nothing to pass)
    "empty_rank": [[0, 1, 2, 3, 4, 5], []],
}
CFG = rl.StepConfig(micro_batch=3, max_grad_norm=0.5)
CASES = [(share, "packed") for share in sorted(SHARES)] + [("uneven", "padded")]


def _sharded_step(store, rank: int, world_size: int, share: str, trainer_pass: str, out: str) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model = _model()
        full = copy.deepcopy(model) if rank == 0 else None
        total = sum(p.numel() for p in model.parameters())
        said = sharding.shard(model)  # what trainer rank 0 logs once
        local = sum(p.to_local().numel() for p in model.parameters())
        assert 0 < local < total and f"over {world_size} ranks on cpu" in said, said
        assert f" of {total:,} parameters, kept in float32 (no FSDP mixed precision" in said, said
        shares = said.split(" hold ")[1].split(" of ")[0].split(", ")  # every rank's, the same on each
        assert len(shares) == world_size and shares[rank].startswith(f"{local:,} ("), said
        # SGD: the update is the gradient itself, so the parameters compare the gradients.
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        groups = _groups(6)
        mine = [r for k in SHARES[share][rank] for r in groups[k]]
        cfg = dataclasses.replace(CFG, trainer_pass=trainer_pass)
        m = rl.train_step(model, optimizer, mine, cfg, pad_id=PAD, ranks=sharding.Ranks(), policy_version=1)
        sharding.gather_full_weights(model, None if full is None else list(full.parameters()))
        if rank == 0:
            torch.save({**{n: p.detach() for n, p in full.named_parameters()},
                        "metrics": torch.tensor([m[k] for k in sorted(m)], dtype=torch.float64)}, out)
        return ",".join(sorted(m))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("share,trainer_pass", CASES)
def test_a_sharded_step_on_two_ranks_is_the_step_of_one_process(tmp_path, share, trainer_pass):
    """Packed rows run one forward pass per micro-batch, padded batches two (the prompts,
    then the completions): either way every rank runs the same passes."""
    store = loopback_store(timeout_s=60)
    out = tmp_path / "sharded.pt"
    results = run_roles(_sharded_step, 2, store.port, 180, share, trainer_pass, str(out))
    assert [r for _, r in results if r.startswith("ERROR")] == []
    keys = results[0][1].split(",")
    assert results[1][1] == results[0][1], "every rank reports the whole batch's metrics"

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    reference = rl.train_step(model, optimizer, [r for g in _groups(6) for r in g], CFG, pad_id=PAD,
                              policy_version=1)
    sharded = torch.load(out, weights_only=True)
    metrics = dict(zip(keys, sharded.pop("metrics").tolist()))
    assert sorted(reference) == keys
    assert {"mismatch/lag0/kl", "mismatch/lag1/kl"} <= set(keys)  # the mismatch of both lags, summed over ranks
    for k in keys:
        assert metrics[k] == pytest.approx(reference[k], rel=1e-5, abs=1e-6), k
    assert reference["frac_skipped"] == pytest.approx(GROUP / (6 * GROUP)), "group 1 was not passed"
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharded[name], p.detach(), **TOL, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters()))


def _no_signal_step(store, rank: int, world_size: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        model = _model()
        sharding.shard(model)
        mine = _groups(2)[1] if rank == 0 else []  # advantages all 0 on rank 0, no rollout on rank 1
        m = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), mine, CFG, pad_id=PAD,
                          ranks=sharding.Ranks(), policy_version=3)
        # The forward with no backward after it left no parameter whole (the next step's
        # gradient clipping would meet plain tensors beside DTensors).
        assert all(isinstance(p, DTensor) for p in model.parameters())
        return json.dumps({k: v for k, v in m.items() if k.startswith("mismatch/")})
    finally:
        dist.destroy_process_group()


def test_the_mismatch_is_measured_when_no_rank_has_a_rollout_to_train():
    """No rank runs the training pass; each runs one forward for the mismatch (rank 1 a
    placeholder, which counts for nothing): the figures of rank 0's rollouts alone."""
    store = loopback_store(timeout_s=60)
    results = run_roles(_no_signal_step, 2, store.port, 180)
    assert [r for _, r in results if r.startswith("ERROR")] == []
    assert results[0][1] == results[1][1]
    model = _model()
    reference = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), _groups(2)[1], CFG, pad_id=PAD,
                              policy_version=3)
    sharded = json.loads(results[0][1])
    expected = {k: v for k, v in reference.items() if k.startswith("mismatch/")}
    assert set(expected) == {f"mismatch/lag2/{s}" for s in ("ratio_mean", "ratio_max", "frac_truncated", "kl", "ess")}
    assert sharded == pytest.approx(expected, rel=1e-5)


def _no_rollouts_anywhere(store, rank: int, world_size: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        model = _model()
        sharding.shard(model)
        before = [p.to_local().clone() for p in model.parameters()]
        m = rl.train_step(model, torch.optim.AdamW(model.parameters()), [], CFG, pad_id=PAD,
                          ranks=sharding.Ranks())
        return f"{m} {all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))}"
    finally:
        dist.destroy_process_group()


def test_no_update_when_no_rank_has_a_rollout():
    """As one process skips a batch without a usable rollout (``steps.SkipGuard``): an
    optimizer step on zero gradients would still move AdamW's weights."""
    store = loopback_store(timeout_s=60)
    assert run_roles(_no_rollouts_anywhere, 2, store.port, 120) == [(0, "{} True"), (1, "{} True")]


def _in_one_buffer(model: torch.nn.Module) -> bool:
    """This rank's shards of ``model`` lie end to end in one storage, in parameter order,
    each its FSDP2 all-gather input's first elements (the tiny model's rows divide by 2:
    no padding between them)."""
    local = [p.to_local() for p in model.parameters()]
    fsdp = {id(f.sharded_param): f for m in model.modules() if isinstance(m, sharding.FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups for f in g.fsdp_params}
    gathered = [fsdp[id(p)]._sharded_param_data for p in model.parameters()]
    return (len({t.untyped_storage().data_ptr() for t in local}) == 1
            and all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(local, local[1:]))
            and all(g.data_ptr() == t.data_ptr() and g.numel() == t.numel() for g, t in zip(gathered, local)))


def _flat_and_not(store, rank: int, world_size: int) -> str:
    """Three AdamW steps on the same rollouts from the same weights, the shards moved into
    one flat buffer (``shard``'s default) and left where ``fully_shard`` put them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        groups = _groups(6, seed=rank)
        after, flat_kept = [], False
        for flat in (False, True):
            model = _model()
            sharding.shard(model, flat=flat)
            assert _in_one_buffer(model) == flat
            before = [p.to_local().clone() for p in model.parameters()]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for k in range(3):
                rl.train_step(model, optimizer, groups[2 * k] + groups[2 * k + 1], CFG, pad_id=PAD,
                              ranks=sharding.Ranks())
            after.append([p.to_local().clone() for p in model.parameters()])
            flat_kept = _in_one_buffer(model)
        moved = any(not torch.equal(a, b) for a, b in zip(before, after[1]))
        return f"{all(torch.equal(a, b) for a, b in zip(*after))} {flat_kept} {moved}"
    finally:
        dist.destroy_process_group()


def test_shards_in_one_flat_buffer_train_exactly_as_fully_shard_leaves_them():
    """``flatten_shards_`` moves each rank's shards, FSDP2's all-gather inputs with them:
    training is bit for bit the same (a step whose all-gather read the shards' old copy
    would use stale weights), and the optimizer's updates stay in the buffer."""
    store = loopback_store(timeout_s=60)
    assert run_roles(_flat_and_not, 2, store.port, 120) == [(0, "True True True"), (1, "True True True")]


def test_decoder_layers_are_the_models_own_blocks():
    model = _model()
    assert sharding.decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="declares no decoder layer class"):
        sharding.decoder_layers(torch.nn.Linear(2, 2))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """With state to save and reshard (the momentum), and linear in the gradients: Adam
    would turn a gradient that is 0 up to rounding into a full-size step of either sign,
    so one process could not be compared with the ranks within rounding."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _save_sharded_then_resume(store, rank: int, world_size: int, path: str, out: str) -> str:
    """Two FSDP2 ranks: a step, a collective save, a fresh sharded model and optimizer
    loaded from it; one more step on both must agree exactly."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        groups = _groups(4, seed=rank)
        cfg = rl.StepConfig(micro_batch=4)

        def sharded():
            model = _model()
            sharding.shard(model)
            return model, _optimizer(model)

        model, optimizer = sharded()
        rl.train_step(model, optimizer, groups[0] + groups[2], cfg, pad_id=PAD, ranks=sharding.Ranks())
        train_state.save(path, model, optimizer, {"step": 1} if rank == 0 else None)
        resumed, resumed_opt = sharded()
        train_state.load(path, resumed, resumed_opt)
        for m, o in ((model, optimizer), (resumed, resumed_opt)):
            rl.train_step(m, o, groups[3], cfg, pad_id=PAD, ranks=sharding.Ranks())
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), resumed.parameters()))
        # The load and the step wrote into the shards' flat buffer: the weight sync still
        # sends what the optimizer updates as slices of it, with no packing.
        same = same and _in_one_buffer(resumed)
        full = _model() if rank == 0 else None
        sharding.gather_full_weights(model, None if full is None else list(full.parameters()))
        if rank == 0:
            torch.save({n: p.detach() for n, p in full.named_parameters()}, out)
        return f"{same}"
    finally:
        dist.destroy_process_group()


def test_two_sharded_ranks_save_and_resume_and_one_process_reads_it(tmp_path):
    """Saved by 2 FSDP2 ranks; resumed by 2 (the next step is bit for bit the same as
    without the save); and read back whole by one process (``trainer_ranks`` may change
    at a resume: the checkpoint is resharded as it loads)."""
    store = loopback_store(timeout_s=60)
    path, out = tmp_path / "train_state", tmp_path / "after.pt"
    results = run_roles(_save_sharded_then_resume, 2, store.port, 180, str(path), str(out))
    assert results == [(0, "True"), (1, "True")]
    # One process loads the 2-rank checkpoint (the state after the first step) and takes
    # the same second step as the ranks: both ranks' rollouts, the whole batch.
    model = _model()
    optimizer = _optimizer(model)
    train_state.load(path, model, optimizer)
    rl.train_step(model, optimizer, _groups(4, seed=0)[3] + _groups(4, seed=1)[3], rl.StepConfig(micro_batch=4),
                  pad_id=PAD)
    after = torch.load(out, weights_only=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), **TOL, msg=name)
    assert Path(path / "state.json").is_file()
