"""The behaviour distribution: what the sampler draws from.

A step's distribution is the model's logits divided by the temperature, restricted to
the top-p nucleus and renormalised (``process_logits``); ``draw`` samples from it by
inverting the CDF with one uniform number per row.
"""

from __future__ import annotations

import torch


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
