"""The trainer's ranks: FSDP2 sharding of the policy, the gather path of the weight sync,
and the sums one training step needs across ranks.

One trainer rank trains the plain model. With several (torchrun's default group), the
policy is sharded with ``torch.distributed.fsdp.fully_shard``: each decoder layer is one
FSDP unit (its parameters all-gathered just before its forward and backward, its
gradients reduce-scattered just after), then the root, which holds what is left (the
embeddings, the final norm and the head). Each rank keeps 1/N of every parameter, of its
gradient and of the optimizer state.

FSDP2 issues its collectives from the forward and backward passes, so every rank must
run the same number of them: ``rl.train_step`` agrees on the number of micro-batches
across ranks first (``Ranks.max``), and a rank whose share is smaller runs zero-weight
micro-batches
(each micro-batch runs the same forward passes: one packed, or two padded).

Gradients are *summed* across ranks, not averaged (``set_gradient_divide_factor(1)``):
``rl.train_step`` weights each rank's loss by its share of the whole batch's normaliser
(all ranks' tokens or sequences, ``Ranks.sum``), so the ranks' gradients add up to the
gradient one process would take on the whole batch.

Each rank's shards then live in one flat buffer per dtype (``flatten_shards_``), in
parameter order, as the one-rank trainer's parameters do (``flatten_parameters_``): the
weight sync sends a rank's shard as slices of that buffer, with no packing copy.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules of the classes a Hugging Face model names in
    ``_no_split_modules`` (the blocks it declares must never be split across devices),
    outermost only. ``ValueError`` for a model that names none."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__ in classes and not any(_contains(outer, module) for outer in layers):
            layers.append(module)
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no decoder layer class (_no_split_modules): "
                         "cannot shard it layer by layer")
    return layers


def _contains(outer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in outer.modules())


def shard(model: nn.Module, *, flat: bool = True) -> str:
    """FSDP2 over the default process group, in place: every decoder layer, then the root,
    on the device the model is on (``--device``): FSDP2's default mesh is CUDA whenever a
    GPU exists, and would move a trainer forced onto the CPU there; then, with ``flat``,
    each rank's shards into one buffer per dtype (``flatten_shards_``). Call it before the
    optimizer takes the parameters. Returns what was done, the same on every rank, for
    rank 0 to log: the units, the ranks, each rank's share of the parameters (gathered:
    one small collective), their dtype, the mixed precision."""
    layers = decoder_layers(model)
    total = sum(p.numel() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in (*layers, model):  # each FSDP unit reduces its own gradients
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)  # summed: see the module's docstring
        # A plain SUM (no NCCL PreMulSum, which gloo lacks; scaling by 1 is then a no-op).
        unit.set_force_sum_reduction_for_comms(True)
    buffers = flatten_shards_(model) if flat else []
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([local], dtype=torch.int64, device=device))
    shares = ", ".join(f"{int(c.item()):,} ({100 * int(c.item()) / max(total, 1):.1f}%)" for c in counts)
    return (f"FSDP2: {len(layers)} decoder layers and the root sharded over {dist.get_world_size()} ranks on "
            f"{mesh.device_type}, every parameter on dim 0; ranks 0..{dist.get_world_size() - 1} hold "
            f"{shares} of {total:,} parameters, kept in {str(dtype).removeprefix('torch.')} (no FSDP mixed "
            "precision: --train-precision bf16 autocasts the forward); gradients reduce-scattered as sums; "
            + (f"each rank's shards in {len(buffers)} flat buffer(s), one per dtype" if flat
               else "each shard an allocation of its own"))


@torch.no_grad()
def flatten_shards_(model: nn.Module) -> list[torch.Tensor]:
    """Move this rank's FSDP2 shards of the sharded ``model`` into one flat buffer per
    (device, dtype), laid out in ``model.parameters()`` order; returns the buffers.

    ``fully_shard`` gives every parameter's shard an allocation of its own, so the weight
    sync would have to pack them into buckets (a copy of the rank's bytes per sync); laid
    end to end in parameter order, which is the sync layout's order, a rank's part of each
    dtype is one slice of one buffer and goes out with no copy. Each parameter's slot is
    FSDP2's padded shard (``_sharded_param_data``, what its all-gather reads), and the
    DTensor's local tensor (what the optimizer updates and the sync sends) is its first
    rows, as FSDP2 makes them: both are re-pointed at the slot together, so training is
    unchanged. A rank whose rows of a parameter are fewer than the first rank's (a row
    count the ranks do not divide) keeps FSDP2's padding after them, a gap that the sync
    packs around. FSDP2 re-points them only when a parameter's storage is replaced
    (``reset_sharded_param``: ``module.to``, a ``load_state_dict`` that assigns), which
    the trainer never does after sharding; a parameter moved out is then sent packed,
    still correctly. Call it once, after ``fully_shard`` and before the optimizer takes
    the parameters. Left alone: parameters FSDP2 does not hold, offloaded to the CPU,
    sharded on another dim, or with a tensor subclass of their own (float8)."""
    if not isinstance(model, FSDPModule):
        raise ValueError(f"flatten_shards_ needs a model sharded with fully_shard, not {type(model).__name__}")
    owners = {}  # the sharded parameter's id -> its FSDPParam
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch < 2.9: one group, singular
            for group in groups if groups is not None else [state._fsdp_param_group]:
                for fsdp_param in group.fsdp_params if group is not None else ():
                    owners[id(fsdp_param.sharded_param)] = fsdp_param
    by_buffer: dict[tuple[torch.device, torch.dtype], list] = {}
    for p in model.parameters():  # FSDP2 unsharded after a forward: none is its sharded parameter
        fsdp_param = owners.get(id(p))
        if fsdp_param is not None and _movable(fsdp_param):
            data = fsdp_param._sharded_param_data
            by_buffer.setdefault((data.device, data.dtype), []).append(fsdp_param)
    buffers = []
    for (device, dtype), fsdp_params in by_buffer.items():
        flat = torch.empty(sum(f._sharded_param_data.numel() for f in fsdp_params), dtype=dtype, device=device)
        offset = 0
        for f in fsdp_params:
            padded, local = f._sharded_param_data, f.sharded_param._local_tensor
            slot = flat[offset:offset + padded.numel()]
            slot.copy_(padded)
            f._sharded_param_data = slot
            f.sharded_param._local_tensor = slot[:local.numel()].view(local.shape)
            offset += padded.numel()
        buffers.append(flat)
    return buffers


def _movable(fsdp_param) -> bool:
    """FSDP2's layout as ``flatten_shards_`` re-points it: a plain 1-d padded shard on the
    parameter's device whose first elements are the DTensor's contiguous local rows."""
    padded = getattr(fsdp_param, "_sharded_param_data", None)
    param = getattr(fsdp_param, "sharded_param", None)
    local = getattr(param, "_local_tensor", None)
    placement = getattr(fsdp_param, "fsdp_placement", None)
    return (type(padded) is torch.Tensor and type(local) is torch.Tensor and padded.dim() == 1
            and not getattr(fsdp_param, "offload_to_cpu", False) and isinstance(placement, Shard)
            and placement.dim == 0 and local.is_contiguous() and local.device == padded.device
            and local.dtype == padded.dtype and local.numel() <= padded.numel()
            and (local.numel() == 0 or local.data_ptr() == padded.data_ptr()))


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@torch.no_grad()
def gather_full_weights(model: nn.Module, into: Sequence[torch.Tensor] | None) -> None:
    """The gather path of the weight sync: every rank all-gathers each parameter of the
    sharded ``model`` in turn (``DTensor.full_tensor()``, a collective every rank calls in
    the same order), and the rank that sends the weights copies them ``into`` its full
    copy's parameters (same order); the other ranks pass ``None``. One parameter is
    whole at a time, so the extra memory is the largest parameter, not the model."""
    params = list(model.parameters())
    if into is not None and len(into) != len(params):
        raise ValueError(f"gather into {len(into)} tensors, the model has {len(params)} parameters")
    for i, p in enumerate(params):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if into is not None:
            into[i].copy_(full)


def reshard(model: nn.Module) -> None:
    """Back to sharded parameters after a forward pass that no backward follows: FSDP2
    keeps the root's parameters whole after its forward (the backward would need them
    at once), so until then ``model.parameters()`` yields plain tensors beside the
    layers' DTensors. A model that is not sharded is left as it is."""
    if isinstance(model, FSDPModule):
        model.reshard()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class Ranks:
    """The trainer ranks of torchrun's default group, as ``rl.train_step`` sees them: sums
    and maxima of a few numbers across ranks (one small all-reduce each, on ``device``:
    the group's backend, gloo or NCCL, decides where its tensors live)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        # float64: token counts and loss sums stay exact far beyond a step's size.
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()
