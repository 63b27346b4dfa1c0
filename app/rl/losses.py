"""RL math: group-relative advantages, the AIPO loss, PPO-clip, and a KL penalty.

Pure functions of tensors; no process groups. Each loss returns ``(loss, metrics)`` where
metrics are detached Python floats ready for logging. Shapes: B sequences, T completion
tokens; ``mask_BT`` is 1 on the tokens that carry loss (the policy's completion tokens)
and 0 on padding and on an environment's tokens.
"""

from __future__ import annotations

import torch

from llamarl.app.config import Normaliser


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def group_advantages(rewards_NG: torch.Tensor, *, normalize_std: bool = False,
                     eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, float]]:
    """A_i = r_i - mean(r) over each group of G samples of one prompt (optionally / std).

    A group whose rewards are all equal carries no signal: its advantages are exactly 0
    (and never 0/0), and it is counted in ``frac_zero_var``.
    """
    if rewards_NG.dim() != 2:
        raise ValueError(f"rewards must be (num_prompts, group_size), got shape {tuple(rewards_NG.shape)}")
    centred_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    std_N1 = rewards_NG.std(dim=1, keepdim=True, unbiased=False)
    zero_var_N1 = std_N1 <= eps
    if normalize_std:
        centred_NG = centred_NG / torch.where(zero_var_N1, torch.ones_like(std_N1), std_N1 + eps)
    adv_NG = centred_NG.masked_fill(zero_var_N1, 0.0)
    return adv_NG, {"frac_zero_var": zero_var_N1.float().mean().item(),
                    "reward_mean": rewards_NG.mean().item(),
                    "reward_std": rewards_NG.std(unbiased=False).item()}


def _normalise(per_token_BT: torch.Tensor, mask_BT: torch.Tensor, normaliser: Normaliser) -> torch.Tensor:
    """Token level: sum over all tokens / number of tokens. Sequence level: each
    sequence's mean over its tokens, then the mean over sequences."""
    if normaliser == "token":
        return masked_mean(per_token_BT, mask_BT)
    if normaliser == "sequence":
        per_seq_B = (per_token_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return per_seq_B.mean()
    raise ValueError(f"normaliser must be 'token' or 'sequence', got {normaliser!r}")


def _ratio_metrics(ratio_BT: torch.Tensor, mask_BT: torch.Tensor, truncated_BT: torch.Tensor) -> dict[str, float]:
    m = mask_BT.bool()
    r = ratio_BT.detach()[m]
    if r.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_max": 1.0, "frac_truncated": 0.0}
    return {"ratio_mean": r.mean().item(), "ratio_max": r.max().item(),
            "frac_truncated": truncated_BT[m].float().mean().item()}


def aipo_loss(logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
              mask_BT: torch.Tensor, *, rho_max: float, normaliser: Normaliser = "token",
              correction: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """AIPO (LlamaRL): -sum_t min(rho_t, rho_max).detach() * A * log pi(y_t) / normaliser.

    ``logp_BT``: log pi_theta of the sampled tokens (carries the gradient).
    ``behaviour_logp_BT``: log mu recorded by the generator while sampling.
    The truncated ratio is a constant coefficient: the gradient flows only through
    ``logp_BT`` in the log term. ``correction=False`` makes the coefficient 1: the
    on-policy gradient applied to mu's samples, for comparison (the ratio statistics
    still describe pi / mu).
    """
    if rho_max <= 0:
        raise ValueError(f"rho_max must be > 0, got {rho_max}")
    ratio_BT = torch.exp(logp_BT.detach() - behaviour_logp_BT)
    coef_BT = ratio_BT.clamp(max=rho_max) if correction else torch.ones_like(ratio_BT)
    per_token_BT = -coef_BT * advantages_B[:, None] * logp_BT
    loss = _normalise(per_token_BT, mask_BT, normaliser)
    return loss, _ratio_metrics(ratio_BT, mask_BT, ratio_BT > rho_max)


def ppo_clip_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
                  mask_BT: torch.Tensor, *, clip_eps: float = 0.2,
                  normaliser: Normaliser = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip: -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A), rho = pi_theta / pi_old."""
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    adv_B1 = advantages_B[:, None]
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = ratio_BT.clamp(1 - clip_eps, 1 + clip_eps) * adv_B1
    per_token_BT = -torch.minimum(unclipped_BT, clipped_BT)
    loss = _normalise(per_token_BT, mask_BT, normaliser)
    return loss, _ratio_metrics(ratio_BT, mask_BT, clipped_BT < unclipped_BT)


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
               *, normaliser: Normaliser = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """KL(pi_theta || pi_ref) per token with the non-negative, unbiased "k3" estimator:
    exp(ref - logp) - (ref - logp) - 1, on tokens sampled from (approximately) pi_theta."""
    delta_BT = ref_logp_BT - logp_BT
    kl_BT = torch.exp(delta_BT) - delta_BT - 1
    loss = _normalise(kl_BT, mask_BT, normaliser)
    return loss, {"kl": loss.item()}
