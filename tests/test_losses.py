"""Numerics of llamarl.app.rl.losses against values derived by hand on tiny tensors.

Every expected number below is worked out in the comment next to it, so a failing
assertion points at the term of the formula that broke.
"""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.app.rl import losses

# ---- group_advantages ----------------------------------------------------------------


def test_group_advantages_mean_centred_and_zero_variance_groups():
    rewards_NG = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                               [1.0, 1.0, 1.0, 1.0]])
    adv_NG, m = losses.group_advantages(rewards_NG)
    # group 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 1: all equal -> exactly 0
    torch.testing.assert_close(adv_NG, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert m["frac_zero_var"] == pytest.approx(0.5)
    assert m["reward_mean"] == pytest.approx(0.75)
    # population std of (1,0,0,1,1,1,1,1): var = (6 * 0.25^2 + 2 * 0.75^2) / 8 = 0.1875
    assert m["reward_std"] == pytest.approx(math.sqrt(0.1875))


def test_group_advantages_std_normalised():
    rewards_NG = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 3.0]])
    adv_NG, m = losses.group_advantages(rewards_NG, normalize_std=True)
    # group 0: centred (-1, 0, 1), population std sqrt(2/3) -> +-sqrt(3/2)
    s = math.sqrt(1.5)
    torch.testing.assert_close(adv_NG[0], torch.tensor([-s, 0.0, s]), rtol=1e-5, atol=1e-5)
    assert torch.equal(adv_NG[1], torch.zeros(3))
    assert m["frac_zero_var"] == pytest.approx(0.5)


def test_group_advantages_all_zero_variance_gives_exact_zero_no_nan():
    rewards_NG = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.3, 0.3]])
    for normalize_std in (False, True):
        adv_NG, m = losses.group_advantages(rewards_NG, normalize_std=normalize_std)
        assert not torch.isnan(adv_NG).any()
        assert torch.equal(adv_NG, torch.zeros_like(rewards_NG))
        assert m["frac_zero_var"] == 1.0


def test_group_advantages_group_of_one_is_zero():
    adv_NG, m = losses.group_advantages(torch.tensor([[0.7]]), normalize_std=True)
    assert torch.equal(adv_NG, torch.zeros(1, 1))
    assert m["frac_zero_var"] == 1.0


def test_group_advantages_rejects_non_2d():
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        losses.group_advantages(torch.tensor([1.0, 0.0]))


# ---- aipo_loss ------------------------------------------------------------------------
#
# B=2 sequences, T=3; the second sequence has 2 tokens (mask 0 on its last position).
# Ratios rho = pi/mu are chosen directly: behaviour logp = logp - log(rho).
# rho_max = 4, so coef = min(rho, 4).

AIPO_LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -9.0]]
AIPO_RATIO = [[0.5, 3.0, 8.0], [1.0, 5.0, 100.0]]  # 100 is on padding: must not show up anywhere
AIPO_ADV = [2.0, -1.0]
AIPO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
# coef = [[0.5, 3, 4], [1, 4, -]]; per-token loss = -coef * A * logp:
#   row 0: -0.5*2*(-1) = 1,  -3*2*(-2) = 12,  -4*2*(-0.5) = 4      -> sum 17 over 3 tokens
#   row 1: -1*(-1)*(-0.3) = -0.3,  -4*(-1)*(-1.5) = -6             -> sum -6.3 over 2 tokens
AIPO_TOKEN_LOSS = (17.0 - 6.3) / 5  # 2.14
AIPO_SEQUENCE_LOSS = (17.0 / 3 + (-6.3) / 2) / 2  # 1.258333...
# d loss / d logp = -min(rho, rho_max) * A / normaliser (the coefficient is a constant):
AIPO_TOKEN_GRAD = [[-0.5 * 2 / 5, -3 * 2 / 5, -4 * 2 / 5], [1 / 5, 4 / 5, 0.0]]
AIPO_SEQUENCE_GRAD = [[-0.5 * 2 / 6, -3 * 2 / 6, -4 * 2 / 6], [1 / 4, 4 / 4, 0.0]]


def _aipo_inputs():
    logp_BT = torch.tensor(AIPO_LOGP, requires_grad=True)
    behaviour_BT = torch.tensor(AIPO_LOGP) - torch.tensor(AIPO_RATIO).log()
    return logp_BT, behaviour_BT, torch.tensor(AIPO_ADV), torch.tensor(AIPO_MASK)


@pytest.mark.parametrize("normaliser, expected_loss, expected_grad", [
    ("token", AIPO_TOKEN_LOSS, AIPO_TOKEN_GRAD),
    ("sequence", AIPO_SEQUENCE_LOSS, AIPO_SEQUENCE_GRAD),
])
def test_aipo_loss_value_and_gradient(normaliser, expected_loss, expected_grad):
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    loss, _ = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0, normaliser=normaliser)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    loss.backward()
    # The truncation coefficient carries no gradient: if it did, untruncated tokens would
    # get an extra rho * A * logp term and these would differ.
    torch.testing.assert_close(logp_BT.grad, torch.tensor(expected_grad), rtol=1e-5, atol=1e-6)


def test_aipo_token_and_sequence_normalisers_differ_on_ragged_masks():
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    token, _ = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0, normaliser="token")
    seq, _ = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0, normaliser="sequence")
    assert abs(token.item() - seq.item()) > 0.5


def test_aipo_metrics_over_masked_tokens_only():
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    _, m = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0)
    # masked ratios: 0.5, 3, 8, 1, 5 (the 100 on padding is ignored)
    assert m["ratio_mean"] == pytest.approx(17.5 / 5, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(8.0, rel=1e-5)
    assert m["frac_truncated"] == pytest.approx(2 / 5)  # 8 and 5 exceed rho_max=4
    assert all(isinstance(v, float) for v in m.values())


def test_aipo_on_policy_is_plain_policy_gradient():
    # mu == pi: every ratio is 1, nothing truncated, loss = -A * mean(logp).
    logp_BT = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    loss, m = losses.aipo_loss(logp_BT, logp_BT.detach().clone(), torch.tensor([0.5]),
                               torch.ones(1, 2), rho_max=2.0)
    assert loss.item() == pytest.approx(-0.5 * (-4.0) / 2)
    assert m == pytest.approx({"ratio_mean": 1.0, "ratio_max": 1.0, "frac_truncated": 0.0})


def test_aipo_without_correction_weighs_every_token_by_one():
    """Coefficient 1: row 0: -2*(-1 - 2 - 0.5) = 7, row 1: 1*(-0.3 - 1.5) = -1.8 -> (7 - 1.8) / 5;
    d loss / d logp = -A / 5. The ratio statistics still describe pi / mu."""
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    loss, m = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0, correction=False)
    assert loss.item() == pytest.approx((7.0 - 1.8) / 5, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(logp_BT.grad, torch.tensor([[-0.4] * 3, [0.2, 0.2, 0.0]]))
    assert m["frac_truncated"] == pytest.approx(2 / 5)


def test_aipo_rho_max_changes_truncation():
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    loose, m_loose = losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=10.0)
    # nothing above 10: coef = rho; row 0: -0.5*2*(-1) + -3*2*(-2) + -8*2*(-0.5) = 1 + 12 + 8 = 21
    # row 1: -0.3 + -5*(-1)*(-1.5) = -0.3 - 7.5 -> (21 - 7.8) / 5
    assert loose.item() == pytest.approx((21.0 - 7.8) / 5, rel=1e-5)
    assert m_loose["frac_truncated"] == 0.0


def test_aipo_empty_mask_is_finite():
    loss, m = losses.aipo_loss(torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3),
                               torch.ones(2), torch.zeros(2, 3), rho_max=4.0)
    assert loss.item() == 0.0
    assert m == {"ratio_mean": 1.0, "ratio_max": 1.0, "frac_truncated": 0.0}


@pytest.mark.parametrize("rho_max", [0.0, -1.0])
def test_aipo_rejects_bad_rho_max(rho_max):
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    with pytest.raises(ValueError, match="rho_max"):
        losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=rho_max)


def test_rejects_unknown_normaliser():
    logp_BT, behaviour_BT, adv_B, mask_BT = _aipo_inputs()
    with pytest.raises(ValueError, match="normaliser"):
        losses.aipo_loss(logp_BT, behaviour_BT, adv_B, mask_BT, rho_max=4.0, normaliser="batch")
    with pytest.raises(ValueError, match="normaliser"):
        losses.ppo_clip_loss(logp_BT, behaviour_BT, adv_B, mask_BT, normaliser="batch")
    with pytest.raises(ValueError, match="normaliser"):
        losses.kl_penalty(logp_BT, behaviour_BT, mask_BT, normaliser="batch")


# ---- ppo_clip_loss ----------------------------------------------------------------------
#
# eps = 0.2. Row 0 (A=+1): ratios 0.5, 1.1, 1.5 -> min(r*A, clip(r)*A) = 0.5, 1.1, 1.2 (clipped)
# Row 1 (A=-1): ratios 0.5, 1.5, pad -> min(-0.5, -0.8) = -0.8 (clipped), min(-1.5, -1.2) = -1.5
# per-token loss = -min(...): row 0: -0.5, -1.1, -1.2; row 1: 0.8, 1.5 -> sum -0.5 over 5 tokens

PPO_LOGP = [[-1.0, -0.5, -2.0], [-0.7, -1.2, -3.0]]
PPO_RATIO = [[0.5, 1.1, 1.5], [0.5, 1.5, 7.0]]
PPO_ADV = [1.0, -1.0]
PPO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_ppo_clip_loss_value_metrics_and_zero_gradient_where_clipped():
    logp_BT = torch.tensor(PPO_LOGP, requires_grad=True)
    old_BT = torch.tensor(PPO_LOGP) - torch.tensor(PPO_RATIO).log()
    loss, m = losses.ppo_clip_loss(logp_BT, old_BT, torch.tensor(PPO_ADV), torch.tensor(PPO_MASK), clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.5 / 5, rel=1e-5)
    loss.backward()
    # unclipped tokens: d(-r*A)/dlogp = -r*A / 5; clipped tokens: 0
    expected = torch.tensor([[-0.5 / 5, -1.1 / 5, 0.0], [0.0, 1.5 / 5, 0.0]])
    torch.testing.assert_close(logp_BT.grad, expected, rtol=1e-5, atol=1e-6)
    assert m["frac_truncated"] == pytest.approx(2 / 5)  # the two clipped tokens
    assert m["ratio_mean"] == pytest.approx((0.5 + 1.1 + 1.5 + 0.5 + 1.5) / 5, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(1.5, rel=1e-5)  # 7.0 is on padding


def test_ppo_clip_sequence_normaliser():
    logp_BT = torch.tensor(PPO_LOGP)
    old_BT = logp_BT - torch.tensor(PPO_RATIO).log()
    loss, _ = losses.ppo_clip_loss(logp_BT, old_BT, torch.tensor(PPO_ADV), torch.tensor(PPO_MASK),
                                   clip_eps=0.2, normaliser="sequence")
    # row means: (-0.5 - 1.1 - 1.2) / 3 and (0.8 + 1.5) / 2
    assert loss.item() == pytest.approx((-2.8 / 3 + 2.3 / 2) / 2, rel=1e-5)


@pytest.mark.parametrize("clip_eps", [0.0, -0.1])
def test_ppo_clip_rejects_bad_eps(clip_eps):
    with pytest.raises(ValueError, match="clip_eps"):
        losses.ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                             clip_eps=clip_eps)


# ---- kl_penalty -------------------------------------------------------------------------


def test_kl_k3_values():
    logp_BT = torch.tensor([[0.0, -1.0, -2.0]])
    ref_BT = torch.tensor([[-1.0, -1.0, 5.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = losses.kl_penalty(logp_BT, ref_BT, mask_BT)
    # delta = ref - logp = (-1, 0, pad); k3 = e^d - d - 1 = (e^-1, 0) -> mean over 2 tokens
    assert loss.item() == pytest.approx(math.exp(-1) / 2, rel=1e-6)
    assert m["kl"] == pytest.approx(loss.item())


def test_kl_zero_when_equal_and_non_negative():
    g = torch.Generator().manual_seed(0)
    logp_BT = -torch.rand(4, 6, generator=g) * 3
    mask_BT = (torch.rand(4, 6, generator=g) > 0.3).float()
    zero, _ = losses.kl_penalty(logp_BT, logp_BT.clone(), mask_BT)
    assert zero.item() == 0.0
    ref_BT = logp_BT + torch.randn(4, 6, generator=g)
    delta = ref_BT - logp_BT
    k3_BT = delta.exp() - delta - 1
    assert (k3_BT >= 0).all()
    loss, _ = losses.kl_penalty(logp_BT, ref_BT, mask_BT)
    assert loss.item() > 0
    expected = (k3_BT * mask_BT).sum() / mask_BT.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
