"""The behaviour distribution: what the sampler draws from, and the log-prob of a token
under it, for the sampler (mu) and the trainer (pi) alike.

A step's distribution is the model's logits divided by the temperature, restricted to
the top-p nucleus and renormalised (``process_logits``); ``draw`` samples from it.
``token_logprobs`` is the log-prob of given tokens under it: the sampler records it as
mu and ``rl.completion_logprobs`` computes pi with it, so the AIPO ratio pi / mu compares
the same distribution at two sets of weights (at equal weights it is exactly 1).
"""

from __future__ import annotations

import torch

# Work on (B, T, V) logits (the trainer's) goes in chunks of whole rows of about this
# many logits, so that its temporaries (the nucleus sort's values, int64 indices, softmax
# and cumsum; the gradient's softmax) stay bounded whatever B * T is. The sampler's
# (rows, V) logits are one chunk. On CUDA each chunk costs kernel launches: on an H200
# (8 x 512 x 32000 bf16 logits, forward and backward, benchmarks/token_logprobs.py) 4M-logit
# chunks took 7.5 ms against 2.4 ms for plain autograd; 16M-logit ones take 3.4 ms with 0.9
# fp32 copies of the logits at the peak (autograd: 3.0), and 64M ones 3.2 ms but 7.2 copies
# with top-p's sort. So 16M on CUDA.
CHUNK_ELEMENTS = 1 << 22
CUDA_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: int, V: int, device: torch.device) -> list[slice]:
    step = max(1, (CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS) // V)
    return [slice(start, start + step) for start in range(0, rows, step)]


def tempered(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in fp32 (fp64 stays fp64) divided by ``temperature``; 0 (greedy) and 1
    leave them as they are, and fp32 logits then come back uncopied."""
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    if temperature > 0 and temperature != 1.0:
        logits_NV = logits_NV / temperature
    return logits_NV


def outside_nucleus(logits_NV: torch.Tensor, temperature: float, top_p: float
                    ) -> torch.Tensor:
    """True on the tokens outside the top-p nucleus of ``softmax(logits / temperature)``
    (bool, shape of ``logits_NV``; no gradient). By decreasing probability, a token is
    kept while the mass strictly before it is below ``top_p``, so the most likely token
    always is."""
    V = logits_NV.shape[-1]
    logits_MV = logits_NV.detach().reshape(-1, V)
    drop_MV = torch.empty(logits_MV.shape, dtype=torch.bool, device=logits_MV.device)
    for rows in _row_chunks(logits_MV.shape[0], V, logits_MV.device):
        sorted_MV, order_MV = tempered(logits_MV[rows], temperature).sort(dim=-1, descending=True)
        p_MV = sorted_MV.softmax(-1)
        mass_before_MV = p_MV.cumsum(-1).sub_(p_MV)
        drop_MV[rows].scatter_(-1, order_MV, mass_before_MV >= top_p)
    return drop_MV.view(logits_NV.shape)


def process_logits(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution sampled from (temperature, then top-p); tokens
    outside the nucleus get -inf."""
    z_NV = tempered(logits_NV, temperature)
    if top_p < 1.0:
        z_NV = z_NV.masked_fill(outside_nucleus(z_NV, 1.0, top_p), float("-inf"))
    return torch.log_softmax(z_NV, dim=-1)


def token_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float,
                   top_p: float, *, sampled_from_NV: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``logp_N``: the log-prob of ``tokens_N`` under the distribution ``process_logits``
    makes of ``logits_NV`` (shapes ``(..., V)`` and ``(...)``, any leading dimensions),
    differentiable with respect to ``logits_NV``.

    With ``top_p < 1`` the nucleus is the nucleus of ``logits_NV`` UNION the token itself,
    and the log-prob is renormalised over that set. The sampler draws from the nucleus,
    so for the weights that sampled a token this is the plain nucleus and the value is
    the sampler's. The trainer's weights may have moved since (lag > 0): a token that
    has left their nucleus would get -inf under the plain rule, an infinite loss and NaN
    gradients; with the union it gets its probability renormalised over the nucleus and
    itself, finite, and a ratio pi / mu that the AIPO truncation then bounds like any
    other. The kept set is chosen without gradient; the gradient flows through the
    token's logit and through the renormaliser (the mass of the kept set). Padding
    targets, which the caller masks out, stay finite the same way.

    ``top_p == 1`` costs a log-softmax and a gather: no sort. Memory, on the trainer's
    ``(B, T, V)`` logits: the gradient, a bool mask (top-p only) and temporaries of
    ``CHUNK_ELEMENTS`` (see ``_KeptTokenLogprob``).

    ``sampled_from_NV``: ``process_logits(logits_NV, temperature, top_p)`` when the caller
    has just drawn ``tokens_N`` from it (the sampler, at every decode step): the tokens
    are in its nucleus, so the union is the nucleus and the value is read from it
    instead of sorting the logits a second time.
    """
    if sampled_from_NV is not None:
        return sampled_from_NV.gather(-1, tokens_N.unsqueeze(-1)).squeeze(-1)
    # In fp32 whatever the model computed in (bf16 autocast, llamarl.app.devices): a log-prob's
    # error must stay well below the policy changes the importance ratio measures.
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    V = logits_NV.shape[-1]
    drop_MV = None
    if top_p < 1.0:
        drop_MV = outside_nucleus(logits_NV, temperature, top_p).view(-1, V)
        drop_MV.scatter_(-1, tokens_N.reshape(-1, 1), False)  # the union
    logp_M = _KeptTokenLogprob.apply(logits_NV.reshape(-1, V), tokens_N.reshape(-1), drop_MV,
                                     temperature)
    return logp_M.view(tokens_N.shape)


class _KeptTokenLogprob(torch.autograd.Function):
    """Per row, the log-softmax over the kept set of ``z = tempered(logits)``, at the
    token; in row chunks. The backward writes ``d/dlogits = (onehot(tok) - softmax of z
    over the kept set) * grad / temperature`` chunk by chunk into the gradient tensor:
    autograd of the same ops would keep z, the masked z and the log-softmax, and add
    (B, T, V) temporaries of its own. (Fused log_softmax and softmax, not logsumexp:
    on CPU logsumexp was an order of magnitude slower on the trainer's logits.)"""

    @staticmethod
    def forward(ctx, logits_MV: torch.Tensor, tok_M: torch.Tensor, drop_MV: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
        logp_M = torch.empty(tok_M.shape, device=logits_MV.device,
                             dtype=torch.promote_types(logits_MV.dtype, torch.float32))
        for rows in _row_chunks(*logits_MV.shape, logits_MV.device):
            logp_KV = torch.log_softmax(_kept(logits_MV[rows], drop_MV, rows, temperature), -1)
            logp_M[rows] = logp_KV.gather(-1, tok_M[rows, None]).squeeze(-1)
        ctx.save_for_backward(logits_MV, tok_M, drop_MV)
        ctx.temperature = temperature
        return logp_M

    @staticmethod
    def backward(ctx, grad_M: torch.Tensor):
        logits_MV, tok_M, drop_MV = ctx.saved_tensors
        temp = ctx.temperature
        grad_M1 = (grad_M / temp if temp > 0 and temp != 1.0 else grad_M)[:, None]
        chunks = _row_chunks(*logits_MV.shape, logits_MV.device)
        grad_MV = torch.empty_like(logits_MV) if len(chunks) > 1 else None
        for rows in chunks:
            g_KV = torch.softmax(_kept(logits_MV[rows], drop_MV, rows, temp), -1)
            g_KV.mul_(-grad_M1[rows]).scatter_add_(-1, tok_M[rows, None], grad_M1[rows])
            if grad_MV is None:  # one chunk: it is the whole gradient
                return g_KV.to(logits_MV.dtype), None, None, None
            grad_MV[rows] = g_KV
        return grad_MV, None, None, None


def _kept(logits_KV: torch.Tensor, drop_MV: torch.Tensor | None, rows: slice,
          temperature: float) -> torch.Tensor:
    """Tempered logits of a chunk of rows, -inf where ``drop_MV`` says so."""
    z_KV = tempered(logits_KV, temperature)
    return z_KV if drop_MV is None else z_KV.masked_fill(drop_MV[rows], float("-inf"))


def draw(logp_BV: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``exp(logp_BV)``, by inverting the CDF at a uniform draw.

    Exact sampling, like ``torch.multinomial``, with B random numbers instead of B*V.
    Zero-probability tokens (top-p's -inf) are never drawn: the CDF is flat over them.
    """
    u_B = torch.rand(logp_BV.shape[:1], generator=generator, device=logp_BV.device)
    return inverse_cdf(logp_BV, u_B)


def inverse_cdf(logp_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The token of each row at which the CDF of ``exp(logp_BV)`` passes ``u_B`` (uniform
    in [0, 1), one per row) times the row's total mass: ``draw`` with its uniform numbers
    given, so a caller can draw them ahead (the static decoder draws a whole call's at
    once, and its captured steps read them). No host sync."""
    cdf_BV = logp_BV.exp().cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    tok_B = torch.searchsorted(cdf_BV, u_B[:, None] * total_B1, right=True)
    # Rounding can make u equal the total; the last token with mass is where the CDF first
    # reaches it, so that is the most a draw may pick.
    last_B = torch.searchsorted(cdf_BV, total_B1, right=False)
    return torch.minimum(tok_B, last_B).squeeze(-1)
