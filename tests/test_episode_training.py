"""Training on episodes the runner sampled: only the policy's tokens carry loss (the
environment's get exactly zero gradient, hand-checked on a 2-turn episode), and the AIPO
ratio is 1 at lag 0 over multi-turn episodes (the trainer's log-probs of the policy's
turns, sampled on top of the environment's tokens, are the generator's)."""

import copy

import pytest
import torch

from llamarl.app.rl import step as rl
from llamarl.app.envs import Step
from llamarl.app.config import GeneratorConfig
from llamarl.app.envs.episodes import EpisodeRunner
from llamarl.app.model.policy import create_default_policy
from llamarl.app.rl import losses
from llamarl.app.rl.contract import policy_segments
from llamarl.app.rl.packing import packed_completion_logprobs


class TwoTurns:
    """Says "ok" after the first turn, scores the second by its length (so the G
    episodes of a row get different rewards)."""

    tools = ()

    def rows(self, split, n, seed):
        return [{"question": f"{i}"} for i in range(n)]

    def reset(self, row):
        self.turn = 0
        return f"Q: {row['question']}\nA:"

    def step(self, turn):
        self.turn += 1
        return Step(observation="ok") if self.turn == 1 else Step(reward=float(len(turn)), done=True)


@pytest.fixture(scope="module")
def episodes():
    model, tokenizer = create_default_policy()
    runner = EpisodeRunner(model, tokenizer, TwoTurns, GeneratorConfig(max_new_tokens=5, max_turns=2))
    groups = runner.groups([{"question": "1+1"}, {"question": "2+2"}], group_size=3, version=lambda: 4,
                           rng=torch.Generator().manual_seed(1))
    runner.close()
    for g in groups:
        rewards = torch.tensor([[r.task["env_reward"] for r in g.rollouts]])
        for r, a in zip(g.rollouts, losses.group_advantages(rewards)[0][0].tolist()):
            r.advantage = a
    return model, tokenizer, [r for g in groups for r in g.rollouts]


@pytest.mark.parametrize("trainer_pass", ["packed", "padded"])
def test_environment_tokens_get_zero_gradient(episodes, trainer_pass):
    model, tokenizer, rollouts = episodes
    r = next(r for r in rollouts if r.advantage)
    assert policy_segments(r.policy_mask) == 2 and not bool(r.policy_mask.all())
    logprobs = packed_completion_logprobs if trainer_pass == "packed" else rl.completion_logprobs
    logp_BT, mask_BT = logprobs(model, [r], pad_id=tokenizer.pad_token_id)
    logp_BT.retain_grad()
    mu_BT = r.behaviour_logprobs[None, : logp_BT.shape[1]].clone()
    mu_BT[mask_BT == 0] = 0.0
    loss, _ = losses.aipo_loss(logp_BT, mu_BT, torch.tensor([r.advantage]), mask_BT, rho_max=4.0)
    loss.backward()
    policy_T = r.policy_mask
    grad_T = logp_BT.grad[0, : len(policy_T)]
    # By hand: loss = -sum_policy(rho * A * logp) / n_policy with rho = 1 (pi is mu).
    n = int(policy_T.sum())
    torch.testing.assert_close(grad_T[policy_T], torch.full((n,), -r.advantage / n), rtol=1e-4, atol=1e-6)
    assert bool((grad_T[~policy_T] == 0).all()) and bool((logp_BT[0, : len(policy_T)][~policy_T] == 0).all())
    model.zero_grad(set_to_none=True)


def test_ratio_is_one_at_lag_zero_over_multi_turn_episodes(episodes):
    model, tokenizer, rollouts = episodes
    assert all(policy_segments(r.policy_mask) == 2 for r in rollouts)
    m = rl.train_step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), rollouts,
                      rl.StepConfig(), pad_id=tokenizer.pad_token_id, policy_version=4)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
