"""Batched autoregressive sampling with a KV cache, for any Hugging Face causal LM.

Returns what RL needs and ``model.generate`` does not hand out cheaply: the log-prob of
each sampled token under the distribution it was actually drawn from (after temperature
and top-p), which the trainer uses as the behaviour policy mu in AIPO.

Speed comes from doing less per step than ``generate``: rows that have finished (EOS)
leave the batch and the KV cache at once, so a batch costs what its live rows cost; the
per-step bookkeeping is a handful of tensor ops with no logits processors, stopping
criteria objects or cache-position plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


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
    if temperature > 0:
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


@torch.inference_mode()
def sample(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
           eos_id: int, pad_id: int, generator: torch.Generator | None = None) -> Samples:
    """Sample one completion per prompt (repeat a prompt G times for G samples)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, P), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, P - len(p):] = torch.tensor(p, device=device)
        mask[i, P - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    tokens = torch.full((B, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    live = torch.arange(B, device=device)  # original row index of each row still decoding
    cache = DynamicCache()
    next_pos = positions[:, -1:] + 1

    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    for t in range(params.max_new_tokens):
        logp_BV = process_logits(out.logits[:, -1], params.temperature, params.top_p)
        if params.temperature == 0:
            tok_B = logp_BV.argmax(-1)
        else:
            tok_B = torch.multinomial(logp_BV.exp(), 1, generator=generator).squeeze(-1)
        tokens[live, t] = tok_B
        logprobs[live, t] = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
        lengths[live] = t + 1
        done_B = tok_B == eos_id
        if t + 1 == params.max_new_tokens or bool(done_B.all()):
            break
        if bool(done_B.any()):
            keep = (~done_B).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            live, tok_B, mask, next_pos = live[keep], tok_B[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)
        out = model(input_ids=tok_B[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
    return Samples(tokens_BT=tokens, logprobs_BT=logprobs, lengths_B=lengths)
