"""The KV cache the sampler writes into, and the CPU memory it lives in.

A cache of ``KVBufferLayer``s is used whenever every layer of the model is plain full
attention (``new_cache`` decides: Llama, GPT-2 and most decoder-only models); the Llama
fast path and the model's own forward both write into it. Models with sliding-window or
linear-attention layers keep transformers' own ``DynamicCache`` layers.

On CPU the cache's storage is lent by ``KV_STORAGE`` (one buffer kept for the process's
lifetime) when the Llama fast path runs, which knows the storage shape up front; other
models' layers allocate their own buffers on first use.

``Prefixes`` carries keys and values from one ``sample`` call to a later one whose
prompts continue the same sequences (an episode's turns), so that it prefills only their
new tokens.

``KVBufferLayer`` subclasses transformers' ``DynamicLayer`` and relies on internals that
are not a public API (``lazy_initialization``, ``is_initialized``, how ``DynamicCache``
builds and calls its layers). Importing this module therefore checks that the installed
transformers is in the range this was tested with, ``TESTED_TRANSFORMERS``, and refuses
to run otherwise: a silent change there would corrupt samples, not crash.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The transformers versions this module was tested with; pyproject.toml's dependency
# says the same (a test keeps the two equal).
TESTED_TRANSFORMERS = ">=5.17,<5.26"


def check_transformers(version: str) -> None:
    """Raise ImportError unless transformers ``version`` is in ``TESTED_TRANSFORMERS``."""
    if not SpecifierSet(TESTED_TRANSFORMERS).contains(Version(version), prereleases=True):
        raise ImportError(
            f"llamarl's sampler needs transformers{TESTED_TRANSFORMERS} (its KV cache builds on "
            f"transformers' internal DynamicLayer), but transformers {version} is installed. "
            f"Fix: pip install 'transformers{TESTED_TRANSFORMERS}'")


check_transformers(transformers.__version__)

# After the check: outside the tested range these may be missing or behave differently.
from transformers import DynamicCache, PreTrainedModel  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402


class ReusedStorage:
    """One buffer lent to one ``sample`` call at a time, instead of fresh memory per call.

    Fresh CPU memory costs a page fault per 4 KiB on its first touch, and the KV cache of
    a batch is megabytes: on a small VM the faults alone were ~5% of a ``sample`` call.
    CUDA's caching allocator already reuses freed blocks, so only CPU buffers are kept.
    A call that finds the buffer lent out (a second thread sampling) gets fresh memory.
    The buffer grows to the largest request and is kept for the process's lifetime.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._lent = False

    @contextlib.contextmanager
    def lend(self, shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device
             ) -> Iterator[torch.Tensor | None]:
        """A tensor of ``shape`` (uninitialised), or None when ``shape`` is None."""
        if shape is None:
            yield None
            return
        numel, buf = math.prod(shape), None
        with self._lock:
            if device.type == "cpu" and not self._lent:
                if self._buf is None or self._buf.numel() < numel or self._buf.dtype != dtype:
                    self._buf = torch.empty(numel, dtype=dtype)
                buf, self._lent = self._buf, True
        try:
            yield (buf[:numel].view(shape) if buf is not None
                   else torch.empty(shape, dtype=dtype, device=device))
        finally:
            if buf is not None:
                with self._lock:
                    self._lent = False


KV_STORAGE = ReusedStorage()


class KVBufferLayer(DynamicLayer):
    """A full-attention cache layer over preallocated storage, written in place.

    Behaves like ``DynamicLayer`` for the model (``keys``/``values`` are the filled part)
    but never concatenates: ``update`` copies the new states into the next free slots.
    It holds two pairs of key/value buffers: the current one, and a spare that row
    selection (dropping finished rows, fanning a prompt out to its G samples) gathers
    into before the two swap roles: one copy per selection, no fresh memory.
    """

    is_croppable = False

    def __init__(self, capacity: int, storage: torch.Tensor | None = None) -> None:
        """``storage``, if given, is ``(2, 2, rows, kv_heads, capacity, head_dim)``:
        [current, spare] x [keys, values], used instead of fresh memory when it fits."""
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._storage = storage
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # full-row buffers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, H = key_states.shape[:2]
        st = self._storage
        if st is not None and st.shape[2] >= B and st.shape[3:] == (H, self.capacity,
                                                                     key_states.shape[-1]):
            self._pairs = [(st[0, 0], st[0, 1]), (st[1, 0], st[1, 1])]
        else:
            self._pairs = [(key_states.new_empty((B, H, self.capacity, key_states.shape[-1])),
                            value_states.new_empty((B, H, self.capacity, value_states.shape[-1])))]
        self.key_buf, self.value_buf = (buf[:B] for buf in self._pairs[0])
        self.is_initialized = True

    def allocate(self, rows: int, heads: int, head_dim: int, *, like: torch.Tensor) -> None:
        """Set up storage for ``rows`` rows ahead of ``write`` (``like``: dtype, device)."""
        self.lazy_initialization(like.new_empty((rows, heads, 0, head_dim)),
                                 like.new_empty((rows, heads, 0, head_dim)))

    def write(self, rows: slice, keys: torch.Tensor, values: torch.Tensor, *, length: int
              ) -> None:
        """A prefill's keys/values ``(n, heads, P, head_dim)`` for batch ``rows``: at
        positions 0..P-1, zeros from P to ``length`` (the longest prompt of the batch):
        those are masked, but attention multiplies them by 0, and 0 * NaN is NaN."""
        if length > self.capacity:
            raise RuntimeError(f"KV cache full: {length} positions > capacity {self.capacity}")
        P = keys.shape[-2]
        for buf, states in ((self.key_buf, keys), (self.value_buf, values)):
            buf[rows, :, :P] = states
            buf[rows, :, P:length] = 0
        self.length = length
        self.keys, self.values = self.key_buf[:, :, :length], self.value_buf[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self.key_buf[:, :, start:end] = key_states
        self.value_buf[:, :, start:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or repeat) rows ``indices``: gathered into the spare buffers (only the
        filled positions), which become the current ones."""
        if not self.is_initialized:
            return
        n, end = len(indices), self.length
        if len(self._pairs) == 1:
            self._pairs.append(tuple(torch.empty_like(buf) for buf in self._pairs[0]))
        if n > self._pairs[1][0].shape[0]:
            self._pairs[1] = tuple(buf.new_empty((n, *buf.shape[1:])) for buf in self._pairs[1])
        for old, spare in zip((self.key_buf, self.value_buf), self._pairs[1]):
            torch.index_select(old[:, :, :end], 0, indices, out=spare[:n, :, :end])
        self._pairs.reverse()
        self.key_buf, self.value_buf = (buf[:n] for buf in self._pairs[0])
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.key_buf.shape[0], device=self.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def place(self, part: KVBufferLayer, rows: torch.Tensor, *, n_rows: int, end: int) -> None:
        """Copy ``part``'s keys/values into batch rows ``rows``, right-aligned to end at
        position ``end`` (how length groups of a prefill share one left-padded layout)."""
        if not self.is_initialized:
            H, D, D_v = part.key_buf.shape[1], part.key_buf.shape[-1], part.value_buf.shape[-1]
            self.lazy_initialization(part.key_buf.new_empty((n_rows, H, 0, D)),
                                     part.value_buf.new_empty((n_rows, H, 0, D_v)))
            # Zeros, not garbage, where groups leave gaps: those positions are masked, but
            # attention still multiplies their values by 0, and 0 * NaN is NaN.
            self.key_buf[:, :, :end].zero_()
            self.value_buf[:, :, :end].zero_()
        self.key_buf[rows, :, end - part.length: end] = part.keys
        self.value_buf[rows, :, end - part.length: end] = part.values
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVBufferLayer is for sampling only")


class Prefixes:
    """Keys and values kept from one ``sample`` call's prefill for a later call whose
    prompts continue the same sequences (an episode's next turn: its earlier tokens' keys
    and values stay what they were as long as the weights do), so that call prefills
    only the tokens after them.

    The layout of one sequence's keys and values is ``(layers, 2 * kv_heads, tokens,
    head_dim)``: per layer its keys' heads, then its values' (the order of the k and v
    heads in the fast path's fused q/k/v projection). Only the Llama fast path reads and
    keeps them; any other model prefills whole prompts and keeps none.
    """

    def __init__(self, past: list[torch.Tensor | None]) -> None:
        self.past = past
        """Per prompt, the keys and values of its first tokens (fewer than the prompt's,
        computed by the same weights), or None: prefilled from its start."""
        self.kept: list[torch.Tensor | None] = [None] * len(past)
        """Set by the prefill: per prompt, the keys and values of all of its tokens (the
        next call's ``past``), or None where the path keeps none."""


def new_cache(model: PreTrainedModel, capacity: int, storage: torch.Tensor | None = None
              ) -> tuple[DynamicCache, bool]:
    """A cache for ``model`` and whether it is the preallocated kind (plain full
    attention in every layer); other models keep transformers' own layers. ``storage``:
    see ``LlamaFastPath.storage_shape``."""
    cache = DynamicCache(config=model.config)
    fast = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
    if fast:
        cache.layers = [KVBufferLayer(capacity, None if storage is None else storage[:, :, i])
                        for i in range(len(cache.layers))]
    return cache, fast
