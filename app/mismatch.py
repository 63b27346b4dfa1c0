"""How far the behaviour policy mu (what a generator sampled from) is from pi (the
trainer's model), token by token, split by the rollouts' lag.

Pure functions of tensors, like ``app.losses``. A rollout of lag 0 was sampled with the
very weights the trainer holds when it trains on it, so at lag 0 whatever separates mu
from pi is the generator's precision (``--gen-precision``) and float noise; at lag k
the policy has also moved k optimizer steps. Per token, with r = pi(y_t) / mu(y_t):

- ``ratio_mean``, ``ratio_max``: of r;
- ``frac_truncated``: the share of tokens with r > rho_max, whose AIPO coefficient is cut;
- ``kl``: KL(mu || pi) estimated with k3 = r - 1 - log r on tokens drawn from mu
  (unbiased, and non-negative token by token, unlike log mu - log pi).
"""

from __future__ import annotations

import torch

from app import names


def mismatch_stats(logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, *, rho_max: float) -> dict[str, float]:
    """The four statistics above over N tokens (log pi and log mu of each)."""
    if logp_N.numel() == 0:
        raise ValueError("mismatch statistics need at least one token")
    log_ratio_N = logp_N.detach().float() - behaviour_logp_N.float()
    ratio_N = log_ratio_N.exp()
    return {"ratio_mean": ratio_N.mean().item(), "ratio_max": ratio_N.max().item(),
            "frac_truncated": (ratio_N > rho_max).float().mean().item(),
            "kl": (ratio_N - 1 - log_ratio_N).mean().item()}


def mismatch_by_lag(logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, lag_N: torch.Tensor, *,
                    rho_max: float) -> dict[str, float]:
    """``mismatch_stats`` of the tokens of each lag present, under
    ``names.mismatch_metric(lag, stat)``."""
    out: dict[str, float] = {}
    for lag in sorted(set(lag_N.tolist())):
        mine_N = lag_N == lag
        stats = mismatch_stats(logp_N[mine_N], behaviour_logp_N[mine_N], rho_max=rho_max)
        out.update({names.mismatch_metric(lag, k): v for k, v in stats.items()})
    return out
