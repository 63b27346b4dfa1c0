"""Which part of each parameter a trainer rank sends, and where it lands on a generator.

Pure tensor code, beside ``llamarl.app.weights.layout``. With several trainer ranks the trainer is
FSDP2 (``fully_shard``): every parameter is a DTensor sharded on dim 0 with
``torch.chunk``'s rule (each rank ``ceil(rows / ranks)`` rows, the last ones fewer, and
ranks past the end none). A dim-0 chunk of a contiguous tensor is one range of its
elements in row-major order, so a rank's part of a parameter is described by where that
range starts in the full parameter and how long it is; a plain tensor (one rank, or a
parameter FSDP2 left unsharded: every rank holds all of it) is rank 0's whole, the other
ranks' empty.

Each trainer rank sends its part of every parameter in its own ``Layout`` (runs and
buckets of its local tensors: slices of the flat buffer they lie in, or its small parts
packed into large buckets where they do not). A generator
stages each rank's bytes as they come, in that rank's layout; ``Landing`` maps every span
of a sender's layout to where its bytes go in the full weights (the generator's own
layout, one flat buffer per dtype): the copies its swap makes into the live model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from llamarl.app.weights.layout import Layout, Span

__all__ = ["Landing", "Shards", "check_tiling", "chunk_rows", "local_parts", "meta_params"]

def chunk_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a dim-0 chunk: ``torch.chunk``'s sizes, empty past the end."""
    size = -(-rows // ranks) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class Shards:
    """One trainer rank's part of every parameter, in params order."""

    rank: int
    ranks: int
    full_shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    """Element (row-major, in the full parameter) where this rank's part begins."""

    def describe(self) -> dict:
        return {"rank": self.rank, "ranks": self.ranks, "full_shapes": [list(s) for s in self.full_shapes],
                "starts": list(self.starts)}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def local_parts(params: Sequence[tuple[str, torch.Tensor]], rank: int,
                ranks: int) -> tuple[list[tuple[str, torch.Tensor]], Shards]:
    """This rank's part of each parameter (current local tensors: call again for each sync,
    cheap) and their ``Shards``. DTensors must be sharded on dim 0 over a 1-d mesh of
    ``ranks`` (FSDP2's layout); anything else is refused rather than sent wrong."""
    if not 0 <= rank < ranks:
        raise ValueError(f"weight sync: trainer rank {rank} of {ranks}")
    local: list[tuple[str, torch.Tensor]] = []
    shapes, starts = [], []
    for name, p in params:
        full = tuple(p.shape)
        if isinstance(p, DTensor):
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(f"weight sync: {name} is a DTensor placed {p.placements} on a "
                                 f"{p.device_mesh.ndim}-d mesh; only Shard(0) on one mesh dimension "
                                 "(FSDP2's layout) is supported")
            if p.device_mesh.size() != ranks or p.device_mesh.get_coordinate()[0] != rank:
                raise ValueError(f"weight sync: {name} is sharded over {p.device_mesh.size()} ranks "
                                 f"(this one {p.device_mesh.get_coordinate()}); the sender was told "
                                 f"rank {rank} of {ranks}")
            tensor = p.to_local().detach()
            start_row, stop_row = chunk_rows(full[0], ranks, rank)
            row = _numel(full[1:])
            if tensor.numel() != (stop_row - start_row) * row:
                raise ValueError(f"weight sync: {name}'s local shard has {tuple(tensor.shape)}, not rows "
                                 f"[{start_row}, {stop_row}) of {full} (torch.chunk's rule)")
            start = start_row * row
        else:
            tensor = p.detach() if rank == 0 else p.detach().reshape(-1)[:0]
            start = 0 if rank == 0 else p.numel()
        local.append((name, tensor))
        shapes.append(full)
        starts.append(start)
    return local, Shards(rank=rank, ranks=ranks, full_shapes=tuple(shapes), starts=tuple(starts))


def meta_params(entries: Sequence[Sequence]) -> list[tuple[str, torch.Tensor]]:
    """Storage-less stand-ins for ``Layout.entries`` ``[name, shape, dtype]``: a peer's
    layout rebuilt from its handshake document (so both sides cut the same buckets)."""
    out = []
    for name, shape, dtype in entries:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"weight sync: bad layout entry {[name, shape, dtype]}")
        out.append((str(name), torch.empty(shape, dtype=dt, device="meta")))
    return out


class Landing:
    """Where each span of a sender's layout goes in the generator's full weights (``full``'s
    runs, one flat buffer per dtype; ``sent`` cuts the same dtypes in the same order)."""

    def __init__(self, sent: Layout, shards: Shards, full: Layout) -> None:
        if [r.dtype for r in sent.runs] != [r.dtype for r in full.runs]:
            raise ValueError("weight sync: the sender's dtypes are not the generator's")
        self.full_offset: dict[int, int] = {}  # param index -> element offset in its full run
        for run in full.runs:
            for slot in run.slots:
                self.full_offset[slot.index] = slot.offset
        self.sent, self.shards = sent, shards

    def pieces(self, span: Span) -> list[tuple[int, int, int]]:
        """``(offset in the span, offset in the full run, numel)`` of each non-empty part."""
        return [(slot.offset - span.offset, self.full_offset[slot.index] + self.shards.starts[slot.index],
                 slot.numel) for slot in span.slots if slot.numel]

    def moves(self, span: Span) -> list[tuple[int, int, int]]:
        """``pieces``, with parts that follow each other on both sides merged: the copies
        that take the span's bytes from where they landed (the sender's order) into the
        full run. One for a whole run of one trainer rank; with several, about one per
        parameter part (a rank's parts of consecutive parameters lie apart)."""
        out: list[tuple[int, int, int]] = []
        for src, dst, n in self.pieces(span):
            if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((src, dst, n))
        return out


def check_tiling(senders: Sequence[tuple[Shards, Layout]], params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The senders' parts (their ``Shards`` and layouts) cover every element of every
    parameter exactly once, or ``ValueError`` naming the first parameter they do not."""
    numels = [{slot.index: slot.numel for run in layout.runs for slot in run.slots} for _, layout in senders]
    for i, (name, p) in enumerate(params):
        ranges = sorted((s.starts[i], s.starts[i] + n[i]) for (s, _), n in zip(senders, numels) if n[i])
        at = 0
        for start, stop in ranges:
            if start != at:
                break
            at = stop
        if at != p.numel():
            raise ValueError(f"weight sync: the trainer ranks' parts of {name} cover elements {ranges} "
                             f"of {p.numel()}, not each exactly once")
