"""Batched autoregressive sampling with a KV cache, for any Hugging Face causal LM.

Returns what RL needs and ``model.generate`` does not hand out cheaply: the log-prob of
each sampled token under the distribution it was actually drawn from (after temperature
and top-p), which the trainer uses as the behaviour policy mu in AIPO.

Speed comes from doing less per step than ``generate``:

- the KV cache is preallocated once (``KVBufferLayer``) and written in place, instead of
  ``DynamicCache`` concatenating every layer's keys and values at every step;
- the decode-step attention mask is a view of one preallocated buffer handed to the
  model as a ready 4D mask, so the model skips building a mask each step;
- rows that have finished (EOS) leave the batch and the cache, so a batch costs what its
  live rows cost; compaction copies the cache, so it waits until a quarter of the rows
  are done rather than copying on every single EOS;
- for Llama-architecture models, a decode step runs straight from the weights
  (``LlamaDecodeStep``: fused q/k/v and gate/up matmuls, no module or kwargs plumbing),
  which halves the per-step fixed cost that dominates small models; the prefill still
  runs through the model's own forward;
- prompts of very different lengths are prefilled in length groups, so short prompts
  are not padded to the longest one;
- a token is drawn by inverting the CDF with one uniform number per row, not by
  ``torch.multinomial``'s one exponential per vocabulary entry;
- identical prompts (RL samples each prompt G times) are prefilled once, and their cache
  is fanned out to the G rows.

Models whose cache is not a plain full-attention one (sliding windows, linear attention)
keep HF's ``DynamicCache`` and 2D masks: slower, still correct.
"""

from __future__ import annotations

import inspect
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
    """

    is_croppable = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, H = key_states.shape[:2]
        self.key_buf = key_states.new_empty((B, H, self.capacity, key_states.shape[-1]))
        self.value_buf = value_states.new_empty((B, H, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

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
        """Keep (or repeat) rows ``indices``; only the filled positions are copied, and
        into the same storage when the batch shrinks (fresh memory costs page faults)."""
        if not self.is_initialized:
            return
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            kept = old[indices, :, : self.length]
            new = old[: len(indices)] if len(indices) <= old.shape[0] else old.new_empty(
                (len(indices), *old.shape[1:]))
            new[:, :, : self.length] = kept
            setattr(self, name, new)
        self.keys = self.key_buf[:, :, : self.length]
        self.values = self.value_buf[:, :, : self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.key_buf.shape[0], device=self.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def place(self, part: KVBufferLayer, rows: torch.Tensor, *, n_rows: int, end: int) -> None:
        """Copy ``part``'s keys/values into batch rows ``rows``, right-aligned to end at
        position ``end`` (how length groups of a prefill share one left-padded layout)."""
        if not self.is_initialized:
            self.device = part.device
            _, H, _, D = part.key_buf.shape
            D_v = part.value_buf.shape[-1]
            self.key_buf = part.key_buf.new_empty((n_rows, H, self.capacity, D))
            self.value_buf = part.value_buf.new_empty((n_rows, H, self.capacity, D_v))
            # Zeros, not garbage, where groups leave gaps: those positions are masked, but
            # attention still multiplies their values by 0, and 0 * NaN is NaN.
            self.key_buf[:, :, :end].zero_()
            self.value_buf[:, :, :end].zero_()
            self.is_initialized = True
        self.key_buf[rows, :, end - part.length: end] = part.keys
        self.value_buf[rows, :, end - part.length: end] = part.values
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVBufferLayer is for sampling only")


class LlamaDecodeStep:
    """One decode step of a Llama-architecture model, computed straight from its weights.

    At this project's model sizes a decode step is mostly per-op fixed cost, and HF's
    forward spends about as much again in Python (module calls, kwargs plumbing, mask and
    output bookkeeping). This does the same math in fewer ops: q/k/v and gate/up each as
    one matmul over weights concatenated when the step is built (a copy of those weights
    for the duration of one ``sample`` call), ``F.rms_norm``, rotary on q and k at once,
    SDPA. Log-probs agree with the model's own forward to ~1e-6. It only runs for
    configs it knows (``supports``), on a cache of ``KVBufferLayer``s filled by the
    model's own prefill.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        cfg, body = model.config, model.model
        self.model = model
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.scaling = body.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        self.layers = []
        for layer in body.layers[: cfg.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight,
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight,
            ))

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        return (cfg.model_type == "llama" and cfg.hidden_act == "silu" and not cfg.mlp_bias
                and not cfg.attention_bias and getattr(cfg, "pretraining_tp", 1) == 1)

    def __call__(self, tok_R: torch.Tensor, pos_R1: torch.Tensor, cache: DynamicCache,
                 mask_R11L: torch.Tensor) -> torch.Tensor:
        """Logits ``(R, V)`` of the token after ``tok_R`` (at positions ``pos_R1``);
        appends the step's keys and values to ``cache``."""
        body = self.model.model
        R, H, K, D = tok_R.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        h_RE = body.embed_tokens(tok_R)
        E = (h_RE.shape[-1],)
        cos_R1D, sin_R1D = (x.view(R, 1, D) for x in body.rotary_emb(h_RE, pos_R1))
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        sin_R1D = torch.cat([-sin_R1D[..., : D // 2], sin_R1D[..., D // 2:]], dim=-1)
        for (w_norm1, w_qkv, w_o, w_norm2, w_gate_up, w_down), kv in zip(self.layers, cache.layers):
            qkv_RND = F.linear(F.rms_norm(h_RE, E, w_norm1, self.eps), w_qkv).view(R, H + 2 * K, D)
            qk_RND = qkv_RND[:, : H + K]
            qk_RND = torch.addcmul(qk_RND * cos_R1D, qk_RND.roll(D // 2, -1), sin_R1D)
            k_RKLD, v_RKLD = kv.update(qk_RND[:, H:, None], qkv_RND[:, H + K:, None])
            o_RH1D = F.scaled_dot_product_attention(qk_RND[:, :H, None], k_RKLD, v_RKLD,
                                                    attn_mask=mask_R11L, scale=self.scaling,
                                                    enable_gqa=H != K)
            h_RE = h_RE + F.linear(o_RH1D.reshape(R, H * D), w_o)
            x_RE = F.rms_norm(h_RE, E, w_norm2, self.eps)
            gate_RI, up_RI = F.linear(x_RE, w_gate_up).chunk(2, -1)
            h_RE = h_RE + F.linear(F.silu(gate_RI) * up_RI, w_down)
        return self.model.lm_head(F.rms_norm(h_RE, E, body.norm.weight, self.eps))


def _new_cache(model: PreTrainedModel, capacity: int) -> tuple[DynamicCache, bool]:
    """A cache for ``model`` and whether it is the preallocated kind (plain full
    attention in every layer); other models keep HF's own layers."""
    cache = DynamicCache(config=model.config)
    fast = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
    if fast:
        cache.layers = [KVBufferLayer(capacity) for _ in cache.layers]
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


def _prefill(model: PreTrainedModel, prompts: list[list[int]], *, pad_id: int, capacity: int,
             cache_arg: str
             ) -> tuple[DynamicCache, bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``prompts`` (left-padded to a common length P) through ``model``.

    Returns the filled cache, whether it is the preallocated kind, the next-token logits
    ``(U, V)``, and the ``valid_UP`` mask and ``positions_UP`` of the padded prompts. With
    the preallocated cache, prompts of very different lengths are prefilled in length
    groups (``prefill_groups``) and their keys/values placed right-aligned in one cache.
    """
    device = next(model.parameters()).device
    ids_UP, valid_UP = _left_pad(prompts, pad_id, device)
    positions_UP = (valid_UP.long().cumsum(-1) - 1).clamp(min=0)
    U, P = ids_UP.shape
    cache, fast = _new_cache(model, capacity)
    groups = (prefill_groups([len(p) for p in prompts], PREFILL_CALL_COST_TOKENS) if fast
              else [list(range(U))])
    if len(groups) == 1:
        out = model(input_ids=ids_UP, attention_mask=valid_UP.long(), position_ids=positions_UP,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        return cache, fast, out.logits[:, -1], valid_UP, positions_UP
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
    return cache, fast, logits_UV, valid_UP, positions_UP


@torch.inference_mode()
def sample(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
           eos_id: int, pad_id: int, generator: torch.Generator | None = None) -> Samples:
    """Sample one completion per prompt (repeat a prompt G times for G samples: it is
    prefilled once). Rows stop at ``eos_id`` (kept, and counted in ``lengths_B``) or after
    ``params.max_new_tokens``; ``generator`` makes the draws reproducible."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    B, T = len(prompts), params.max_new_tokens

    # Prefill each distinct prompt once; src_B says which one each row continues.
    distinct: dict[tuple[int, ...], int] = {}
    src_B = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts],
                         device=device)
    cache_arg = cache_kwarg(model)
    P = max(len(p) for p in prompts)
    cache, fast, logits_RV, valid_UP, positions_UP = _prefill(
        model, [list(p) for p in distinct], pad_id=pad_id, capacity=P + T, cache_arg=cache_arg)
    if len(distinct) < B:
        cache.batch_select_indices(src_B)
        logits_RV = logits_RV[src_B]

    # Per batch row r: rows_R[r] is the output row it fills, alive_R whether it still decodes.
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    lengths_B = torch.zeros(B, dtype=torch.long, device=device)
    rows_R = torch.arange(B, device=device)
    alive_R = torch.ones(B, dtype=torch.bool, device=device)
    valid_RL = torch.zeros((B, P + T), dtype=torch.bool, device=device)
    valid_RL[:, :P] = valid_UP[src_B]
    next_pos_R1 = positions_UP[src_B, -1:] + 1
    attn_impl = getattr(model.config, "_attn_implementation", None)
    decode_step = LlamaDecodeStep(model) if fast and LlamaDecodeStep.supports(model) else None

    for t in range(T):
        logp_RV = process_logits(logits_RV, params.temperature, params.top_p)
        tok_R = logp_RV.argmax(-1) if params.temperature == 0 else draw(logp_RV, generator)
        logp_R = logp_RV.gather(-1, tok_R[:, None]).squeeze(-1)
        # Finished rows still ride along until the next compaction; they record nothing.
        tokens_BT[rows_R, t] = torch.where(alive_R, tok_R, pad_id)
        logprobs_BT[rows_R, t] = torch.where(alive_R, logp_R, 0.0)
        lengths_B[rows_R] += alive_R
        alive_R &= tok_R != eos_id
        n_alive = int(alive_R.sum())
        if n_alive == 0 or t + 1 == T:
            break
        n_done = len(rows_R) - n_alive
        if n_done > 0 and n_done >= COMPACT_WHEN_DONE * len(rows_R):
            keep_R = alive_R.nonzero().squeeze(-1)
            cache.batch_select_indices(keep_R)
            rows_R, alive_R, tok_R = rows_R[keep_R], alive_R[keep_R], tok_R[keep_R]
            valid_RL, next_pos_R1 = valid_RL[keep_R], next_pos_R1[keep_R]
        valid_RL[:, P + t] = True
        if decode_step is not None:
            logits_RV = decode_step(tok_R, next_pos_R1, cache, valid_RL[:, None, None, : P + t + 1])
        else:
            mask = _decode_mask(valid_RL[:, : P + t + 1], attn_impl) if fast else None
            if mask is None:
                mask = valid_RL[:, : P + t + 1].long()
            out = model(input_ids=tok_R[:, None], attention_mask=mask, position_ids=next_pos_R1,
                        use_cache=True, **{cache_arg: cache})
            logits_RV = out.logits[:, -1]
        next_pos_R1 = next_pos_R1 + 1
    return Samples(tokens_BT=tokens_BT, logprobs_BT=logprobs_BT, lengths_B=lengths_B)
