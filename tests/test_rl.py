"""The shared RL pieces: trainer-side log-probs, one policy-gradient step, advantages,
reward scoring and held-out evaluation."""

from __future__ import annotations

import copy

import pytest
import torch

from llamarl.app.rl import losses
from llamarl.app.rl import step as rl
from llamarl.app.tasks import answers
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.model.policy import create_default_policy, load_policy
from llamarl.app.rl.contract import GroupId, RolloutGroup
from llamarl.app.rewards import RewardResult, build_reward
from llamarl.app.rewards.verifiers import math_verifier
from llamarl.app.sampling import Samples
from tiny_models import PAD, VOCAB, tiny_llama


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


def _ragged_rollouts(n: int = 5, seed: int = 0) -> list[rl.Rollout]:
    """Prompts of 2..5 tokens, completions of 1..6 tokens, made-up behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = 2 + i % 4
        c = 1 + (i * 3) % 6
        out.append(rl.Rollout(
            prompt_ids=torch.randint(3, VOCAB, (p,), generator=g).tolist(),
            completion_ids=torch.randint(3, VOCAB, (c,), generator=g).tolist(),
            behaviour_logprobs=(-torch.rand(c, generator=g) * 2 - 3).tolist(),
            version=0, group_id=GroupId(0, i // 2), advantage=float(i % 3) - 0.8))
    return out


def _hand_logprobs(model, r: rl.Rollout, temperature: float) -> list[float]:
    """One unpadded sequence at a time: the logit at position p-1+t predicts token t."""
    ids = torch.cat([r.prompt_ids, r.completion_ids])[None]
    with torch.no_grad():
        logp_LV = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
    p = len(r.prompt_ids)
    return [logp_LV[p - 1 + t, tok].item() for t, tok in enumerate(r.completion_ids)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_alignment(tiny_model, temperature):
    rollouts = _ragged_rollouts(6)
    with torch.no_grad():
        logp_BT, mask_BT = rl.completion_logprobs(tiny_model, rollouts, pad_id=PAD, temperature=temperature)
    T = max(len(r.completion_ids) for r in rollouts)
    assert logp_BT.shape == mask_BT.shape == (6, T)
    for b, r in enumerate(rollouts):
        n = len(r.completion_ids)
        assert mask_BT[b].tolist() == [1.0] * n + [0.0] * (T - n)
        torch.testing.assert_close(logp_BT[b, :n], torch.tensor(_hand_logprobs(tiny_model, r, temperature)),
                                   rtol=1e-4, atol=1e-5)
        assert (logp_BT[b, n:] == 0).all()


def test_shared_prompts_run_once_with_the_same_values_and_gradients(tiny_model):
    """A group's rollouts share the prompt pass; values and gradients equal running every
    sequence whole."""
    base = _ragged_rollouts(4, seed=3)
    rollouts = [rl.Rollout(prompt_ids=base[i // 3].prompt_ids, completion_ids=base[i % 4].completion_ids,
                           behaviour_logprobs=[], version=0, group_id=GroupId(0, i // 3)) for i in range(9)]
    model = copy.deepcopy(tiny_model)
    logp_BT, mask_BT = rl.completion_logprobs(model, rollouts, pad_id=PAD)
    (logp_BT * mask_BT).sum().backward()
    grouped = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b, r in enumerate(rollouts):
        ids = torch.cat([r.prompt_ids, r.completion_ids])[None]
        logp_LV = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        p = len(r.prompt_ids)
        hand = torch.stack([logp_LV[p - 1 + t, tok] for t, tok in enumerate(r.completion_ids)])
        torch.testing.assert_close(logp_BT[b, : len(hand)].detach(), hand.detach(), atol=1e-5, rtol=0)
        total = total + hand.sum()
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grouped[n], p.grad, atol=1e-5, rtol=1e-4)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
@pytest.mark.parametrize("loss", ["aipo", "ppo"])
def test_train_step_micro_batches_equal_one_full_batch(tiny_model, normaliser, loss):
    rollouts = _ragged_rollouts(5)
    results = {}
    for micro_batch in (64, 2):  # 2 -> chunks of 2, 2, 1 with different token counts
        model = copy.deepcopy(tiny_model)
        # SGD keeps the update proportional to the gradient, so a wrong weighting shows
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        cfg = rl.StepConfig(loss=loss, normaliser=normaliser, micro_batch=micro_batch, rho_max=1.5,
                            max_grad_norm=1e9)
        m = rl.train_step(model, optimizer, rollouts, cfg, pad_id=PAD)
        results[micro_batch] = (_snapshot(model), m)
    (full, m_full), (micro, m_micro) = results[64], results[2]
    moved = max((full[k] - tiny_model.state_dict()[k]).abs().max().item() for k in full)
    assert moved > 1e-3  # the step did something
    for k in full:
        torch.testing.assert_close(micro[k], full[k], rtol=1e-4, atol=1e-6)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], rel=1e-4, abs=1e-6)
    assert m_micro["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-4)
    assert m_micro["ratio_max"] == pytest.approx(m_full["ratio_max"], rel=1e-4)
    assert m_full["response_len"] == pytest.approx(sum(len(r.completion_ids) for r in rollouts) / 5)


def _episodes(tiny_model) -> list[rl.Rollout]:
    """Rollouts of two policy turns around an environment's tokens (mask False there),
    sampled at versions 3 then 5: behaviour log-probs are the model's own minus log 2 on
    the version-3 turn, its own on the version-5 turn, and absurd (-1e4) on the
    environment's tokens, which must be ignored."""
    out = []
    for i, r in enumerate(_ragged_rollouts(6, seed=7)):
        c = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        env = 2 + i % 3  # the environment's tokens: 2..4 of them, from position 2
        mask = torch.ones(8, dtype=torch.bool)
        mask[2: 2 + env] = False
        out.append(rl.Rollout(prompt_ids=r.prompt_ids, completion_ids=c, behaviour_logprobs=torch.zeros(8),
                              policy_mask=mask, segment_versions=[3, 5], version=5, group_id=r.group_id,
                              advantage=r.advantage))
    with torch.no_grad():
        own_BT = torch.stack([torch.tensor(_hand_logprobs(tiny_model, r, 1.0)) for r in out])
    for r, own_T in zip(out, own_BT):
        first_turn_T = torch.arange(8) < 2
        r.behaviour_logprobs = torch.where(r.policy_mask, own_T - first_turn_T * torch.log(torch.tensor(2.0)),
                                           torch.tensor(-1e4))
    return out


@pytest.mark.parametrize("trainer_pass", ["packed", "padded"])
@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_environment_tokens_carry_no_loss_and_no_log_prob(tiny_model, trainer_pass, normaliser):
    """An episode with an environment segment in the middle: the step's loss and update
    are those of ``losses.aipo_loss`` on the policy's tokens alone, computed by hand one
    unpadded sequence at a time with the environment's positions masked out; the
    mismatch counts each turn at its own lag (version 3: lag 2, r = 2; version 5: lag 0)."""
    rollouts = _episodes(tiny_model)
    cfg = rl.StepConfig(normaliser=normaliser, rho_max=1.5, max_grad_norm=1e9, trainer_pass=trainer_pass)
    model = copy.deepcopy(tiny_model)
    m = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), rollouts, cfg, pad_id=PAD,
                      policy_version=5)

    reference = copy.deepcopy(tiny_model)
    rows = []
    for r in rollouts:
        ids = torch.cat([r.prompt_ids, r.completion_ids])[None]
        logp_LV = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        p = len(r.prompt_ids)
        rows.append(logp_LV[p - 1 + torch.arange(8), r.completion_ids])
    mask_BT = torch.stack([r.policy_mask for r in rollouts]).float()
    logp_BT = torch.stack(rows) * mask_BT
    mu_BT = torch.stack([r.behaviour_logprobs for r in rollouts]).masked_fill(mask_BT == 0, 0.0)
    adv_B = torch.tensor([r.advantage for r in rollouts])
    loss, _ = losses.aipo_loss(logp_BT, mu_BT, adv_B, mask_BT, rho_max=1.5, normaliser=normaliser)
    loss.backward()

    assert m["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    for (name, p), before in zip(model.named_parameters(), tiny_model.parameters()):
        torch.testing.assert_close(before - p.detach(), dict(reference.named_parameters())[name].grad,
                                   rtol=1e-4, atol=1e-6)
    assert m["response_len"] == pytest.approx(mask_BT.sum().item() / 6)
    assert m["mismatch/lag0/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["mismatch/lag2/ratio_mean"] == pytest.approx(2.0, rel=1e-4)
    assert "mismatch/lag1/ratio_mean" not in m


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_zero_advantage_rollouts_skip_the_pass_without_changing_the_gradient(tiny_model, normaliser):
    rollouts = _ragged_rollouts(6)
    for r in rollouts[::2]:
        r.advantage = 0.0
    results = {}
    # kl_coef > 0 with no reference model forces every rollout through the pass (and adds no KL)
    for name, kl_coef in (("skipping", 0.0), ("full", 1e-12)):
        model = copy.deepcopy(tiny_model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        cfg = rl.StepConfig(normaliser=normaliser, micro_batch=2, rho_max=1.5, max_grad_norm=1e9,
                            kl_coef=kl_coef)
        results[name] = (_snapshot(model), rl.train_step(model, optimizer, rollouts, cfg, pad_id=PAD))
    (skip, m_skip), (full, m_full) = results["skipping"], results["full"]
    assert m_skip["frac_skipped"] == pytest.approx(0.5) and m_full["frac_skipped"] == 0.0
    for k in full:
        torch.testing.assert_close(skip[k], full[k], rtol=1e-5, atol=1e-7)
    assert m_skip["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)


def test_a_batch_without_signal_still_steps_with_zero_gradients(tiny_model):
    rollouts = _ragged_rollouts(3)
    for r in rollouts:
        r.advantage = 0.0
    model = copy.deepcopy(tiny_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    m = rl.train_step(model, optimizer, rollouts, rl.StepConfig(), pad_id=PAD)
    assert m["frac_skipped"] == 1.0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_train_step_normalisers_differ_on_ragged_batches(tiny_model):
    rollouts = _ragged_rollouts(5)
    losses_by = {}
    for normaliser in ("token", "sequence"):
        model = copy.deepcopy(tiny_model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        losses_by[normaliser] = rl.train_step(model, optimizer, rollouts, rl.StepConfig(normaliser=normaliser),
                                              pad_id=PAD)["loss"]
    assert losses_by["token"] != pytest.approx(losses_by["sequence"], rel=1e-3)


def test_train_step_with_kl_reports_kl(tiny_model):
    model, ref = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    m = rl.train_step(model, optimizer, _ragged_rollouts(4), rl.StepConfig(kl_coef=0.1), pad_id=PAD, ref_model=ref)
    assert m["kl"] > 0


def test_train_step_rejects_an_empty_batch(tiny_model):
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="at least one rollout"):
        rl.train_step(tiny_model, optimizer, [], rl.StepConfig(), pad_id=PAD)


# ---- advantages and rewards -------------------------------------------------------------


def _rollout(group: int, reward: float | None = None, *, prompt: str = "", completion: str = "",
             task: dict | None = None) -> rl.Rollout:
    return rl.Rollout(prompt_ids=[1], completion_ids=[5], behaviour_logprobs=[-1.0], version=0,
                      group_id=GroupId(0, group), prompt=prompt, completion=completion, task=task or {},
                      result=None if reward is None else RewardResult(reward, {}))


def test_set_group_advantages_ragged_groups_by_id_not_position():
    # groups interleaved: a has 3 rollouts, b has 2 equal rewards, c has one
    a, b, c = 0, 1, 2
    rollouts = [_rollout(a, 1.0), _rollout(b, 1.0), _rollout(a, 0.0), _rollout(c, 1.0),
                _rollout(b, 1.0), _rollout(a, 0.0)]
    m = rl.set_group_advantages(rollouts, normalize_std=False)
    advantages = [r.advantage for r in rollouts]
    assert advantages == pytest.approx([2 / 3, 0.0, -1 / 3, 0.0, 0.0, -1 / 3])
    assert m["frac_zero_var"] == pytest.approx(2 / 3)  # b and c

    rl.set_group_advantages(rollouts, normalize_std=True)
    # group a: std sqrt(2/9) -> (2/3, -1/3, -1/3) / sqrt(2/9) = (sqrt 2, -1/sqrt 2, -1/sqrt 2)
    s = 2 ** 0.5
    assert [r.advantage for r in rollouts] == pytest.approx([s, 0.0, -1 / s, 0.0, 0.0, -1 / s], rel=1e-4)


def test_score_groups_with_math_verifier_quarantines_missing_answer():
    first = [_rollout(0, prompt="Q: x\nA:", completion=" 2+3=5\n#### 5", task={"answer": 5}),
             _rollout(0, prompt="Q: x\nA:", completion=" 2+3=6\n#### 6", task={"answer": 5})]
    second = [_rollout(1, prompt="Q: y\nA:", completion="#### 5")]  # no reference answer
    groups = [RolloutGroup(group_id=GroupId(0, 0), version=0, rollouts=first),
              RolloutGroup(group_id=GroupId(0, 1), version=0, rollouts=second)]
    with build_reward("math_verifier") as reward:
        results = rl.score_groups(groups, reward, timeout_s=10.0)
    rollouts = first + second
    assert [r.reward for r in rollouts] == [1.0, 0.0, None]
    assert rollouts[0].result.components == {"math_verifier": 1.0}
    assert rollouts[2].result.components == {}
    assert results[2].quarantined == "raised:KeyError"
    assert results[0].quarantined is None


# ---- evaluation -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_policy():
    model, tok = create_default_policy(seed=0)
    return model.eval(), tok


def test_evaluate_real_model_returns_accuracy_and_levels(default_policy):
    model, tok = default_policy
    problems = tasks.make_split("eval", 6, seed=0)
    m = rl.evaluate(model, tok, problems, max_new_tokens=6, batch_size=4)
    assert 0.0 <= m["accuracy"] <= 1.0 and 0.0 <= m["format"] <= 1.0
    assert {"accuracy_level1", "accuracy_level2", "accuracy_level3"} <= set(m)
    assert m == rl.evaluate(model, tok, problems, max_new_tokens=6, batch_size=6)  # greedy: deterministic
    sampled = rl.evaluate(model, tok, problems, max_new_tokens=6, temperature=1.0,
                          generator=torch.Generator().manual_seed(0))
    assert 0.0 <= sampled["accuracy"] <= 1.0


def test_evaluate_counts_per_level(default_policy, monkeypatch):
    """With a stand-in sampler that answers level-1 problems right, level-2 ones in the
    wrong number and level-3 ones without the answer format, the counts are exact."""
    model, tok = default_policy
    problems = tasks.make_split("eval", 9, seed=0)  # levels 1, 2, 3 in turn
    by_prompt = {tasks.format_prompt(p.question): p for p in problems}

    def fake_sample(model, prompts, params, *, eos_id, pad_id, generator=None):
        rows = []
        for ids in prompts:
            p = by_prompt[tok.decode(ids, skip_special_tokens=True)]
            text = {1: f" #### {p.answer}", 2: f" #### {p.answer + 1}", 3: f" {p.answer}"}[p.level]
            rows.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        T = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])
        return Samples(tokens_BT=tokens, logprobs_BT=torch.zeros(tokens.shape),
                       lengths_B=torch.tensor([len(r) for r in rows]))

    monkeypatch.setattr(rl, "sample", fake_sample)
    m = rl.evaluate(model, tok, problems, max_new_tokens=8, batch_size=4)
    assert m["accuracy"] == pytest.approx(3 / 9)
    assert m["accuracy_level1"] == 1.0 and m["accuracy_level2"] == 0.0 and m["accuracy_level3"] == 0.0
    assert m["format"] == pytest.approx(6 / 9)


def test_the_sampled_accuracy_is_the_mean_over_eval_samples_per_problem(default_policy, monkeypatch):
    """``--eval-samples K``: each held-out problem is sampled K times (its samples side by
    side) and the sampled accuracy is the mean over all K x problems; the greedy pass runs once. A stand-in
    sampler answers right greedily and on a problem's first sample only: greedy 1, sampled 1/K."""
    from llamarl.app.config import GeneratorConfig
    from llamarl.app.rl import steps

    model, tok = default_policy
    problems = tasks.make_split("eval", 5, seed=0)
    by_prompt = {tasks.format_prompt(p.question): p for p in problems}
    seen: dict[str, int] = {}
    order: list[tasks.Problem] = []

    def fake_sample(model, prompts, params, *, eos_id, pad_id, generator=None):
        rows = []
        for ids in prompts:
            text = tok.decode(ids, skip_special_tokens=True)
            p, k = by_prompt[text], seen.get(text, 0)
            if params.temperature > 0:
                seen[text] = k + 1
                order.append(p)
            right = params.temperature == 0 or k == 0
            rows.append(tok(f" #### {p.answer if right else p.answer + 1}", add_special_tokens=False)["input_ids"]
                        + [tok.eos_token_id])
        T = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])
        return Samples(tokens_BT=tokens, logprobs_BT=torch.zeros(tokens.shape),
                       lengths_B=torch.tensor([len(r) for r in rows]))

    monkeypatch.setattr(rl, "sample", fake_sample)
    gen = GeneratorConfig(max_new_tokens=8, temperature=0.7)
    m = steps.evaluate(model, tok, problems, gen, step=0, samples=4)
    assert (m["accuracy"], m["format"]) == (1.0, 1.0)
    assert m["sampled_accuracy"] == pytest.approx(1 / 4) and set(seen.values()) == {4}
    assert order == [p for p in problems for _ in range(4)]  # side by side: one prefill a problem
    seen.clear()
    assert steps.evaluate(model, tok, problems, gen, step=0)["sampled_accuracy"] == 1.0  # one sample each




def test_batched_evaluation_gives_the_one_by_one_verdicts(default_policy):
    """The held-out evaluation decodes its problems in batches (prompts of different
    lengths, left-padded): each problem's greedy completion, and so its verdict, is the
    one it gets decoded alone (the verdict is a function of the text: ``grade``)."""
    model, tok = default_policy
    problems = tasks.make_split("eval", 16, seed=3)
    assert len({len(tok(p.question)["input_ids"]) for p in problems}) > 6
    batched = rl.eval_completions(model, tok, problems, max_new_tokens=24, batch_size=16)
    alone = rl.eval_completions(model, tok, problems, max_new_tokens=24, batch_size=1)
    assert batched == alone
    assert rl.grade(problems, batched) == rl.evaluate(model, tok, problems, max_new_tokens=24, batch_size=16)


def test_evaluation_grades_as_the_default_reward():
    problems = tasks.make_split("eval", 4, seed=0)
    texts = [f"so #### {problems[0].answer}", f"\\boxed{{{problems[1].answer}}}",
             f"#### {problems[2].answer} or rather #### {problems[2].answer + 1}", f"{problems[3].answer}"]
    rewards = [math_verifier("", text, p.meta()) for p, text in zip(problems, texts)]
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert rl.grade(problems, texts)["accuracy"] == sum(rewards) / 4
    assert rl.grade(problems, texts)["format"] == 3 / 4
