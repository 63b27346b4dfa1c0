"""Train/inference mismatch statistics against hand-derived values, and the trainer's
step reporting them by lag."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llamarl.app.rl import mismatch
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.rl.contract import GroupId

# Ratios r = pi / mu of 2, 1 and 0.5: log pi - log mu = log r.
LOG_RATIO = [math.log(2.0), 0.0, math.log(0.5)]


def _inputs(log_ratio: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    behaviour_N = torch.tensor([-1.0, -2.0, -0.5])[: len(log_ratio)]
    return behaviour_N + torch.tensor(log_ratio), behaviour_N


def test_statistics_by_hand():
    logp_N, mu_N = _inputs(LOG_RATIO)
    m = mismatch.mismatch_by_lag(logp_N, mu_N, torch.zeros(3, dtype=torch.long), rho_max=1.5)
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx((2 + 1 + 0.5) / 3)
    assert m["mismatch/lag0/ratio_max"] == pytest.approx(2.0)
    assert m["mismatch/lag0/frac_truncated"] == pytest.approx(1 / 3)  # only 2 > 1.5
    # k3 = r - 1 - log r: (1 - ln 2) + 0 + (-0.5 + ln 2) = 0.5 over 3 tokens
    assert m["mismatch/lag0/kl"] == pytest.approx(0.5 / 3, rel=1e-6)
    # AIPO weights min(r, 1.5): 1.5, 1, 0.5; ESS = (3)^2 / (3 * (2.25 + 1 + 0.25))
    assert m["mismatch/lag0/ess"] == pytest.approx(9 / (3 * 3.5))


def test_identical_policies_have_ratio_one_and_no_kl():
    logp_N = torch.tensor([-0.3, -4.0, -1.25])
    m = mismatch.mismatch_by_lag(logp_N, logp_N.clone(), torch.zeros(3, dtype=torch.long), rho_max=2.0)
    assert m == pytest.approx({f"mismatch/lag0/{s}": v for s, v in
                               {"ratio_mean": 1.0, "ratio_max": 1.0, "frac_truncated": 0.0, "kl": 0.0,
                                "ess": 1.0}.items()})


def test_split_by_lag_by_hand():
    logp_N, mu_N = _inputs(LOG_RATIO)
    m = mismatch.mismatch_by_lag(logp_N, mu_N, torch.tensor([0, 0, 2]), rho_max=1.5)
    assert set(m) == {names.mismatch_metric(lag, s) for lag in (0, 2) for s in names.MISMATCH_STATS}
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx(1.5)
    assert m["mismatch/lag0/ratio_max"] == pytest.approx(2.0)
    assert m["mismatch/lag0/frac_truncated"] == pytest.approx(0.5)
    assert m["mismatch/lag0/kl"] == pytest.approx((1 - math.log(2)) / 2, rel=1e-6)
    assert m["mismatch/lag2/ratio_mean"] == pytest.approx(0.5)
    assert m["mismatch/lag2/frac_truncated"] == 0.0
    assert m["mismatch/lag2/kl"] == pytest.approx(math.log(2) - 0.5, rel=1e-6)
    assert m["mismatch/lag0/ess"] == pytest.approx(2.5 ** 2 / (2 * 3.25))  # weights 1.5, 1
    assert m["mismatch/lag2/ess"] == 1.0  # one token: its weight is all there is
    # The worst lag: lag 0's ESS (lag 2 has one token), lag 2's KL.
    assert mismatch.worst_lag(m) == pytest.approx({names.AIPO_ESS: 2.5 ** 2 / (2 * 3.25),
                                                   names.AIPO_KL_BEHAVIOUR: math.log(2) - 0.5})
    assert mismatch.worst_lag({}) == {}


def test_sums_of_shares_give_the_whole_batchs_statistics():
    """What trainer ranks do: each sums its share, the sums are added and the maxima
    taken, and the metrics are those of all the tokens together; a lag with no token
    (lag 1 here) has none."""
    logp_N, mu_N = _inputs(LOG_RATIO)
    lag_N = torch.tensor([0, 2, 0])
    whole = mismatch.mismatch_by_lag(logp_N, mu_N, lag_N, rho_max=1.5)
    a = mismatch.mismatch_sums(logp_N[:2], mu_N[:2], lag_N[:2], rho_max=1.5, lags=3)
    b = mismatch.mismatch_sums(logp_N[2:], mu_N[2:], lag_N[2:], rho_max=1.5, lags=3)
    summed = mismatch.mismatch_metrics([x + y for x, y in zip(a[0], b[0])], [max(x, y) for x, y in zip(a[1], b[1])])
    assert summed == pytest.approx(whole)
    assert set(summed) == {names.mismatch_metric(lag, s) for lag in (0, 2) for s in names.MISMATCH_STATS}
    assert mismatch.mismatch_by_lag(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long),
                                    rho_max=1.5) == {}


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


def test_train_step_reports_mismatch_by_lag(tiny_model):
    """Behaviour log-probs are the model's own (lag 0: pi == mu) for the rollouts of
    version 3, and the model's own minus log 2 for those of version 2 (lag 1: r = 2)."""
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i, version in enumerate((3, 3, 2, 2)):
        rollouts.append(rl.Rollout(prompt_ids=torch.randint(3, 40, (3,), generator=g).tolist(),
                                   completion_ids=torch.randint(3, 40, (4,), generator=g).tolist(),
                                   behaviour_logprobs=[], version=version, group_id=GroupId(0, i),
                                   advantage=1.0 if i % 2 else -1.0))
    with torch.no_grad():
        own_BT, _ = rl.completion_logprobs(tiny_model, rollouts, pad_id=0)
    for r, own_T in zip(rollouts, own_BT):
        r.behaviour_logprobs = own_T - (math.log(2.0) if r.version == 2 else 0.0)
    model = copy.deepcopy(tiny_model)
    m = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rollouts,
                      rl.StepConfig(rho_max=1.5, micro_batch=3), pad_id=0, policy_version=3)
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["mismatch/lag0/kl"] == pytest.approx(0.0, abs=1e-5)
    assert m["mismatch/lag1/ratio_mean"] == pytest.approx(2.0, rel=1e-5)
    assert m["mismatch/lag1/frac_truncated"] == 1.0
    assert m["mismatch/lag1/kl"] == pytest.approx(1 - math.log(2.0), rel=1e-4)
    assert not any(k.startswith(names.MISMATCH_PREFIX) for k in
                   rl.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rollouts,
                                 rl.StepConfig(), pad_id=0))


def test_a_step_without_signal_still_measures_the_mismatch(tiny_model):
    """Every advantage 0: no rollout needs the training pass, one forward without
    gradient measures them (pi == mu here: ratio 1)."""
    g = torch.Generator().manual_seed(1)
    rollouts = [rl.Rollout(prompt_ids=torch.randint(3, 40, (3,), generator=g).tolist(),
                           completion_ids=torch.randint(3, 40, (4,), generator=g).tolist(),
                           behaviour_logprobs=[], version=0, group_id=GroupId(0, 0), advantage=0.0)
                for _ in range(2)]
    with torch.no_grad():
        own_BT, _ = rl.completion_logprobs(tiny_model, rollouts, pad_id=0)
    for r, own_T in zip(rollouts, own_BT):
        r.behaviour_logprobs = own_T
    model = copy.deepcopy(tiny_model)
    m = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rollouts, rl.StepConfig(),
                      pad_id=0, policy_version=0)
    assert m["frac_skipped"] == 1.0
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
