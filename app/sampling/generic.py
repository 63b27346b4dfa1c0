"""The generic path: any causal LM that ``LlamaFastPath`` does not support runs its own
forward, for the prefill and for every decode step.

It still gets most of the sampler's savings. When every layer is plain full attention
(GPT-2, for one), the cache is made of ``KVBufferLayer``s (written in place, finished
rows dropped by one gather), decode steps get a ready 4D mask (``decode_mask``) rather
than a 2D one the model expands at every step, and prompts of very different lengths
are prefilled in length groups (``prefill_groups``), so short prompts are not padded to
the longest one. Models with sliding-window or linear-attention layers keep
transformers' ``DynamicCache``, 2D masks and one prefill: slower, still correct.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from llamarl.app.sampling.kv_cache import new_cache

# What one more prefill forward costs, in padded prompt tokens (a few ms of fixed cost):
# prompts are prefilled in length groups when that saves more padding than this.
PREFILL_CALL_COST_TOKENS = 64


def decode_mask(valid_BL: torch.Tensor, attn_implementation: str | None) -> torch.Tensor | None:
    """The 4D mask the attention kernel would get for one query per row (attend to every
    valid position: causality is trivial for the newest token), or None where the model's
    attention takes a mask format this module does not build (the caller then passes
    the 2D mask)."""
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


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid_BP = torch.zeros((len(prompts), P), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids_BP[i, P - len(p):] = torch.tensor(p)
        valid_BP[i, P - len(p):] = True
    return ids_BP.to(device), valid_BP.to(device)


def prefill(model: PreTrainedModel, prompts: list[list[int]], cache: DynamicCache, *,
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
    ids_UP, valid_UP = left_pad(prompts, pad_id, device)
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
        part, _ = new_cache(model, P_g)
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


def decode_step(model: PreTrainedModel, tok_R: torch.Tensor, pos_R: torch.Tensor,
                cache: DynamicCache, valid_RL: torch.Tensor, *, fast: bool,
                attn_implementation: str | None, cache_arg: str) -> torch.Tensor:
    """Logits ``(R, V)`` of the token after ``tok_R`` (at positions ``pos_R``), from the
    model's own forward; appends the step's keys and values to ``cache``. ``valid_RL``
    (True where a row may attend) covers the cache, this step's position included."""
    mask = decode_mask(valid_RL, attn_implementation) if fast else None
    if mask is None:
        mask = valid_RL.long()
    out = model(input_ids=tok_R[:, None], attention_mask=mask, position_ids=pos_R[:, None],
                use_cache=True, **{cache_arg: cache})
    return out.logits[:, -1]
