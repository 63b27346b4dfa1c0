"""The policy: tokenizer, default model, Hugging Face directory round trips, and that
any local HF causal LM (here a tiny GPT-2) can be the policy of the RL loop."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from llamarl.app.model import policy
from llamarl.app.rl import step as rl
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.rewards import RewardResult, build_reward
from llamarl.app.sampling import SamplingParams


@pytest.fixture(scope="module")
def default_policy():
    return policy.create_default_policy(seed=0)


@pytest.fixture(scope="module")
def tokenizer(default_policy):
    return default_policy[1]


def _task_texts(n: int = 60) -> list[str]:
    problems = tasks.make_split("train", n, seed=5)
    return ([tasks.format_prompt(p.question) + tasks.format_completion(p) for p in problems]
            + [tasks.format_prompt(p.question) + tasks.format_shortcut_completion(p) for p in problems])


# ---- tokenizer ------------------------------------------------------------------------


def test_tokenizer_round_trips_task_text_exactly(tokenizer):
    for text in _task_texts() + ["  two  spaces\n\nand #### -1,234.5", "Q: x\nA: 1+2=3\n#### 3"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_individually(tokenizer):
    ids = tokenizer("Ava has 12345 coins.\n#### 907", add_special_tokens=False)["input_ids"]
    pieces = [p.replace("▁", "") for p in tokenizer.convert_ids_to_tokens(ids)]
    assert "".join(p for p in pieces if any(c.isdigit() for c in p)) == "12345907"
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
    # and no token of the vocabulary holds two digits
    assert not any(sum(c.isdigit() for c in tok) > 1 for tok in tokenizer.get_vocab())


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (policy.PAD, policy.BOS, policy.EOS)
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert tokenizer.padding_side == "left"
    ids = tokenizer("Q: 1", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "Q: 1"
    # the special tokens are atomic: their text encodes back to exactly one id
    for tok in (policy.PAD, policy.BOS, policy.EOS):
        assert tokenizer(tok, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(tok)]


def test_encode_prompts_prepends_bos(tokenizer):
    (ids,) = policy.encode_prompts(tokenizer, ["Q: hi\nA:"])
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == "Q: hi\nA:"


# ---- default model --------------------------------------------------------------------


def test_create_default_policy_deterministic_from_seed(default_policy):
    model, tok = default_policy
    again_model, again_tok = policy.create_default_policy(seed=0)
    other_model, _ = policy.create_default_policy(seed=1)
    assert again_tok.get_vocab() == tok.get_vocab()
    same = model.state_dict()
    assert all(torch.equal(v, again_model.state_dict()[k]) for k, v in same.items())
    assert not all(torch.equal(v, other_model.state_dict()[k]) for k, v in same.items())
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id


def _logits(model, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_save_load_round_trip_is_an_ordinary_hf_directory(default_policy, tmp_path):
    model, tok = default_policy
    path = policy.save_policy(model, tok, tmp_path / "policy")
    assert (path / "config.json").is_file()
    ids = policy.encode_prompts(tok, [tasks.format_prompt("Ava has 3 cups. How many cups does Ava have now?")])[0]
    expected = _logits(model, ids)

    loaded, loaded_tok = policy.load_policy(path)
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=0, atol=0)
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.pad_token_id == tok.pad_token_id
    assert policy.encode_prompts(loaded_tok, ["Q: 12 apples"]) == policy.encode_prompts(tok, ["Q: 12 apples"])

    # plain transformers, without llamarl.app.model.policy, reads it too
    plain = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(_logits(plain, ids), expected, rtol=0, atol=0)
    plain_tok = AutoTokenizer.from_pretrained(path)
    text = _task_texts(3)[0]
    assert plain_tok.decode(plain_tok(text, add_special_tokens=False)["input_ids"]) == text


def test_saving_and_loading_draw_no_progress_bars(default_policy, tmp_path, capfd):
    """transformers draws a bar per load and save; role logs should not carry them, and
    the caller's own setting must survive."""
    from transformers.utils import logging as hf_logging

    model, tok = default_policy
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    policy.load_policy(policy.save_policy(model, tok, tmp_path / "policy"))
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "Writing model" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()


def test_load_policy_without_config_json_gives_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        policy.load_policy(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        policy.load_policy(tmp_path / "missing")


# ---- any HF causal LM is a policy ------------------------------------------------------


def test_tiny_gpt2_is_a_policy_for_generation_and_training(tokenizer, tmp_path):
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy.save_policy(GPT2LMHeadModel(config), tokenizer, tmp_path / "gpt2")

    model, tok = policy.load_policy(tmp_path / "gpt2")
    assert isinstance(model, GPT2LMHeadModel)
    problems = tasks.make_split("train", 3, seed=0)
    groups = rl.generate_groups(model, tok, problems, group_size=2,
                                params=SamplingParams(max_new_tokens=6, temperature=1.0),
                                version=3, rng=torch.Generator().manual_seed(0), generator_id=4,
                                first_seq=10)
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 6
    assert [g.group_id for g in groups] == [(4, 10), (4, 11), (4, 12)]
    assert [r.group_id.seq for r in rollouts] == [10, 10, 11, 11, 12, 12]
    assert all(r.version == 3 and 1 <= len(r.completion_ids) <= 6 for r in rollouts)
    assert all(len(r.behaviour_logprobs) == len(r.completion_ids) for r in rollouts)
    assert all(lp <= 0 for r in rollouts for lp in r.behaviour_logprobs)

    with build_reward("math_verifier") as reward:
        rl.score_groups(groups, reward)
    assert all(r.reward in (0.0, 1.0) for r in rollouts)
    for i, r in enumerate(rollouts):  # a signal the random model cannot produce by itself
        r.result = RewardResult(float(i % 2), {})
    rl.set_group_advantages(rollouts, normalize_std=False)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = rl.train_step(model, optimizer, rollouts, rl.StepConfig(), pad_id=tok.pad_token_id)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    # the behaviour log-probs came from these very weights: ratios are 1 up to float noise
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_policy_directory_must_hold_a_causal_lm(tmp_path, tiny_policy):
    from transformers import BertConfig, LlamaConfig

    from llamarl.app.model.policy import check_causal_lm

    check_causal_lm(tiny_policy)  # the warm-started default: a LlamaForCausalLM
    with pytest.raises(ValueError, match="no config.json"):
        check_causal_lm(tmp_path)
    reward_model = tmp_path / "reward-model"
    LlamaConfig(architectures=["LlamaForSequenceClassification"]).save_pretrained(reward_model)
    with pytest.raises(ValueError, match="holds a LlamaForSequenceClassification, not a causal language model"):
        check_causal_lm(reward_model)
    encoder = tmp_path / "encoder"
    BertConfig(architectures=["BertForMaskedLM"]).save_pretrained(encoder)
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        check_causal_lm(encoder)
