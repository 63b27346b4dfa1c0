"""The weight plane's parameter layout: dtype runs, buckets, flat buffers. Pure tensor code.

``llamarl.app.weights.sender`` and ``receiver`` move the bytes; this module decides where each parameter's bytes
sit in them. Parameters are grouped by dtype, in order, into *runs*: a run is every
parameter of one dtype laid end to end. A run whose parameters already lie back to back
in one storage (what ``flatten_parameters_`` makes) is sent as one view of it, with no
copy. A run that does not (parameters allocated one by one, or a trainer rank's shards
of them) goes bucket by bucket, each bucket about ``bucket_bytes`` of consecutive
parameters: a parameter of ``alone_bytes`` or more (by default a bucket's worth) is a
bucket of its own and is sent as it is when it is one contiguous tensor, the others are
packed, so packing needs a bucket or two of extra memory at most. Either way a run's bytes are the same, so the receiver stages every run
as one flat buffer and copies it into the live model in one go.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

DEFAULT_BUCKET_MB = 16.0
"""Sender and receivers must agree. Only packed runs depend on it: a run that is one
flat buffer goes out as one broadcast whatever the bucket size."""

DEFAULT_ALONE_MB = DEFAULT_BUCKET_MB
"""A parameter part of this size or more (a bucket's at most) is a bucket of its own and
goes out as it is, with no copy; smaller ones are packed (only in a run that is not one
flat buffer). Packing is a copy of the bytes on the sender; each broadcast has a fixed
cost on every member. On a quiet host fewer broadcasts won (every part below a bucket
packed), on a loaded one the copy cost more (``benchmarks/weight_sync.py --trainer-ranks``:
``sharded_packed`` against ``sharded_alone``, whose parts of 1 MB or more go as they are)."""


@dataclass(frozen=True)
class Slot:
    index: int
    """Position in the params list."""
    shape: tuple[int, ...]
    offset: int
    """Element offset inside its run."""
    numel: int


@dataclass(frozen=True)
class Span:
    """Consecutive slots of one dtype: elements ``[offset, offset + numel)`` of their run."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Run(Span):
    """Every parameter of one dtype, in params order, end to end (``offset`` 0), cut into
    buckets of about ``bucket_bytes``: the units of the packed path."""

    buckets: tuple[Span, ...] = ()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Layout:
    """The runs and buckets of ``params``, fixed once, with a fingerprint peers compare."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
                 alone_bytes: int | None = None) -> None:
        if not params:
            raise ValueError("weight sync needs at least one parameter")
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("weight sync parameter names must be unique")
        self.entries = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in params]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, p) in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        alone_bytes = bucket_bytes if alone_bytes is None else alone_bytes
        self.runs = [self._run(dtype, [(i, params[i][1]) for i in indices], bucket_bytes, alone_bytes)
                     for dtype, indices in by_dtype.items()]
        if len(self.runs) > 63:
            raise ValueError("weight sync handles at most 63 dtypes (one header bit each)")
        self.nbytes = sum(run.nbytes for run in self.runs)
        self.bucket_bytes, self.alone_bytes = bucket_bytes, alone_bytes
        blob = json.dumps({"params": self.entries, "bucket_bytes": bucket_bytes,
                           "alone_bytes": alone_bytes}).encode()
        # 63 bits so it fits a (signed) int64 header slot.
        self.fingerprint = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1

    @staticmethod
    def _run(dtype: torch.dtype, params: list[tuple[int, torch.Tensor]], bucket_bytes: int,
             alone_bytes: int) -> Run:
        cap = max(1, bucket_bytes // _itemsize(dtype))
        alone = max(1, alone_bytes // _itemsize(dtype))
        slots: list[Slot] = []
        buckets: list[Span] = []
        start = offset = bucket_offset = 0  # the open bucket: slots[start:], from bucket_offset

        def close() -> None:
            nonlocal start, bucket_offset
            if len(slots) > start:
                buckets.append(Span(dtype, tuple(slots[start:]), bucket_offset, offset - bucket_offset))
                start, bucket_offset = len(slots), offset

        for i, p in params:
            if p.numel() >= alone or offset + p.numel() - bucket_offset > cap:
                close()
            slots.append(Slot(i, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
            if p.numel() >= alone:
                close()
        close()
        return Run(dtype, tuple(slots), 0, offset, tuple(buckets))

    @property
    def n_buckets(self) -> int:
        return sum(len(run.buckets) for run in self.runs)

    def describe(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "bucket_bytes": self.bucket_bytes,
                           "alone_bytes": self.alone_bytes, "params": self.entries})


def first_difference(a: list, b: list) -> str:
    """Where two lists of ``Layout.entries`` first differ, in words."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter #{i}: {x} vs {y}"
    return f"{len(a)} parameters vs {len(b)}"


def flatten_parameters_(params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Rebind every parameter's ``.data`` to a view of one flat buffer per (device, dtype).

    Call it once, before the optimizer (and DDP) take the parameters: in-place updates
    then land in the flat buffers, which the weight sync broadcasts without packing.
    Parameters are laid out in ``named_parameters()`` order, which is also the sync
    layout's order, so each run is one slice. A parameter shared by several modules
    (tied embeddings) is one object and is flattened once, so the tie holds; tensors that
    already share storage with another one are left alone (they would lose that sharing).
    Returns the flat buffers (1-d).
    """
    tensors = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    unique: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    storages: dict[tuple[torch.device, int], int] = {}
    for t in unique:
        key = (t.device, t.untyped_storage().data_ptr())
        storages[key] = storages.get(key, 0) + 1
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in unique:
        if storages[(t.device, t.untyped_storage().data_ptr())] == 1 and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    flats = []
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
            offset = 0
            for t in group:
                view = flat[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
                offset += t.numel()
            flats.append(flat)
    return flats


def span_view(span: Span, params: Sequence[tuple[str, torch.Tensor]],
              device: torch.device) -> torch.Tensor | None:
    """The span (a run or a bucket) as one 1-d view of the storage its params share, or
    None when they do not lie there back to back in layout order. Checked on every call: a
    later ``.data`` rebinding moves a parameter out."""
    first: torch.Tensor | None = None
    base = 0
    for slot in span.slots:
        p = params[slot.index][1]
        if p.dtype != span.dtype or p.device != device:
            return None
        if slot.numel == 0:
            continue
        if first is None:
            first, base = p, p.storage_offset() - (slot.offset - span.offset)
            if base < 0:
                return None
        if (not p.is_contiguous() or p.storage_offset() != base + slot.offset - span.offset
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
    if first is None:  # nothing but empty parameters
        return None
    return torch.as_strided(first.detach(), (span.numel,), (1,), base)


def pack(bucket: Span, params: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's params into the front of ``out`` (1-d uint8, large enough); the
    packed bucket as a 1-d view of ``out`` in the bucket's dtype."""
    flat = out[:bucket.nbytes].view(bucket.dtype)
    with torch.no_grad():
        for slot in bucket.slots:
            start = slot.offset - bucket.offset
            flat[start:start + slot.numel].view(slot.shape).copy_(params[slot.index][1])
    return flat

