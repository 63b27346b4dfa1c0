"""Batched autoregressive sampling with a KV cache, for any Hugging Face causal LM.

Returns what RL needs and ``model.generate`` does not hand out cheaply: the log-prob of
each sampled token under the distribution it was actually drawn from (after temperature
and top-p), which the trainer uses as the behaviour policy mu in AIPO.

Speed comes from doing less per step than ``generate``:

- the KV cache is preallocated (``KVBufferLayer``) and written in place, instead of
  ``DynamicCache`` concatenating every layer's keys and values at every step; on CPU its
  storage is lent from one buffer that outlives the call (``ReusedStorage``), because
  fresh memory costs a page fault per 4 KiB on first touch;
- rows that have finished (EOS) leave the batch and the cache, so a batch costs what its
  live rows cost; leaving copies the cache (into spare buffers that then swap roles), so
  it waits until a quarter of the rows are done rather than copying on every single EOS;
- for Llama-architecture models, prefill and decode run straight from the weights
  (``LlamaFastPath``): fused matmuls, norm weights and the attention scale folded into
  them, a packed prefill with no padding in any matmul, and a last layer that runs its
  MLP only for the token whose logits are wanted. This halves the per-step fixed cost
  (module calls, kwargs plumbing, masks, temporaries) that dominates small models;
- other models run their own forward with a ready 4D decode mask, and prompts of very
  different lengths are prefilled in length groups, so short prompts are not padded to
  the longest one;
- a token is drawn by inverting the CDF with one uniform number per row, not by
  ``torch.multinomial``'s one exponential per vocabulary entry;
- identical prompts (RL samples each prompt G times) are prefilled once, and their cache
  is fanned out to the G rows.

Models whose cache is not a plain full-attention one (sliding windows, linear attention)
keep HF's ``DynamicCache`` and 2D masks: slower, still correct.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

# Drop finished rows from the batch once this share of them is done (see module docstring).
COMPACT_WHEN_DONE = 0.25
# What one more prefill forward costs, in padded prompt tokens (a few ms of fixed cost):
# prompts are prefilled in length groups when that saves more padding than this.
PREFILL_CALL_COST_TOKENS = 64
# The Llama fast path prefills prompts in chunks of about this many tokens: its
# temporaries (the MLP's is 8 x tokens x intermediate bytes in fp32) then stay small
# enough for the allocator to keep and reuse rather than map and unmap on every call
# (32 prompts, 2 cores: 1600 page faults and ~15% of the prefill's time unchunked).
PREFILL_CHUNK_TOKENS = 512


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


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int = 32
    """Upper bound on generated tokens per sequence (EOS included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Samples:
    tokens_BT: torch.Tensor
    """Generated token ids, right-padded with ``pad_id`` after each sequence's end."""
    logprobs_BT: torch.Tensor
    """Log-prob of each sampled token under the sampling distribution; 0 on padding."""
    lengths_B: torch.Tensor
    """Number of generated tokens per sequence, EOS included when it was produced."""

    def completion_ids(self, i: int) -> list[int]:
        return self.tokens_BT[i, : int(self.lengths_B[i])].tolist()


def process_logits(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from (temperature, then top-p).

    Tokens outside the nucleus get -inf. Shared with the trainer so both sides agree on
    what "the behaviour distribution" means.
    """
    logits_BV = logits_BV.float()
    if temperature > 0 and temperature != 1.0:
        logits_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp_BV.sort(dim=-1, descending=True)
        # Keep a token while the mass strictly before it is below top_p (the top one always).
        mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp_BV = torch.log_softmax(logp_BV.masked_fill(drop, float("-inf")), dim=-1)
    return logp_BV


def draw(logp_BV: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``exp(logp_BV)``, by inverting the CDF at a uniform draw.

    Exact sampling, like ``torch.multinomial``, with B random numbers instead of B*V.
    Zero-probability tokens (top-p's -inf) are never drawn: the CDF is flat over them.
    """
    cdf_BV = logp_BV.exp().cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    u_B1 = torch.rand(total_B1.shape, generator=generator, device=cdf_BV.device) * total_B1
    tok_B = torch.searchsorted(cdf_BV, u_B1, right=True)
    # Rounding can make u equal the total; the last token with mass is where the CDF first
    # reaches it, so that is the most a draw may pick.
    last_B = torch.searchsorted(cdf_BV, total_B1, right=False)
    return torch.minimum(tok_B, last_B).squeeze(-1)


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


# Rotary types whose cos/sin at a position do not depend on the sequence length, so one
# table per call serves prefill and every decode step ("dynamic" and "longrope" rescale
# with the length seen so far).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def _rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (rope or {}).get("rope_type", "default")


class LlamaFastPath:
    """Prefill and decode steps of a Llama-architecture model, computed straight from its
    weights.

    At this project's model sizes HF's forward spends about as long in Python (module
    calls, kwargs plumbing, mask and output bookkeeping) and in fresh allocations as in
    arithmetic. This does the same math with fewer ops and fewer temporaries:

    - q/k/v and gate/up are one matmul each, over weights concatenated when the path is
      built (a copy for the duration of one ``sample`` call) with the norms' weights and
      the attention scale folded in; residual adds are fused into the matmuls
      (``addmm_``), SiLU and the gate product run in place;
    - rotary cos/sin are computed once per call for every position, then looked up;
    - the prefill packs the prompts (no padding in any matmul) and pads only for
      attention, right-padded so that plain causal attention needs no mask; it runs in
      chunks of prompts of similar length (``PREFILL_CHUNK_TOKENS``);
    - past the last layer's keys and values, only each prompt's last token matters, so
      the last layer's attention output, o-projection and MLP run for those tokens only;
    - decode attention is two batched matmuls with the kv heads as the batch and each kv
      head's group of query heads as the rows (GQA without repeating keys and values).

    Log-probs agree with the model's own forward to ~1e-6. It only runs for configs it
    knows (``supports``), on a cache of ``KVBufferLayer``s.
    """

    def __init__(self, model: PreTrainedModel, max_positions: int) -> None:
        cfg, body = model.config, model.model
        self.model = model
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.scaling = body.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        # Norm weights scale the inputs of the matmul that follows, and the attention
        # scale commutes with rotary: both are folded into the (copied) weights.
        E = cfg.hidden_size
        # x * rsqrt(mean(x^2) + eps) == x * rsqrt(sum(x^2) + E * eps) * sqrt(E): a sum is
        # cheaper than a mean, and sqrt(E) goes into the weights with the norm's own.
        self.eps_sum, root_E = E * self.eps, E ** 0.5
        self.layers = []
        for layer in body.layers[: cfg.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            w_qkv = torch.cat([attn.q_proj.weight * self.scaling, attn.k_proj.weight,
                               attn.v_proj.weight])
            w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.layers.append((
                (w_qkv * (layer.input_layernorm.weight * root_E)).t(),
                attn.o_proj.weight.t(),
                (w_gate_up * (layer.post_attention_layernorm.weight * root_E)).t(),
                mlp.down_proj.weight.t(),
            ))
        self.w_head = (model.lm_head.weight * (body.norm.weight * root_E)).t()
        D = self.head_dim
        weight = body.embed_tokens.weight
        positions_1L = torch.arange(max_positions, device=weight.device)[None]
        cos_1LD, sin_1LD = body.rotary_emb(weight[:1, None], positions_1L)
        self.cos_LD = cos_1LD[0].to(weight.dtype)
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        sin_LD = torch.cat([-sin_1LD[0, :, : D // 2], sin_1LD[0, :, D // 2:]], -1)
        self.sin_LD = sin_LD.to(weight.dtype)

    def storage_shape(self, rows: int, capacity: int) -> tuple[int, ...]:
        """The cache's storage for ``rows`` rows: [current, spare] x [keys, values] x
        layers x rows x kv heads x ``capacity`` positions x head dim."""
        return (2, 2, len(self.layers), rows, self.n_kv_heads, capacity, self.head_dim)

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        return (cfg.model_type == "llama" and cfg.hidden_act == "silu" and not cfg.mlp_bias
                and not cfg.attention_bias and getattr(cfg, "pretraining_tp", 1) == 1
                and getattr(model.lm_head, "bias", None) is None
                and _rope_type(cfg) in STATIC_ROPE_TYPES)

    def _norm(self, x_NE: torch.Tensor) -> torch.Tensor:
        """RMS norm without its weight (folded into the next matmul's)."""
        return x_NE * x_NE.pow(2).sum(-1, keepdim=True).add_(self.eps_sum).rsqrt_()

    def _rotary(self, pos_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_LD[pos_N, None], self.sin_LD[pos_N, None]

    def _rotate(self, qk_NXD: torch.Tensor, cos_N1D: torch.Tensor, sin_N1D: torch.Tensor
                ) -> torch.Tensor:
        return torch.addcmul(qk_NXD * cos_N1D, qk_NXD.roll(self.head_dim // 2, -1), sin_N1D)

    def _mlp_(self, h_NE: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """``h_NE += MLP(norm(h_NE))``, in place."""
        gate_up_NI = torch.mm(self._norm(h_NE), w_gate_up)
        half = gate_up_NI.shape[-1] // 2
        act_NI = F.silu(gate_up_NI[:, :half], inplace=True).mul_(gate_up_NI[:, half:])
        h_NE.addmm_(act_NI, w_down)

    def prefill(self, prompts: list[list[int]], cache: DynamicCache
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill ``cache`` with ``prompts`` (U of them, sorted by length, right-padded to
        the longest, P), in chunks of about ``PREFILL_CHUNK_TOKENS`` tokens.

        Returns the next-token logits ``(U, V)``, ``valid_UP`` (True on prompt tokens) and
        each prompt's next position ``(U, 1)``."""
        device = self.cos_LD.device
        lengths_U = torch.tensor([len(p) for p in prompts])
        if (lengths_U.diff() < 0).any():
            raise ValueError("LlamaFastPath.prefill wants prompts sorted by length")
        U, P = len(prompts), int(lengths_U.max())
        for layer in cache.layers:
            layer.allocate(U, self.n_kv_heads, self.head_dim, like=self.cos_LD)
        logits, start = [], 0
        while start < U:
            end, tokens = start, 0
            while end < U and (end == start or tokens + len(prompts[end]) <= PREFILL_CHUNK_TOKENS):
                tokens, end = tokens + len(prompts[end]), end + 1
            logits.append(self._prefill_chunk(prompts[start:end], cache, slice(start, end), P))
            start = end
        valid_UP = (torch.arange(P)[None, :] < lengths_U[:, None]).to(device)
        return torch.cat(logits), valid_UP, lengths_U[:, None].to(device)

    def _prefill_chunk(self, prompts: list[list[int]], cache: DynamicCache, rows: slice,
                       length: int) -> torch.Tensor:
        """Prefill of cache rows ``rows``: packed tokens (N) through every matmul, padded
        to this chunk's longest prompt (P) only for attention; the cache is zero-padded
        to ``length``. Logits ``(U, V)``."""
        device = self.cos_LD.device
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        U = len(prompts)
        lengths_U = torch.tensor([len(p) for p in prompts])
        P, N = int(lengths_U.max()), int(lengths_U.sum())
        starts_U = lengths_U.cumsum(0) - lengths_U
        pos_N = torch.arange(N) - starts_U.repeat_interleave(lengths_U)
        slot_N = (torch.arange(U).repeat_interleave(lengths_U) * P + pos_N).to(device)
        pos_N, last_U = pos_N.to(device), (starts_U + lengths_U - 1).to(device)

        ids_N = torch.tensor([tok for p in prompts for tok in p], device=device)
        h_NE = self.model.model.embed_tokens(ids_N)
        # Zeros where padding is: padded keys and values are attended with weight 0 only
        # after the mask, and 0 * garbage can be NaN.
        qkv_pad = h_NE.new_zeros((U * P, H + 2 * K, D))
        rotary = self._rotary(pos_N)
        for i, ((w_qkv, w_o, w_gate_up, w_down), kv) in enumerate(zip(self.layers, cache.layers)):
            qkv_NXD = torch.mm(self._norm(h_NE), w_qkv).view(N, H + 2 * K, D)
            qkv_NXD[:, : H + K] = self._rotate(qkv_NXD[:, : H + K], *rotary)
            qkv_pad[slot_N] = qkv_NXD
            qkv_UXPD = qkv_pad.view(U, P, H + 2 * K, D).transpose(1, 2)
            k_UKPD, v_UKPD = qkv_UXPD[:, H: H + K], qkv_UXPD[:, H + K:]
            kv.write(rows, k_UKPD, v_UKPD, length=length)
            if i + 1 < len(self.layers):
                o_UHPD = F.scaled_dot_product_attention(
                    qkv_UXPD[:, :H], k_UKPD, v_UKPD, is_causal=True, scale=1.0,
                    enable_gqa=H != K)
                o_NE = o_UHPD.transpose(1, 2).reshape(U * P, H * D)[slot_N]
            else:  # what follows only feeds the logits: the last token of each prompt
                h_NE = h_NE[last_U]
                valid_UP = (torch.arange(P)[None, :] < lengths_U[:, None]).to(device)
                o_NE = self._attend(qkv_NXD[last_U, :H], kv.key_buf[rows, :, :P],
                                    kv.value_buf[rows, :, :P], self.mask_bias(valid_UP))
            h_NE.addmm_(o_NE, w_o)
            self._mlp_(h_NE, w_gate_up, w_down)
        return torch.mm(self._norm(h_NE), self.w_head)

    def mask_bias(self, valid_RL: torch.Tensor) -> torch.Tensor:
        """Additive attention bias ``(R, 1, 1, L)``: 0 where valid, -inf elsewhere."""
        bias_RL = torch.zeros(valid_RL.shape, dtype=self.cos_LD.dtype, device=valid_RL.device)
        return bias_RL.masked_fill_(~valid_RL, float("-inf"))[:, None, None, :]

    def _attend(self, q_RHD: torch.Tensor, k_RKLD: torch.Tensor, v_RKLD: torch.Tensor,
                bias_R11L: torch.Tensor) -> torch.Tensor:
        """One query per row: ``(R, H*D)``; query heads grouped under their kv head."""
        R, H, D = q_RHD.shape
        K, L = k_RKLD.shape[1], k_RKLD.shape[2]
        q_NGD = q_RHD.reshape(R * K, H // K, D)  # N = R * K: one batch entry per kv head
        scores_NGL = torch.bmm(q_NGD, k_RKLD.view(R * K, L, D).transpose(1, 2))
        probs_RKGL = scores_NGL.view(R, K, H // K, L).add_(bias_R11L).softmax(-1)
        o_NGD = torch.bmm(probs_RKGL.view(R * K, H // K, L), v_RKLD.view(R * K, L, D))
        return o_NGD.view(R, H * D)

    def decode(self, tok_R: torch.Tensor, pos_R: torch.Tensor, cache: DynamicCache,
               bias_R11L: torch.Tensor) -> torch.Tensor:
        """Logits ``(R, V)`` of the token after ``tok_R`` (at positions ``pos_R``); appends
        the step's keys and values to ``cache``. ``bias_R11L`` masks the cache (see
        ``mask_bias``), this step's position included."""
        R, H, K, D = tok_R.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        h_RE = self.model.model.embed_tokens(tok_R)
        rotary = self._rotary(pos_R)
        for (w_qkv, w_o, w_gate_up, w_down), kv in zip(self.layers, cache.layers):
            qkv_RXD = torch.mm(self._norm(h_RE), w_qkv).view(R, H + 2 * K, D)
            qk_RXD = self._rotate(qkv_RXD[:, : H + K], *rotary)
            k_RKLD, v_RKLD = kv.update(qk_RXD[:, H:, None], qkv_RXD[:, H + K:, None])
            h_RE.addmm_(self._attend(qk_RXD[:, :H], k_RKLD, v_RKLD, bias_R11L), w_o)
            self._mlp_(h_RE, w_gate_up, w_down)
        return torch.mm(self._norm(h_RE), self.w_head)


def _new_cache(model: PreTrainedModel, capacity: int, storage: torch.Tensor | None = None
               ) -> tuple[DynamicCache, bool]:
    """A cache for ``model`` and whether it is the preallocated kind (plain full
    attention in every layer); other models keep HF's own layers. ``storage``: see
    ``LlamaFastPath.storage_shape``."""
    cache = DynamicCache(config=model.config)
    fast = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
    if fast:
        cache.layers = [KVBufferLayer(capacity, None if storage is None else storage[:, :, i])
                        for i in range(len(cache.layers))]
    return cache, fast


def _decode_mask(valid_BL: torch.Tensor, attn_implementation: str | None) -> torch.Tensor | None:
    """The 4D mask the attention kernel would get for one query per row (attend to every
    valid position: causality is trivial for the newest token), or None where the model's
    attention takes a mask format this module does not build."""
    if attn_implementation == "sdpa":
        return valid_BL[:, None, None, :]
    if attn_implementation == "eager":
        bias = torch.zeros(valid_BL.shape, dtype=torch.float32, device=valid_BL.device)
        return bias.masked_fill_(~valid_BL, torch.finfo(torch.float32).min)[:, None, None, :]
    return None


def prefill_groups(lengths: list[int], call_cost_tokens: int = PREFILL_CALL_COST_TOKENS
                   ) -> list[list[int]]:
    """Split prompt indices into groups prefilled together, minimising padded tokens plus
    ``call_cost_tokens`` per group: exact, by dynamic programming over the distinct
    lengths in order (a group is a run of them, padded to its longest)."""
    by_length: dict[int, list[int]] = {}
    for i, n in sorted(enumerate(lengths), key=lambda x: x[1]):
        by_length.setdefault(n, []).append(i)
    sizes, members = list(by_length), list(by_length.values())
    m = len(sizes)
    best = [0.0] + [float("inf")] * m  # best[j]: cost of prefilling the j shortest lengths
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # last group: lengths i..j-1
            rows += len(members[i])
            cost = best[i] + call_cost_tokens + rows * sizes[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], m
    while j > 0:
        groups.append([idx for group in members[cut[j]: j] for idx in group])
        j = cut[j]
    return groups[::-1]


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name of the forward argument that takes a KV cache: transformers 5 renamed
    ``past_key_values`` to ``cache`` (and warns on the old name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid_BP = torch.zeros((len(prompts), P), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids_BP[i, P - len(p):] = torch.tensor(p)
        valid_BP[i, P - len(p):] = True
    return ids_BP.to(device), valid_BP.to(device)


def _prefill(model: PreTrainedModel, prompts: list[list[int]], cache: DynamicCache, *,
             fast: bool, pad_id: int, cache_arg: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``prompts`` (left-padded to a common length P) through ``model`` into ``cache``
    (``fast``: made of ``KVBufferLayer``s).

    Returns the next-token logits ``(U, V)``, the ``valid_UP`` mask of the padded prompts
    and each prompt's next position ``(U, 1)``. With the preallocated cache, prompts of
    very different lengths are prefilled in length groups (``prefill_groups``) and their
    keys/values placed right-aligned in one cache.
    """
    device = next(model.parameters()).device
    ids_UP, valid_UP = _left_pad(prompts, pad_id, device)
    positions_UP = (valid_UP.long().cumsum(-1) - 1).clamp(min=0)
    next_pos_U1 = positions_UP[:, -1:] + 1
    U, P = ids_UP.shape
    groups = (prefill_groups([len(p) for p in prompts], PREFILL_CALL_COST_TOKENS) if fast
              else [list(range(U))])
    if len(groups) == 1:
        out = model(input_ids=ids_UP, attention_mask=valid_UP.long(), position_ids=positions_UP,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        return out.logits[:, -1], valid_UP, next_pos_U1
    logits_UV = None
    for group in groups:
        rows = torch.tensor(group, device=device)
        P_g = max(len(prompts[i]) for i in group)
        part, _ = _new_cache(model, P_g)
        cols = slice(P - P_g, P)  # the group's prompts all fit in the last P_g columns
        out = model(input_ids=ids_UP[rows, cols], attention_mask=valid_UP[rows, cols].long(),
                    position_ids=positions_UP[rows, cols], use_cache=True, logits_to_keep=1,
                    **{cache_arg: part})
        if logits_UV is None:
            logits_UV = out.logits.new_empty((U, out.logits.shape[-1]))
        logits_UV[rows] = out.logits[:, -1]
        for layer, part_layer in zip(cache.layers, part.layers):
            layer.place(part_layer, rows, n_rows=U, end=P)
    return logits_UV, valid_UP, next_pos_U1


@torch.inference_mode()
def sample(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
           eos_id: int, pad_id: int, generator: torch.Generator | None = None) -> Samples:
    """Sample one completion per prompt (repeat a prompt G times for G samples: it is
    prefilled once). Rows stop at ``eos_id`` (kept, and counted in ``lengths_B``) or after
    ``params.max_new_tokens``; ``generator`` makes the draws reproducible."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    weight = next(model.parameters())
    B, T = len(prompts), params.max_new_tokens
    P = max(len(p) for p in prompts)
    fast_path = LlamaFastPath(model, P + T) if LlamaFastPath.supports(model) else None
    shape = fast_path.storage_shape(B, P + T) if fast_path is not None else None
    with KV_STORAGE.lend(shape, weight.dtype, weight.device) as storage:
        cache, fast = _new_cache(model, P + T, storage)
        return _decode(model, prompts, params, cache, fast=fast,
                       fast_path=fast_path if fast else None, eos_id=eos_id, pad_id=pad_id,
                       generator=generator)


def _decode(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams,
            cache: DynamicCache, *, fast: bool, fast_path: LlamaFastPath | None, eos_id: int,
            pad_id: int, generator: torch.Generator | None) -> Samples:
    """``sample`` on a fresh ``cache`` (``fast``: of ``KVBufferLayer``s): prefill, then
    the decode loop."""
    device = next(model.parameters()).device
    B, T = len(prompts), params.max_new_tokens
    P = max(len(p) for p in prompts)

    # Prefill each distinct prompt once, shortest first (the fast path's chunks then pad
    # little); src_B says which one each row continues.
    unique = sorted({tuple(p) for p in prompts}, key=len)
    index = {p: i for i, p in enumerate(unique)}
    src_B = torch.tensor([index[tuple(p)] for p in prompts], device=device)
    unique = [list(p) for p in unique]
    cache_arg = cache_kwarg(model)
    if fast_path is not None:
        logits_RV, valid_UP, next_pos_U1 = fast_path.prefill(unique, cache)
    else:
        logits_RV, valid_UP, next_pos_U1 = _prefill(model, unique, cache, fast=fast,
                                                    pad_id=pad_id, cache_arg=cache_arg)
    # Batch row r continues prompt src_R[r] and fills output row rows_R[r]. Repeated
    # prompts fan out to their rows; distinct ones keep the prefill's order.
    if len(unique) < B:
        cache.batch_select_indices(src_B)
        logits_RV = logits_RV[src_B]
        src_R, rows_R = src_B, torch.arange(B, device=device)
    else:
        src_R, rows_R = torch.arange(B, device=device), torch.empty_like(src_B)
        rows_R[src_B] = torch.arange(B, device=device)

    # alive_R: the row has not produced EOS yet. Finished rows ride along until the next
    # compaction, writing tokens past their EOS that the final mask removes.
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    alive_R = torch.ones(B, dtype=torch.bool, device=device)
    # Decode positions are valid once reached, and attention only sees reached ones.
    valid_RL = torch.ones((B, P + T), dtype=torch.bool, device=device)
    valid_RL[:, :P] = valid_UP[src_R]
    next_pos_R = next_pos_U1[src_R].squeeze(-1)
    # What decode steps mask with: an additive bias (R, 1, 1, P + T) for the fast path, the
    # validity mask (R, P + T) for the model's own forward.
    mask_RL = fast_path.mask_bias(valid_RL) if fast_path is not None else valid_RL
    attn_impl = getattr(model.config, "_attn_implementation", None)

    for t in range(T):
        logp_RV = process_logits(logits_RV, params.temperature, params.top_p)
        tok_R = logp_RV.argmax(-1) if params.temperature == 0 else draw(logp_RV, generator)
        tokens_BT[rows_R, t] = tok_R
        logprobs_BT[rows_R, t] = logp_RV.gather(-1, tok_R[:, None]).squeeze(-1)
        alive_R &= tok_R != eos_id
        n_alive = int(alive_R.sum())
        if n_alive == 0 or t + 1 == T:
            break
        n_done = len(rows_R) - n_alive
        if n_done > 0 and n_done >= COMPACT_WHEN_DONE * len(rows_R):
            keep_R = alive_R.nonzero().squeeze(-1)
            cache.batch_select_indices(keep_R)
            rows_R, alive_R, tok_R = rows_R[keep_R], alive_R[keep_R], tok_R[keep_R]
            mask_RL, next_pos_R = mask_RL[keep_R], next_pos_R[keep_R]
        L = P + t + 1
        if fast_path is not None:
            logits_RV = fast_path.decode(tok_R, next_pos_R, cache, mask_RL[..., :L])
        else:
            mask = _decode_mask(mask_RL[:, :L], attn_impl) if fast else None
            if mask is None:
                mask = mask_RL[:, :L].long()
            out = model(input_ids=tok_R[:, None], attention_mask=mask,
                        position_ids=next_pos_R[:, None], use_cache=True, **{cache_arg: cache})
            logits_RV = out.logits[:, -1]
        next_pos_R = next_pos_R + 1

    # Lengths run to the first EOS (included), or to T; everything after it is padding.
    is_eos_BT = tokens_BT == eos_id
    lengths_B = torch.where(is_eos_BT.any(-1), is_eos_BT.int().argmax(-1) + 1, T)
    after_BT = torch.arange(T, device=device)[None, :] >= lengths_B[:, None]
    return Samples(tokens_BT=tokens_BT.masked_fill_(after_BT, pad_id),
                   logprobs_BT=logprobs_BT.masked_fill_(after_BT, 0.0), lengths_B=lengths_B)
