"""The static shapes of ``llamarl.app.sampling.static_decode``: the device tensors every
decode step reads and writes in place, the batch buckets, and the KV capacity. A captured
CUDA graph (or a compiled step) bakes in the addresses and shapes of what it reads, so
everything here is allocated once per (rows, capacity) and updated in place.

``StaticState``: device tensors allocated once, updated in place:

- KV buffers at full capacity C (the call's longest prompt plus its new tokens, rounded
  up to ``CAPACITY_QUANTUM``), two sets: the prefill's (``LlamaFastPath.prefill`` writes
  its packed prompts there, as in the eager path) and the decode's, into which each row
  gathers its prompt (repeated prompts fan out there). Attention covers all C positions;
  an additive bias ``(rows, 1, 1, C)`` hides those not written yet and is opened one
  position per step, in place, by the step itself;
- per row: the last token, its rotary position, its output row, alive; the step counter
  and the cache slot, one-element device tensors the step increments;
- the outputs ``tokens_BT`` and ``logprobs_BT`` (one more row: where padding rows write)
  and the uniform numbers ``u_BT``, one per output row and step, drawn at the start of
  a call from the caller's generator (on the model's device): a draw does not depend
  on which bucket or batch row the row is in, and no random state lives in a graph.

Buckets (``bucket_sizes``): the call's rows, then the powers of two below it down to
``MIN_BUCKET_ROWS``. As rows finish, the batch is compacted to the smallest bucket that
holds the live rows (the next bucket down), not to their exact count: a shape per
bucket, captured once; the rows between the live count and the bucket are finished
rows riding along (their tokens past EOS are masked, as in the eager loop). Below 8
rows a GPU step costs what it costs at 8 (launch-bound), so smaller buckets would only
add captures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamarl.app.sampling.llama_fast import LlamaFastPath

MIN_BUCKET_ROWS = 8
"""The smallest batch bucket (see the module docstring)."""

CAPACITY_QUANTUM = 64
"""KV capacity is rounded up to a multiple of this many positions, so calls whose
prompts differ by a few tokens share one state and one set of graphs."""


def bucket_sizes(rows: int) -> tuple[int, ...]:
    """The batch buckets of a decoder for ``rows`` rows, largest first: ``rows``, then
    the powers of two below it down to ``MIN_BUCKET_ROWS``."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    sizes = [rows]
    size = 1 << ((rows - 1).bit_length() - 1) if rows > 1 else 0
    while size >= MIN_BUCKET_ROWS:
        sizes.append(size)
        size //= 2
    return tuple(sizes)


def bucket_for(live: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket of ``sizes`` that holds ``live`` rows."""
    fitting = [s for s in sizes if s >= live]
    if not fitting:
        raise ValueError(f"{live} rows exceed the largest bucket {sizes[0]}")
    return min(fitting)


def capacity_for(positions: int) -> int:
    """The KV capacity of a state for ``positions`` positions (``CAPACITY_QUANTUM``)."""
    return -(-positions // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


@dataclass(frozen=True)
class StepKey:
    """What a captured step bakes in besides its shapes."""

    rows: int
    temperature: float
    top_p: float
    eos_id: int


class StaticState:
    """The device tensors every step reads and writes in place (see the module docstring)."""

    def __init__(self, fast_path: LlamaFastPath, rows: int, capacity: int) -> None:
        like = fast_path.cos_LD
        L, K, D = len(fast_path.layers), fast_path.n_kv_heads, fast_path.head_dim
        self.rows, self.capacity, self.fast_path = rows, capacity, fast_path
        self.buckets = bucket_sizes(rows)
        # [prefill, decode] x [keys, values] x layers x rows x kv heads x C x D; zeros, not
        # garbage: masked positions are multiplied by 0, and 0 * NaN is NaN.
        self.kv = like.new_zeros((2, 2, L, rows, K, capacity, D))
        self.bias_RC = like.new_full((rows, capacity), float("-inf"))
        self.tok_R = torch.zeros(rows, dtype=torch.long, device=like.device)
        self.pos_R = torch.zeros_like(self.tok_R)
        self.out_row_R = torch.full_like(self.tok_R, rows)  # row `rows`: the sink
        self.alive_R = torch.zeros(rows, dtype=torch.bool, device=like.device)
        self.t_1 = torch.ones(1, dtype=torch.long, device=like.device)
        self.slot_1 = torch.zeros_like(self.t_1)
        self.tokens_BT = torch.zeros((rows + 1, capacity), dtype=torch.long, device=like.device)
        self.logprobs_BT = torch.zeros((rows + 1, capacity), dtype=torch.float32, device=like.device)
        self.u_BT = torch.zeros((rows + 1, capacity), dtype=torch.float32, device=like.device)
        # Index tensors of the KV writes (``store_kv``), made once: indices the step built
        # would be host tensors, frozen into a captured graph.
        self.pair_2 = torch.arange(2, device=like.device)  # [prefill, decode], [keys, values]
        self.layer_L = torch.arange(L, device=like.device)
        self.row_R1 = torch.arange(rows, device=like.device)[:, None]
        self.head_1K = torch.arange(K, device=like.device)[None, :]

    def ready_for_warmup_(self) -> None:
        """A state a step can run on whatever it held (a capture's warm-up steps, before
        the call sets the state up): position 0 visible, the counters at the start, and
        every row at position 0: the last call leaves rows at up to the capacity - 1,
        and a warm-up step past it would index past the rotary tables (on CUDA a
        device-side assert, which ends the process's use of the GPU)."""
        self.bias_RC.fill_(float("-inf"))
        self.bias_RC[:, 0] = 0.0
        self.t_1.fill_(1)
        self.slot_1.fill_(0)
        self.pos_R.fill_(0)

    def store_kv(self, rows: int):
        """``store(layer, k_RK1D, v_RK1D)`` for ``LlamaFastPath.decode_at``: the step's keys
        and values of the first ``rows`` rows into the decode set at ``slot_1``, by
        ``index_put_`` on ``kv`` itself, not on a view of it: compiled, an in-place write
        into a view of a graph input is functionalized into a copy of the whole input
        (the KV of every layer, per layer and step: ``sampler_compiled_cpu.json``), while
        inductor turns an ``index_put`` on the input back into the in-place scatter."""
        rows_b1, slot_11 = self.row_R1[:rows], self.slot_1[:, None]

        def store(i: int, k_bK1D: torch.Tensor, v_bK1D: torch.Tensor) -> None:
            for which, x_bK1D in ((0, k_bK1D), (1, v_bK1D)):
                self.kv.index_put_((self.pair_2[1], self.pair_2[which], self.layer_L[i], rows_b1, self.head_1K,
                                    slot_11), x_bK1D[:, :, 0])

        return store

    def decode_kv(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the decode set's keys and values of the first ``rows`` rows."""
        return [(self.kv[1, 0, i, :rows], self.kv[1, 1, i, :rows]) for i in range(self.kv.shape[2])]

    def select_rows_(self, order_N: torch.Tensor, filled: int) -> None:
        """Batch row r takes what row ``order_N[r]`` held (r < N): per-row tensors and the
        decode set's first ``filled`` positions (``filled`` includes the prompt)."""
        n = len(order_N)
        for x in (self.tok_R, self.pos_R, self.out_row_R, self.alive_R, self.bias_RC):
            x[:n] = x[order_N]
        self.kv[1, :, :, :n, :, :filled] = self.kv[1, :, :, :, :, :filled].index_select(2, order_N)
