"""The Llama fast path: prefill and decode computed straight from a Llama model's weights.

Runs when ``LlamaFastPath.supports(model)``: ``model_type`` "llama" with a SiLU MLP, no
bias in attention, MLP or head, no ``pretraining_tp`` split, and a rotary embedding that
does not depend on the sequence length (``STATIC_ROPE_TYPES``). The default policy is
such a model. Every other model runs its own forward (``generic``).

It needs a cache of ``KVBufferLayer``s (``kv_cache.new_cache`` makes one for any model
this path supports) and, on CPU, writes it into storage lent by ``kv_cache.KV_STORAGE``
(``storage_shape`` says how much).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from llamarl.app.sampling.kernels import DenseKernel, LinearKernel

# The fast path prefills prompts in chunks of about this many tokens: its
# temporaries (the MLP's is 8 x tokens x intermediate bytes in fp32) then stay small
# enough for the allocator to keep and reuse rather than map and unmap on every call
# (32 prompts, 2 cores: 1600 page faults and ~15% of the prefill's time unchunked).
PREFILL_CHUNK_TOKENS = 512

# ... and at most this many padded positions (rows x the longest prompt): what its
# attention and its q/k/v buffer hold, where prompts continue kept keys and values
# (``prefill``'s ``past``) and few of their tokens are new.
PREFILL_CHUNK_PADDED = 2048

# Rotary types whose cos/sin at a position do not depend on the sequence length, so one
# table per call serves prefill and every decode step ("dynamic" and "longrope" rescale
# with the length seen so far).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def _rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (rope or {}).get("rope_type", "default")


@dataclass
class FusedLinears:
    """The fast path's matmuls: per layer (qkv, o, gate_up, down), then the LM head."""

    layers: list[tuple[LinearKernel, LinearKernel, LinearKernel, LinearKernel]]
    head: LinearKernel

    def load_(self, other: FusedLinears) -> None:
        """Take ``other``'s weights into these kernels' storage, in place (see
        ``LinearKernel.load_``)."""
        for mine, theirs in zip([*self.layers, (self.head,)], [*other.layers, (other.head,)]):
            for kernel, source in zip(mine, theirs):
                kernel.load_(source)


FusedWeights = tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]


def fused_weights(model: PreTrainedModel, out: FusedWeights | None = None) -> FusedWeights:
    """The fast path's weight matrices, ``(out, in)`` like ``nn.Linear``'s: per layer
    q/k/v and gate/up concatenated (one matmul each), then the LM head. New tensors, or
    with ``out`` (an earlier result for this model) those, rewritten in place: no new
    storage for a new weight version (what the static decoder's captured steps read).
    The o and down matrices are the parameters themselves.

    Norm weights scale the inputs of the matmul that follows, and the attention scale
    commutes with rotary: both are folded in. And x * rsqrt(mean(x^2) + eps) ==
    x * rsqrt(sum(x^2) + E * eps) * sqrt(E): a sum is cheaper than a mean, and sqrt(E)
    goes into the weights with the norm's own (``LlamaFastPath._norm`` uses E * eps)."""
    cfg, body = model.config, model.model
    root_E = cfg.hidden_size ** 0.5
    layers = []
    for i, layer in enumerate(body.layers[: cfg.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        dst = out[0][i] if out is not None else (None,) * 4
        w_qkv = _cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dst[0])
        w_qkv[: attn.q_proj.weight.shape[0]].mul_(attn.scaling)
        w_qkv.mul_(layer.input_layernorm.weight * root_E)
        w_gate_up = _cat([mlp.gate_proj.weight, mlp.up_proj.weight], dst[2])
        w_gate_up.mul_(layer.post_attention_layernorm.weight * root_E)
        layers.append((w_qkv, attn.o_proj.weight, w_gate_up, mlp.down_proj.weight))
    head = _cat([model.lm_head.weight], out[1] if out is not None else None)
    return layers, head.mul_(body.norm.weight * root_E)


def _cat(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """``torch.cat(parts)``: a new tensor, or into ``out``."""
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def fused_linears(model: PreTrainedModel, kernel: Callable[[torch.Tensor], LinearKernel],
                  weights: FusedWeights | None = None) -> FusedLinears:
    """``fused_weights`` (or ``weights``, made by it) as kernels: the decoder layers'
    built by ``kernel``, the LM head's always fp32 (the logits are the distribution
    sampled from: precision matters most there, and the head is a small share of a
    decoder's matmuls)."""
    layers, head = weights or fused_weights(model)
    return FusedLinears(layers=[tuple(kernel(w) for w in ws) for ws in layers],  # type: ignore[misc]
                        head=DenseKernel(head))


class LlamaFastPath:
    """Prefill and decode steps of a Llama-architecture model, computed straight from its
    weights.

    At this project's model sizes HF's forward spends about as long in Python (module
    calls, kwargs plumbing, mask and output bookkeeping) and in fresh allocations as in
    arithmetic. This does the same math with fewer ops and fewer temporaries:

    - q/k/v and gate/up are one matmul each, over weights concatenated with the norms'
      weights and the attention scale folded in (``fused_weights``): in fp32 a copy made
      when the path is built, for the duration of one ``sample`` call; at another
      generator precision, kernels ``precision.GenWeights`` builds once per weight
      version (``linears``); residual adds are fused into the fp32 matmuls (``addmm_``),
      SiLU and the gate product run in place;
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

    def __init__(self, model: PreTrainedModel, max_positions: int,
                 linears: FusedLinears | None = None) -> None:
        cfg, body = model.config, model.model
        self.model = model
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.eps_sum = cfg.hidden_size * cfg.rms_norm_eps  # see fused_weights
        # fp32 unless the generator runs at another precision (``precision.GenWeights``
        # keeps its kernels from one weight version to the next).
        linears = linears or fused_linears(model, DenseKernel)
        self.layers, self.head = linears.layers, linears.head
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

    def _mlp_(self, h_NE: torch.Tensor, w_gate_up: LinearKernel, w_down: LinearKernel) -> None:
        """``h_NE += MLP(norm(h_NE))``, in place."""
        gate_up_NI = w_gate_up(self._norm(h_NE))
        half = gate_up_NI.shape[-1] // 2
        act_NI = F.silu(gate_up_NI[:, :half], inplace=True).mul_(gate_up_NI[:, half:])
        w_down.add_to_(h_NE, act_NI)

    def prefill(self, prompts: list[list[int]], cache: DynamicCache,
                past: list[torch.Tensor | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill ``cache`` with ``prompts`` (U of them, sorted by length, right-padded to
        the longest, P), in chunks of about ``PREFILL_CHUNK_TOKENS`` tokens. ``past[u]``,
        where given, holds prompt u's keys and values for its first tokens
        (``kv_cache.Prefixes``): they are copied in, and only the tokens after them run.

        Returns the next-token logits ``(U, V)``, ``valid_UP`` (True on prompt tokens) and
        each prompt's next position ``(U, 1)``."""
        device = self.cos_LD.device
        lengths_U = torch.tensor([len(p) for p in prompts])
        if (lengths_U.diff() < 0).any():
            raise ValueError("LlamaFastPath.prefill wants prompts sorted by length")
        past = past or [None] * len(prompts)
        if any(kv is not None and kv.shape[-2] >= len(p) for p, kv in zip(prompts, past)):
            raise ValueError("a prompt's past keys and values must cover fewer tokens than the prompt")
        U, P = len(prompts), int(lengths_U.max())
        for layer in cache.layers:
            layer.allocate(U, self.n_kv_heads, self.head_dim, like=self.cos_LD)
        new_U = [len(p) - (0 if kv is None else kv.shape[-2]) for p, kv in zip(prompts, past)]
        logits, start = [], 0
        while start < U:
            end, tokens = start, 0
            while end < U and (end == start or (tokens + new_U[end] <= PREFILL_CHUNK_TOKENS
                                                and (end + 1 - start) * len(prompts[end]) <= PREFILL_CHUNK_PADDED)):
                tokens, end = tokens + new_U[end], end + 1
            logits.append(self._prefill_chunk(prompts[start:end], cache, slice(start, end), P, past[start:end]))
            start = end
        valid_UP = (torch.arange(P)[None, :] < lengths_U[:, None]).to(device)
        return torch.cat(logits), valid_UP, lengths_U[:, None].to(device)

    def _prefill_chunk(self, prompts: list[list[int]], cache: DynamicCache, rows: slice,
                       length: int, past: list[torch.Tensor | None]) -> torch.Tensor:
        """Prefill of cache rows ``rows``: the new tokens (after each prompt's ``past``),
        packed (N), through every matmul, padded to this chunk's longest prompt (P) only
        for attention; the cache is zero-padded to ``length``. Logits ``(U, V)``."""
        device = self.cos_LD.device
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        U = len(prompts)
        lengths_U = torch.tensor([len(p) for p in prompts])
        cached_U = torch.tensor([0 if kv is None else kv.shape[-2] for kv in past])
        new_U = lengths_U - cached_U
        P, N, Q = int(lengths_U.max()), int(new_U.sum()), int(new_U.max())
        starts_U = new_U.cumsum(0) - new_U
        j_N = torch.arange(N) - starts_U.repeat_interleave(new_U)  # index among its prompt's new tokens
        row_N = torch.arange(U).repeat_interleave(new_U)
        pos_N = cached_U.repeat_interleave(new_U) + j_N
        slot_N, query_N = (row_N * P + pos_N).to(device), (row_N * Q + j_N).to(device)
        pos_N, last_U = pos_N.to(device), (starts_U + new_U - 1).to(device)

        ids_N = torch.tensor([tok for p, c in zip(prompts, cached_U.tolist()) for tok in p[c:]], device=device)
        h_NE = self.model.model.embed_tokens(ids_N)
        # Zeros where padding is: padded keys and values are attended with weight 0 only
        # after the mask, and 0 * garbage can be NaN.
        qkv_pad = h_NE.new_zeros((U * P, H + 2 * K, D))
        qkv_UXPD = qkv_pad.view(U, P, H + 2 * K, D).transpose(1, 2)
        k_UKPD, v_UKPD = qkv_UXPD[:, H: H + K], qkv_UXPD[:, H + K:]
        mask_U1QP = None
        if int(cached_U.max()) > 0:
            # Past keys and values go to their positions, each layer's before its new
            # tokens'; the new tokens' queries attend to every key up to their own position.
            query_pos_UQ = cached_U[:, None] + torch.arange(Q)[None, :]
            mask_U1QP = (torch.arange(P)[None, None, :] <= query_pos_UQ[:, :, None])[:, None].to(device)
        rotary = self._rotary(pos_N)
        for i, ((w_qkv, w_o, w_gate_up, w_down), kv) in enumerate(zip(self.layers, cache.layers)):
            qkv_NXD = w_qkv(self._norm(h_NE)).view(N, H + 2 * K, D)
            qkv_NXD[:, : H + K] = self._rotate(qkv_NXD[:, : H + K], *rotary)
            for u, kv_XCD in enumerate(past):
                if kv_XCD is not None:
                    qkv_UXPD[u, H:, : kv_XCD.shape[-2]] = kv_XCD[i]
            qkv_pad[slot_N] = qkv_NXD
            kv.write(rows, k_UKPD, v_UKPD, length=length)
            if i + 1 < len(self.layers):
                if mask_U1QP is None:
                    o_UHPD = F.scaled_dot_product_attention(
                        qkv_UXPD[:, :H], k_UKPD, v_UKPD, is_causal=True, scale=1.0, enable_gqa=H != K)
                    o_NE = o_UHPD.transpose(1, 2).reshape(U * P, H * D)[slot_N]
                else:
                    q_pad = h_NE.new_zeros((U * Q, H, D))
                    q_pad[query_N] = qkv_NXD[:, :H]
                    o_UHQD = F.scaled_dot_product_attention(
                        q_pad.view(U, Q, H, D).transpose(1, 2), k_UKPD, v_UKPD, attn_mask=mask_U1QP,
                        scale=1.0, enable_gqa=H != K)
                    o_NE = o_UHQD.transpose(1, 2).reshape(U * Q, H * D)[query_N]
            else:  # what follows only feeds the logits: the last token of each prompt
                h_NE = h_NE[last_U]
                valid_UP = (torch.arange(P)[None, :] < lengths_U[:, None]).to(device)
                o_NE = self._attend(qkv_NXD[last_U, :H], kv.key_buf[rows, :, :P],
                                    kv.value_buf[rows, :, :P], self.mask_bias(valid_UP))
            w_o.add_to_(h_NE, o_NE)
            self._mlp_(h_NE, w_gate_up, w_down)
        return self.head(self._norm(h_NE))

    def kept(self, cache: DynamicCache, lengths: list[int]) -> list[torch.Tensor]:
        """After ``prefill``: each of its prompts' keys and values (of ``lengths`` tokens),
        in ``kv_cache.Prefixes``' layout, copied out of ``cache`` into one block of which
        each is a view (two copies per layer, none per prompt)."""
        U, P, K = len(lengths), max(lengths), self.n_kv_heads
        block_ULXPD = self.cos_LD.new_empty((U, len(cache.layers), 2 * K, P, self.head_dim))
        for i, layer in enumerate(cache.layers):
            block_ULXPD[:, i, :K] = layer.key_buf[:U, :, :P]
            block_ULXPD[:, i, K:] = layer.value_buf[:U, :, :P]
        return [block_ULXPD[u, :, :, :n] for u, n in enumerate(lengths)]

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
        return self._decode(tok_R, pos_R, lambda i, k, v: cache.layers[i].update(k, v), bias_R11L)

    def decode_at(self, tok_R: torch.Tensor, pos_R: torch.Tensor,
                  kv: list[tuple[torch.Tensor, torch.Tensor]],
                  store: Callable[[int, torch.Tensor, torch.Tensor], None], slot_1: torch.Tensor,
                  bias_R11C: torch.Tensor) -> torch.Tensor:
        """``decode`` with fixed shapes and no host sync (``static_decode``'s step):
        ``store(layer, k_RK1D, v_RK1D)`` writes the step's keys and values at cache
        position ``slot_1`` (a one-element device tensor) of that layer's full-capacity
        buffers ``kv[layer]`` (``(R, K, C, D)`` keys and values), ``bias_R11C`` is opened
        there in place, and attention runs over all C positions, the bias hiding the
        ones not written yet."""
        bias_R11C.index_fill_(-1, slot_1, 0.0)

        def append(i: int, k_RK1D: torch.Tensor, v_RK1D: torch.Tensor):
            store(i, k_RK1D, v_RK1D)
            return kv[i]

        return self._decode(tok_R, pos_R, append, bias_R11C)

    def _decode(self, tok_R: torch.Tensor, pos_R: torch.Tensor,
                append: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                bias_R11L: torch.Tensor) -> torch.Tensor:
        """One decode step; ``append(layer, k_RK1D, v_RK1D)`` stores the step's keys and
        values and returns the layer's ``(R, K, L, D)`` keys and values to attend to."""
        R, H, K, D = tok_R.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        h_RE = self.model.model.embed_tokens(tok_R)
        rotary = self._rotary(pos_R)
        for i, (w_qkv, w_o, w_gate_up, w_down) in enumerate(self.layers):
            qkv_RXD = w_qkv(self._norm(h_RE)).view(R, H + 2 * K, D)
            qk_RXD = self._rotate(qkv_RXD[:, : H + K], *rotary)
            k_RKLD, v_RKLD = append(i, qk_RXD[:, H:, None], qkv_RXD[:, H + K:, None])
            w_o.add_to_(h_RE, self._attend(qk_RXD[:, :H], k_RKLD, v_RKLD, bias_R11L))
            self._mlp_(h_RE, w_gate_up, w_down)
        return self.head(self._norm(h_RE))
