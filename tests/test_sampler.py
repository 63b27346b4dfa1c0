"""The sampler: log-probs agree with the trainer's forward, decoding matches ``generate``,
stopping, top-p, temperature, seeding, prefill groups and the fast paths' fallbacks."""

from __future__ import annotations

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, PreTrainedModel)

from llamarl.app.rl import step as rl
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.model.policy import build_tokenizer, encode_prompts
from llamarl.app.sampling import (KVBufferLayer, LlamaFastPath, Prefixes, SamplingParams, Samples, decode, draw,
                          generic, kv_cache, llama_fast, logits, new_cache, prefill_groups,
                          process_logits, sample, token_logprobs)

PAD = 0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tasks.corpus(0, n=300))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Six prompts of different lengths (so the batch is left-padded)."""
    problems = tasks.make_split("eval", 6, seed=0)
    texts = [tasks.format_prompt(p.question) for p in problems]
    texts[1] = "Q: How many?\nA:"  # much shorter than the rest: several prefill groups
    return encode_prompts(tokenizer, texts)


def make_model(kind: str, vocab: int) -> PreTrainedModel:
    """A tiny fp32 model with sharp output distributions (scaled-up output weights), so
    that a frequent token can serve as EOS and rows end at different steps."""
    torch.manual_seed(0)
    if kind == "llama":  # GQA: 4 query heads over 2 key/value heads
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, pad_token_id=PAD))
    elif kind.startswith("gpt2"):
        attn = "eager" if kind == "gpt2-eager" else "sdpa"
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=256, pad_token_id=PAD,
                                           attn_implementation=attn))
    elif kind == "mistral-sliding":  # a sliding-window cache: HF's DynamicCache path
        model = MistralForCausalLM(MistralConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
            max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=PAD))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def frequent_token_as_eos(model, prompts, T: int) -> int:
    """A token the seeded sampler draws for row 0 at step 3: with it as EOS, row 0 ends
    after 3 tokens and the other rows at their own times."""
    probe = sample(model, prompts, SamplingParams(max_new_tokens=T), eos_id=-1, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    return int(probe.tokens_BT[0, 2])


def trainer_logprobs(model, prompts, out: Samples, temperature: float = 1.0,
                     top_p: float = 1.0) -> torch.Tensor:
    rollouts = [rl.Rollout(prompt_ids=p, completion_ids=out.completion_ids(i),
                           behaviour_logprobs=[], version=0)
                for i, p in enumerate(prompts)]
    with torch.no_grad():
        logp_BT, _ = rl.completion_logprobs(model, rollouts, pad_id=PAD, temperature=temperature,
                                            top_p=top_p)
    return logp_BT


def check_stopping(out: Samples, eos_id: int, T: int) -> None:
    for i in range(out.tokens_BT.shape[0]):
        n = int(out.lengths_B[i])
        done = out.tokens_BT[i, :n].tolist()
        assert 1 <= n <= T
        assert eos_id not in done[:-1], "decoding went on past EOS"
        assert done[-1] == eos_id or n == T, "stopped without EOS before max_new_tokens"
        assert (out.tokens_BT[i, n:] == PAD).all() and (out.logprobs_BT[i, n:] == 0).all()


@pytest.mark.parametrize("compact_when_done, prefill_call_cost", [(0.0, 0), (0.25, 64)])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt2-eager", "mistral-sliding"])
def test_logprobs_match_trainer_forward(kind, compact_when_done, prefill_call_cost, tokenizer,
                                        prompts, monkeypatch):
    """(0.0, 0): finished rows leave the batch and cache at once, and every prompt length
    (every prompt, on the Llama fast path) is prefilled on its own; (0.25, 64): one
    prefill, and row 0, finished first, rides along to the end."""
    monkeypatch.setattr(decode, "COMPACT_WHEN_DONE", compact_when_done)
    monkeypatch.setattr(generic, "PREFILL_CALL_COST_TOKENS", prefill_call_cost)
    monkeypatch.setattr(llama_fast, "PREFILL_CHUNK_TOKENS", 1 if prefill_call_cost == 0 else 256)
    model = make_model(kind, len(tokenizer))
    T = 12
    eos = frequent_token_as_eos(model, prompts, T)
    out = sample(model, prompts, SamplingParams(max_new_tokens=T), eos_id=eos, pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    lengths = out.lengths_B.tolist()
    assert lengths[0] == 3 and max(lengths) == T, lengths  # rows end early and late
    check_stopping(out, eos, T)
    logp_BT = trainer_logprobs(model, prompts, out)
    mask = torch.arange(T)[None, :] < out.lengths_B[:, None]
    diff = (logp_BT - out.logprobs_BT[:, : logp_BT.shape[1]]).abs()[mask[:, : logp_BT.shape[1]]]
    assert diff.max() <= 1e-4, diff.max()


def test_each_model_takes_the_path_meant_for_it(tokenizer):
    llama, gpt2 = make_model("llama", len(tokenizer)), make_model("gpt2", len(tokenizer))
    mistral = make_model("mistral-sliding", len(tokenizer))
    assert LlamaFastPath.supports(llama) and not LlamaFastPath.supports(gpt2)
    assert new_cache(llama, 8)[1] and new_cache(gpt2, 8)[1]
    assert not new_cache(mistral, 8)[1]  # sliding window: HF's own cache layers


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_temperature_scales_logprobs(kind, tokenizer, prompts):
    model = make_model(kind, len(tokenizer))
    out = sample(model, prompts, SamplingParams(max_new_tokens=8, temperature=0.7), eos_id=-1,
                 pad_id=PAD, generator=torch.Generator().manual_seed(1))
    tempered = trainer_logprobs(model, prompts, out, temperature=0.7)
    assert (tempered - out.logprobs_BT).abs().max() <= 1e-4
    plain = trainer_logprobs(model, prompts, out, temperature=1.0)
    assert (plain - out.logprobs_BT).abs().max() > 1e-2  # the scaling is really there


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_equals_generate(kind, tokenizer, prompts):
    model = make_model(kind, len(tokenizer))
    T = 10
    eos = frequent_token_as_eos(model, prompts, T)
    ours = sample(model, prompts, SamplingParams(max_new_tokens=T, temperature=0), eos_id=eos,
                  pad_id=PAD)
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=T,
                             eos_token_id=eos, pad_token_id=PAD)
    ref_BT = ref[:, P:]
    assert torch.equal(ours.tokens_BT[:, : ref_BT.shape[1]], ref_BT)
    assert (ours.tokens_BT[:, ref_BT.shape[1]:] == PAD).all()
    check_stopping(ours, eos, T)
    # greedy log-probs are those of the model's (untempered) distribution
    logp_BT = trainer_logprobs(model, prompts, ours)
    assert (logp_BT - ours.logprobs_BT[:, : logp_BT.shape[1]]).abs().max() <= 1e-4


def test_stops_at_max_new_tokens(tokenizer, prompts):
    model = make_model("llama", len(tokenizer))
    out = sample(model, prompts, SamplingParams(max_new_tokens=5), eos_id=-1, pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    assert out.tokens_BT.shape == (len(prompts), 5)
    assert out.lengths_B.tolist() == [5] * len(prompts)
    assert (out.logprobs_BT < 0).all()


def test_repeated_prompts_are_sampled_independently_and_match_trainer(tokenizer, prompts):
    model = make_model("llama", len(tokenizer))
    G, T = 4, 10
    eos = frequent_token_as_eos(model, prompts, T)
    repeated = [p for p in prompts[:3] for _ in range(G)]
    out = sample(model, repeated, SamplingParams(max_new_tokens=T), eos_id=eos, pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    check_stopping(out, eos, T)
    logp_BT = trainer_logprobs(model, repeated, out)
    assert (logp_BT - out.logprobs_BT[:, : logp_BT.shape[1]]).abs().max() <= 1e-4
    for g in range(3):
        rows = {tuple(out.completion_ids(g * G + j)) for j in range(G)}
        assert len(rows) > 1, "the G samples of a prompt should not all be the same"
    greedy = sample(model, repeated, SamplingParams(max_new_tokens=T, temperature=0), eos_id=eos,
                    pad_id=PAD)
    single = sample(model, prompts[:3], SamplingParams(max_new_tokens=T, temperature=0), eos_id=eos,
                    pad_id=PAD)
    assert torch.equal(greedy.tokens_BT, single.tokens_BT.repeat_interleave(G, dim=0))


def test_seeded_generator_is_deterministic(tokenizer, prompts):
    model = make_model("gpt2", len(tokenizer))
    params = SamplingParams(max_new_tokens=8)

    def run(seed: int) -> Samples:
        return sample(model, prompts, params, eos_id=-1, pad_id=PAD,
                      generator=torch.Generator().manual_seed(seed))

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.logprobs_BT, b.logprobs_BT)
    assert not torch.equal(a.tokens_BT, c.tokens_BT)


def test_process_logits_top_p_keeps_the_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    logp = process_logits(probs.log(), temperature=1.0, top_p=0.7)
    kept = torch.isfinite(logp)
    # mass before a token must be < top_p: 0 and 0.5 pass, 0.8 and 0.95 do not
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    assert torch.allclose(logp.exp().sum(-1), torch.ones(2))
    assert torch.allclose(logp[0, :2].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    # top_p = 1 and temperature = 1 leave the distribution as it is
    assert torch.allclose(process_logits(probs.log(), 1.0, 1.0), probs.log(), atol=1e-6)
    # temperature divides the logits before the softmax
    assert torch.allclose(process_logits(probs.log(), 0.5, 1.0),
                          torch.log_softmax(probs.log() / 0.5, -1))


# Logits whose distribution at temperature 0.5 is exactly Q: by decreasing probability
# the mass before each token is 0, 0.5, 0.8, 0.95.
Q = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS_Q = 0.5 * Q.log()


@pytest.mark.parametrize("top_p, kept_mass", [(0.7, 0.8), (0.85, 0.95), (1.0, 1.0)])
def test_token_logprobs_is_the_renormalised_nucleus_probability(top_p, kept_mass):
    """Tokens inside the nucleus: log(q / mass of the nucleus), by hand; the same value
    as the distribution the sampler draws from, for any leading dimensions."""
    inside = [0, 1] if top_p == 0.7 else [0, 1, 2] if top_p == 0.85 else [0, 1, 2, 3]
    tokens = torch.tensor(inside)
    logits = LOGITS_Q.repeat(len(inside), 1)
    logp = token_logprobs(logits, tokens, 0.5, top_p)
    assert torch.allclose(logp, (Q[tokens] / kept_mass).log(), atol=1e-6)
    drawn_from = process_logits(logits, 0.5, top_p)
    assert torch.allclose(logp, drawn_from[torch.arange(len(inside)), tokens], atol=1e-6)
    assert torch.equal(token_logprobs(logits, tokens, 0.5, top_p, sampled_from_NV=drawn_from),
                       drawn_from[torch.arange(len(inside)), tokens])
    logp_BT = token_logprobs(logits.view(1, -1, 4).expand(2, -1, -1), tokens.repeat(2, 1), 0.5,
                             top_p)
    assert logp_BT.shape == (2, len(inside)) and torch.allclose(logp_BT, logp.repeat(2, 1))


def test_token_logprobs_keeps_a_token_outside_the_nucleus_with_it():
    """Nucleus {0, 1} at top-p 0.7: token 2 is renormalised over {0, 1, 2}, token 3 over
    {0, 1, 3}; finite, with the gradient of exactly that renormalised log-prob."""
    logits = LOGITS_Q.repeat(2, 1).requires_grad_()
    logp = token_logprobs(logits, torch.tensor([2, 3]), 0.5, 0.7)
    assert torch.allclose(logp, torch.tensor([0.15 / 0.95, 0.05 / 0.85]).log(), atol=1e-6)
    assert torch.isinf(process_logits(logits.detach(), 0.5, 0.7)[:, 2:]).all()
    logp.sum().backward()
    # d log(q_t / sum_kept q) / d logit = (onehot_t - q / sum_kept q on the kept set) / T
    kept = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 1]])
    onehot = torch.tensor([[0.0, 0, 1, 0], [0, 0, 0, 1]])
    renorm = Q * kept / (Q * kept).sum(-1, keepdim=True)
    assert torch.allclose(logits.grad, (onehot - renorm) / 0.5, atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 16])
def test_token_logprobs_gradient_is_that_of_its_formula(top_p, chunk_elements, monkeypatch):
    """The hand-written backward against numerical differentiation (fp64), in one chunk
    and in chunks of two rows; the values against plain autograd of the same formula."""
    monkeypatch.setattr(logits, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).requires_grad_()
    tokens_BT = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens_BT, 0.7, top_p),
                                    (logits_BTV,))
    drop = logits.outside_nucleus(logits_BTV, 0.7, top_p).scatter_(-1, tokens_BT[..., None], False)
    plain = torch.log_softmax((logits_BTV / 0.7).masked_fill(drop, float("-inf")), -1)
    expected_BT = plain.gather(-1, tokens_BT[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits_BTV, tokens_BT, 0.7, top_p), expected_BT)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_logprobs_are_the_sampled_distributions_with_top_p(kind, tokenizer, prompts):
    """At equal weights (lag 0) the trainer's log-prob of every sampled token is the
    sampler's: the AIPO ratio exp(logp - mu) is 1, with top-p cutting the tail."""
    model = make_model(kind, len(tokenizer))
    T, temperature, top_p = 10, 0.7, 0.9
    out = sample(model, prompts, SamplingParams(max_new_tokens=T, temperature=temperature,
                                                top_p=top_p),
                 eos_id=-1, pad_id=PAD, generator=torch.Generator().manual_seed(2))
    logp_BT = trainer_logprobs(model, prompts, out, temperature=temperature, top_p=top_p)
    ratio_BT = (logp_BT - out.logprobs_BT).exp()
    assert (ratio_BT - 1).abs().max() <= 1e-4, (ratio_BT - 1).abs().max()
    untruncated = trainer_logprobs(model, prompts, out, temperature=temperature)
    assert (untruncated - out.logprobs_BT).abs().max() > 1e-2  # top-p really cut mass


def test_draw_never_picks_tokens_outside_the_nucleus():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, 3.0]).repeat(4000, 1)
    logp = process_logits(logits, temperature=1.0, top_p=0.8)
    tok = draw(logp, torch.Generator().manual_seed(0))
    allowed = torch.isfinite(logp[0]).nonzero().squeeze(-1).tolist()
    assert set(tok.tolist()) == set(allowed)  # all of the nucleus, nothing else
    freq = torch.bincount(tok, minlength=6).float() / len(tok)
    assert torch.allclose(freq, logp[0].exp(), atol=0.03)


def test_sampled_tokens_lie_in_the_nucleus_end_to_end(tokenizer, prompts):
    model = make_model("llama", len(tokenizer))
    top_p, T = 0.6, 8
    out = sample(model, prompts, SamplingParams(max_new_tokens=T, top_p=top_p), eos_id=-1,
                 pad_id=PAD, generator=torch.Generator().manual_seed(0))
    P = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        seq = torch.tensor([p + out.completion_ids(i)])
        with torch.no_grad():
            logits_TV = model(input_ids=seq).logits[0, len(p) - 1: len(p) - 1 + T]
        logp_TV = process_logits(logits_TV, 1.0, top_p)
        picked = logp_TV.gather(-1, out.tokens_BT[i, :, None]).squeeze(-1)
        assert torch.isfinite(picked).all(), "a token outside the nucleus was sampled"
        assert (picked - out.logprobs_BT[i]).abs().max() <= 1e-4
        assert (~torch.isfinite(logp_TV)).any(), "top-p should have cut something here"
    assert P > min(len(p) for p in prompts)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-0.1), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_empty_prompts_raise(tokenizer):
    model = make_model("gpt2", len(tokenizer))
    with pytest.raises(ValueError):
        sample(model, [], SamplingParams(), eos_id=2, pad_id=PAD)
    with pytest.raises(ValueError):
        sample(model, [[5, 6], []], SamplingParams(), eos_id=2, pad_id=PAD)


def test_prefill_groups_cover_every_prompt_once():
    lengths = [20, 40, 21, 39, 20, 38, 5]
    groups = prefill_groups(lengths, call_cost_tokens=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) > 1  # 5 vs 40 tokens: padding everything to 40 wastes too much
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]]
    assert len(prefill_groups(lengths, call_cost_tokens=10_000)) == 1


def test_kv_buffer_layer_refuses_to_overflow():
    layer = KVBufferLayer(capacity=3)
    layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(RuntimeError, match="capacity"):
        layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))


def test_kv_buffer_layer_selects_rows_through_its_spare_buffers():
    """Shrinking, reordering and fanning out rows keep each row's own keys and values,
    with storage lent from outside and without it."""
    B, H, C, D = 4, 2, 6, 3
    for storage in (None, torch.full((2, 2, B, H, C, D), float("nan"))):
        layer = KVBufferLayer(capacity=C, storage=storage)
        keys = torch.arange(B, dtype=torch.float32).view(B, 1, 1, 1).expand(B, H, 2, D)
        layer.update(keys, -keys)
        layer.batch_select_indices(torch.tensor([3, 1]))
        assert layer.keys[:, 0, 0, 0].tolist() == [3.0, 1.0]
        assert layer.values[:, 0, 0, 0].tolist() == [-3.0, -1.0]
        layer.update(torch.full((2, H, 1, D), 7.0), torch.full((2, H, 1, D), 8.0))
        layer.batch_select_indices(torch.tensor([1, 1, 0, 0, 1]))  # more rows than storage
        assert layer.keys.shape == (5, H, 3, D)
        assert layer.keys[:, 0, 0, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 1.0]
        assert (layer.keys[:, :, 2] == 7.0).all() and (layer.values[:, :, 2] == 8.0).all()
        assert not layer.keys.isnan().any() and not layer.values.isnan().any()


def test_reused_storage_lends_one_buffer_and_falls_back_when_lent_out():
    pool = kv_cache.ReusedStorage()
    cpu = torch.device("cpu")
    with pool.lend((2, 3), torch.float32, cpu) as a:
        ptr = a.data_ptr()
        with pool.lend((2, 3), torch.float32, cpu) as b:  # a second borrower: fresh memory
            assert b.data_ptr() != ptr
    with pool.lend((3, 2), torch.float32, cpu) as c:
        assert c.data_ptr() == ptr and c.shape == (3, 2)  # reused once given back
    with pool.lend((100,), torch.float32, cpu) as d:
        assert d.shape == (100,)  # grows to the largest request
    with pool.lend(None, torch.float32, cpu) as e:
        assert e is None


@pytest.mark.parametrize("kind", ["llama", "llama-gqa-tied"])
def test_llama_fast_path_prefill_and_decode_match_the_model(kind, tokenizer, prompts):
    """Logits of the fast path against the model's own forward, prefill (each prompt's
    next token) and one decode step."""
    torch.manual_seed(0)
    tied = kind == "llama-gqa-tied"
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2 if tied else 4,
        max_position_embeddings=256, tie_word_embeddings=tied, pad_token_id=PAD,
        rope_scaling={"rope_type": "linear", "factor": 2.0} if tied else None)).eval()
    assert LlamaFastPath.supports(model)
    prompts = sorted(prompts, key=len)
    P = max(len(p) for p in prompts)
    fast = LlamaFastPath(model, P + 4)
    cache, is_fast = new_cache(model, P + 4)
    assert is_fast
    with torch.inference_mode():
        logits_UV, valid_UP, next_pos_U1 = fast.prefill(prompts, cache)
        nxt_U = logits_UV.argmax(-1)
        valid_UL = torch.cat([valid_UP, torch.ones(len(prompts), 1, dtype=torch.bool)], -1)
        step_UV = fast.decode(nxt_U, next_pos_U1.squeeze(-1), cache, fast.mask_bias(valid_UL))
        for i, p in enumerate(prompts):
            ref_TV = model(input_ids=torch.tensor([p + [int(nxt_U[i])]])).logits[0]
            assert (logits_UV[i] - ref_TV[-2]).abs().max() <= 1e-4
            assert (step_UV[i] - ref_TV[-1]).abs().max() <= 1e-4
    assert next_pos_U1.squeeze(-1).tolist() == [len(p) for p in prompts]


@pytest.mark.parametrize("decoder", ["eager", "static"])
@pytest.mark.parametrize("chunk_tokens", [512, 8])
def test_prefill_after_kept_keys_and_values_samples_what_a_whole_prefill_does(decoder, chunk_tokens, tokenizer,
                                                                              prompts, monkeypatch):
    """Prompts continuing an earlier call's (one of them repeated there), prefilled after the
    keys and values that call kept (``Prefixes``; one prompt without: prefilled whole),
    draw the tokens and record the log-probs of whole prefills, and keep theirs in turn;
    in one prefill chunk or several."""
    monkeypatch.setattr(llama_fast, "PREFILL_CHUNK_TOKENS", chunk_tokens)
    model = make_model("llama", len(tokenizer))  # GQA: the new tokens' attention groups heads
    first = prompts + [prompts[0]]
    params = SamplingParams(max_new_tokens=5)

    def run(batch, prefixes=None):
        return sample(model, batch, params, eos_id=-1, pad_id=PAD, decoder=decoder, prefixes=prefixes,
                      generator=torch.Generator().manual_seed(1))

    earlier = Prefixes([None] * len(first))
    out = run(first, earlier)
    assert [kv.shape[-2] for kv in earlier.kept] == [len(p) for p in first]
    longer = [p + out.completion_ids(i) + [5] * (i % 3) for i, p in enumerate(first)]
    past = list(earlier.kept)
    past[2] = None
    after, fresh = Prefixes(past), Prefixes([None] * len(longer))
    cont, whole = run(longer, after), run(longer, fresh)
    assert torch.equal(cont.tokens_BT, whole.tokens_BT)
    torch.testing.assert_close(cont.logprobs_BT, whole.logprobs_BT, rtol=0, atol=1e-5)
    for kept, made in zip(after.kept, fresh.kept):
        torch.testing.assert_close(kept, made, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="fewer tokens"):
        run(first, Prefixes(earlier.kept))  # a past as long as its prompt: nothing left to run


def test_fast_path_refuses_rotary_that_depends_on_the_length(tokenizer):
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=256,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert not LlamaFastPath.supports(model)


def test_reused_kv_storage_leaves_no_trace_between_calls(tokenizer, prompts, monkeypatch):
    """Sampling on storage full of NaN (left by an earlier call) gives exactly what it
    gives on fresh memory: nothing reads a position it has not written."""
    model = make_model("llama", len(tokenizer))
    params = SamplingParams(max_new_tokens=6)
    batch = [p for p in prompts for _ in range(2)]

    def run() -> Samples:
        return sample(model, batch, params, eos_id=-1, pad_id=PAD,
                      generator=torch.Generator().manual_seed(5))

    poisoned = kv_cache.ReusedStorage()
    with poisoned.lend((1_000_000,), torch.float32, torch.device("cpu")) as buf:
        buf.fill_(float("nan"))
    monkeypatch.setattr(kv_cache, "KV_STORAGE", poisoned)
    reused = run()
    monkeypatch.setattr(kv_cache, "KV_STORAGE", kv_cache.ReusedStorage())
    fresh = run()
    assert torch.isfinite(reused.logprobs_BT).all()
    assert torch.equal(reused.tokens_BT, fresh.tokens_BT)
    assert torch.equal(reused.logprobs_BT, fresh.logprobs_BT)
