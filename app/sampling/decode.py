"""The decode loop of one ``sample`` call: prefill, fan-out, then one token per step.

The loop is the same for both paths; only two calls differ. With a ``LlamaFastPath``
(Llama-architecture models), prefill and decode steps run straight from the weights;
otherwise the model's own forward runs them (``generic.prefill``,
``generic.decode_step``). Every step draws from ``logits.process_logits`` and records
the drawn token's log-prob (``logits.token_logprobs``).

Identical prompts (RL samples each prompt G times) are prefilled once and their cache
rows fanned out to the G rows. Rows that have finished (EOS) leave the batch and the
cache, so a batch costs what its live rows cost; leaving copies the cache (into spare
buffers that then swap roles), so it waits until ``COMPACT_WHEN_DONE`` of the rows are
done rather than copying on every single EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from llamarl.app.sampling import generic
from llamarl.app.sampling.kv_cache import Prefixes
from llamarl.app.sampling.llama_fast import LlamaFastPath
from llamarl.app.sampling.logits import draw, process_logits, token_logprobs

if TYPE_CHECKING:
    from llamarl.app.sampling import SamplingParams

# Drop finished rows from the batch once this share of them is done (see module docstring).
COMPACT_WHEN_DONE = 0.25


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


Then = Callable[[Samples], None]
"""Where a finished batch goes on to (``sample``'s ``then``): the batch is handed on by a
call as the loop ends, not returned up through the sampler."""


def run(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams,
        cache: DynamicCache, *, fast: bool, fast_path: LlamaFastPath | None, eos_id: int,
        pad_id: int, generator: torch.Generator | None, then: Then | None = None,
        prefixes: Prefixes | None = None) -> Samples | None:
    """``sample`` on a fresh ``cache`` (``fast``: of ``KVBufferLayer``s): prefill (after
    ``prefixes``' past, with the fast path), then the decode loop; the ``Samples`` go on
    to ``then`` (``finish``)."""
    device = next(model.parameters()).device
    B, T = len(prompts), params.max_new_tokens
    P = max(len(p) for p in prompts)

    cache_arg = generic.cache_kwarg(model)
    if fast_path is not None:
        unique, src_B, (logits_RV, valid_UP, next_pos_U1) = prefill_fast(fast_path, prompts, cache, prefixes)
    else:
        unique, src_B = distinct_prompts(prompts, device)
        logits_RV, valid_UP, next_pos_U1 = generic.prefill(model, unique, cache, fast=fast,
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
        logprobs_BT[rows_R, t] = token_logprobs(logits_RV, tok_R, params.temperature,
                                                params.top_p, sampled_from_NV=logp_RV)
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
            logits_RV = generic.decode_step(model, tok_R, next_pos_R, cache, mask_RL[:, :L],
                                            fast=fast, attn_implementation=attn_impl,
                                            cache_arg=cache_arg)
        next_pos_R = next_pos_R + 1

    return finish(tokens_BT, logprobs_BT, eos_id=eos_id, pad_id=pad_id, then=then)


def prefill_fast(fast_path: LlamaFastPath, prompts: list[list[int]], cache: DynamicCache,
                 prefixes: Prefixes | None) -> tuple[list[list[int]], torch.Tensor, tuple]:
    """The fast path's prefill of ``prompts``' distinct ones (``distinct_prompts``): the
    distinct prompts, ``src_B`` and ``LlamaFastPath.prefill``'s result. With ``prefixes``
    each prompt's past is used (any of a repeated prompt's: the same keys and values) and
    every prompt's keys and values are kept (``Prefixes.kept``)."""
    unique, src_B = distinct_prompts(prompts, fast_path.cos_LD.device)
    if prefixes is None:
        return unique, src_B, fast_path.prefill(unique, cache)
    src = src_B.tolist()
    past_U: list[torch.Tensor | None] = [None] * len(unique)
    for i, u in enumerate(src):
        if prefixes.past[i] is not None:
            past_U[u] = prefixes.past[i]
    out = fast_path.prefill(unique, cache, past_U)
    kept_U = fast_path.kept(cache, [len(p) for p in unique])
    prefixes.kept = [kept_U[u] for u in src]
    return unique, src_B, out


def distinct_prompts(prompts: list[list[int]], device: torch.device
                     ) -> tuple[list[list[int]], torch.Tensor]:
    """Each distinct prompt once, shortest first (the fast path's prefill chunks then pad
    little), and ``src_B``: which of them each row continues."""
    unique = sorted({tuple(p) for p in prompts}, key=len)
    index = {p: i for i, p in enumerate(unique)}
    src_B = torch.tensor([index[tuple(p)] for p in prompts], device=device)
    return [list(p) for p in unique], src_B


def finish(tokens_BT: torch.Tensor, logprobs_BT: torch.Tensor, *, eos_id: int, pad_id: int,
           then: Then | None = None) -> Samples | None:
    """Lengths run to the first EOS (included), or to T; whatever a row drew after it
    (finished rows ride along until they leave the batch) becomes padding, in place. The
    ``Samples`` go on to ``then`` (the generator's way: framed and sent from there), or,
    without it, are returned."""
    T = tokens_BT.shape[1]
    is_eos_BT = tokens_BT == eos_id
    lengths_B = torch.where(is_eos_BT.any(-1), is_eos_BT.int().argmax(-1) + 1, T)
    after_BT = torch.arange(T, device=tokens_BT.device)[None, :] >= lengths_B[:, None]
    out = Samples(tokens_BT=tokens_BT.masked_fill_(after_BT, pad_id),
                  logprobs_BT=logprobs_BT.masked_fill_(after_BT, 0.0), lengths_B=lengths_B)
    if then is None:
        return out
    then(out)
    return None
