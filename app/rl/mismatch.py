"""How far the behaviour policy mu (what a generator sampled from) is from pi (the
trainer's model), token by token, split by the rollouts' lag.

Pure functions of tensors, like ``llamarl.app.rl.losses``. A rollout of lag 0 was sampled with the
very weights the trainer holds when it trains on it, so at lag 0 whatever separates mu
from pi is the generator's precision (``--gen-precision``) and float noise; at lag k
the policy has also moved k optimizer steps. Per token, with r = pi(y_t) / mu(y_t):

- ``ratio_mean``, ``ratio_max``: of r;
- ``frac_truncated``: the share of tokens with r > rho_max, whose AIPO coefficient is cut;
- ``kl``: KL(mu || pi) estimated with k3 = r - 1 - log r on tokens drawn from mu
  (unbiased, and non-negative token by token, unlike log mu - log pi);
- ``ess``: the effective sample size of the AIPO weights w = min(r, rho_max) as a share
  of the tokens, (sum w)^2 / (n sum w^2): 1 when every weight is equal (on-policy),
  towards 1/n when a few tokens carry all the weight.

``worst_lag`` condenses them for ``--max-staleness auto`` (``llamarl.app.rl.staleness``):
the lowest ESS and the highest KL over the lags present.

``mismatch_sums`` gives sums and maxima per lag, which trainer ranks that each hold a
share of the batch add up (and take the maximum of) before ``mismatch_metrics``;
``mismatch_by_lag`` is both in one process.
"""

from __future__ import annotations

import torch

from llamarl.app import names

SUMS = ("tokens", "ratio", "truncated", "k3", "weight", "weight_sq")
"""What ``mismatch_sums`` adds up per lag, in this order."""


def mismatch_sums(logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, lag_N: torch.Tensor, *,
                  rho_max: float, lags: int) -> tuple[list[float], list[float]]:
    """Over N tokens (log pi, log mu and lag of each), for each lag 0..``lags``-1: the
    ``SUMS`` (flat, lag-major: ``len(SUMS) * lags`` numbers) and the largest ratio
    (``-inf`` for a lag without a token)."""
    log_ratio_N = logp_N.detach().double() - behaviour_logp_N.double()
    ratio_N = log_ratio_N.exp()
    lag_N = lag_N.long()
    weight_N = ratio_N.clamp(max=rho_max)
    per_token_NS = torch.stack([torch.ones_like(ratio_N), ratio_N, (ratio_N > rho_max).double(),
                                ratio_N - 1 - log_ratio_N, weight_N, weight_N * weight_N], dim=1)
    sums_LS = torch.zeros(lags, len(SUMS), dtype=torch.float64).index_add_(0, lag_N, per_token_NS)
    max_L = torch.full((lags,), -float("inf"), dtype=torch.float64).scatter_reduce_(0, lag_N, ratio_N, "amax")
    return sums_LS.flatten().tolist(), max_L.tolist()


def mismatch_metrics(sums: list[float], maxima: list[float]) -> dict[str, float]:
    """``names.mismatch_metric(lag, stat)`` for every lag with tokens, from ``mismatch_sums``."""
    out: dict[str, float] = {}
    for lag, ratio_max in enumerate(maxima):
        tokens, ratio, truncated, k3, weight, weight_sq = sums[lag * len(SUMS): (lag + 1) * len(SUMS)]
        if tokens > 0:
            out.update({names.mismatch_metric(lag, "ratio_mean"): ratio / tokens,
                        names.mismatch_metric(lag, "ratio_max"): ratio_max,
                        names.mismatch_metric(lag, "frac_truncated"): truncated / tokens,
                        names.mismatch_metric(lag, "kl"): k3 / tokens,
                        names.mismatch_metric(lag, "ess"): weight * weight / (tokens * weight_sq) if weight_sq > 0
                        else 1.0})
    return out


def worst_lag(by_lag: dict[str, float]) -> dict[str, float]:
    """From ``mismatch_metrics``: ``names.AIPO_ESS``, the lowest ESS, and
    ``names.AIPO_KL_BEHAVIOUR``, the highest KL, over the lags present (none: ``{}``).
    The oldest tokens are where staleness shows first; a mean over all lags would dilute
    them with the fresh ones."""
    ess = [v for k, v in by_lag.items() if k.endswith("/ess")]
    kl = [v for k, v in by_lag.items() if k.endswith("/kl")]
    return {names.AIPO_ESS: min(ess), names.AIPO_KL_BEHAVIOUR: max(kl)} if ess else {}


def mismatch_by_lag(logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, lag_N: torch.Tensor, *,
                    rho_max: float) -> dict[str, float]:
    """The statistics of the tokens of each lag present (``lag_N`` >= 0), in one process."""
    lags = int(lag_N.max()) + 1 if lag_N.numel() else 0
    return mismatch_metrics(*mismatch_sums(logp_N, behaviour_logp_N, lag_N, rho_max=rho_max, lags=lags))
