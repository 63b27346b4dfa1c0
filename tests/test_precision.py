"""Generator precision: what a machine supports, the int8 kernel against hand-derived
values and an error bound, and a quantized model sampling through both paths."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from llamarl.app.rl import step as rl
from llamarl.app.config import GeneratorConfig
from llamarl.app.rl.contract import Rollout
from llamarl.app.sampling import LlamaFastPath, SamplingParams, new_cache, precision, sample
from llamarl.app.sampling.kernels import DenseKernel, Int8DynamicKernel, int8_engine, int8_per_channel

PAD = 0
needs_int8 = pytest.mark.skipif(int8_engine() is None, reason="this torch build has no quantized engine")


def llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied, pad_token_id=PAD)).eval()


def gpt2() -> GPT2LMHeadModel:
    """Weights scaled up (sharper distributions, larger activations), so that int8's
    rounding moves the log-probs well above float noise."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       pad_token_id=PAD, bos_token_id=1, eos_token_id=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


PROMPTS = [[5, 9, 3, 7], [11, 2], [4, 4, 8, 1, 6, 2]]


def test_cpu_supports_fp32_bf16_and_int8_and_refuses_fp8_naming_them():
    expected = ("fp32", "bf16", "int8") if int8_engine() else ("fp32", "bf16")
    assert precision.supported_precisions("cpu") == expected
    with pytest.raises(ValueError, match=f"cannot run on cpu.*supports: {', '.join(expected)}$"):
        precision.check_precision("fp8", "cpu")
    with pytest.raises(ValueError, match=f"'int4' is not a generator precision.*supports: {', '.join(expected)}$"):
        precision.check_precision("int4", "cpu")
    precision.check_precision("fp32", "cpu")


def test_generator_config_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match="gen_precision must be one of fp32, bf16, int8, fp8"):
        GeneratorConfig(gen_precision="int4")  # type: ignore[arg-type]


def test_int8_per_channel_by_hand():
    # Row 0: amax 1 -> scale 1/127; 0.5 * 127 = 63.5 rounds to even (64), 0.25 * 127 = 31.75 -> 32.
    # Row 1 is all zeros: scale 1, nothing divided by 0.
    q = int8_per_channel(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert q.dtype == torch.qint8
    assert q.int_repr().tolist() == [[64, -127, 32], [0, 0, 0]]
    assert q.q_per_channel_scales().tolist() == pytest.approx([1 / 127, 1.0])


@needs_int8
def test_int8_kernel_is_within_the_activation_rounding_bound():
    """y = x @ (q * scale)^T up to rounding x to uint8 (per tensor, by linear_dynamic):
    each x is off by at most half its step, (max - min) / 255 (/ 127 with reduce_range),
    so |error| <= step / 2 * sum_k |W_dq[m, k]|."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 32) * 0.1, torch.randn(5, 32)
    kernel = Int8DynamicKernel(w)
    w_dq = int8_per_channel(w).dequantize()
    levels = 127 if kernel.reduce_range else 255
    step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / levels
    bound_M = step / 2 * w_dq.abs().sum(1) + 1e-5
    err_NM = (kernel(x) - x @ w_dq.t()).abs()
    assert (err_NM <= bound_M).all()
    h = torch.ones(5, 48)
    kernel.add_to_(h, x)
    assert torch.allclose(h, 1 + kernel(x))


def test_dense_bf16_kernel_rounds_weights_and_inputs_to_bf16():
    w, x = torch.tensor([[1.0 + 2 ** -10, 3.0]]), torch.tensor([[1.0, 1.0 + 2 ** -12]])
    # bf16 keeps 8 bits of mantissa: both small increments vanish, y = 1 + 3.
    assert DenseKernel(w, torch.bfloat16)(x).tolist() == [[4.0]]
    assert DenseKernel(w)(x).item() == pytest.approx(4.0 + 2 ** -10 + 3 * 2 ** -12)


@needs_int8
@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_quantize_keeps_the_parameters_the_weight_sync_writes_into(make):
    model = make()
    before = dict(model.named_parameters())
    weights = precision.quantize_(model, "int8")
    assert weights is not None and weights.layers
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    # The LM head stays fp32; every other linear layer is quantized.
    assert not isinstance(model.get_output_embeddings(), precision.QuantizedLinear)
    assert precision.quantize_(make(), "fp32") is None


@needs_int8
def test_refresh_requantizes_weights_written_in_place():
    model = gpt2()
    weights = precision.quantize_(model, "int8")
    weights.refresh()
    layer = weights.layers[0]
    x = torch.randn(3, layer.weight.shape[0])  # Conv1D: (in, out)
    y_old = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # what a swap does: a copy into the same storage
    assert torch.equal(layer(x), y_old)  # the kernel is the old version's until refresh
    assert weights.refresh() >= 0.0
    bias = layer.bias if layer.bias is not None else 0
    assert torch.allclose(layer(x) - bias, 2 * (y_old - bias), atol=0.05)


@needs_int8
def test_a_llama_builds_its_layers_kernels_only_when_its_own_forward_runs():
    """The sampler runs a Llama through the fast path's fused kernels: refresh builds
    those; the layers' own are built by the model's forward, from the same weights."""
    model = llama()
    weights = precision.quantize_(model, "int8")
    weights.refresh()
    assert weights.fast_linears is not None and all(layer.kernel is None for layer in weights.layers)
    sample(model, PROMPTS, SamplingParams(max_new_tokens=2), eos_id=-1, pad_id=PAD)
    assert all(layer.kernel is None for layer in weights.layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    assert all(layer.kernel is not None for layer in weights.layers)


@needs_int8
def test_sampling_before_refresh_is_refused():
    model = llama()
    precision.quantize_(model, "int8")
    with pytest.raises(RuntimeError, match="refresh"):
        sample(model, PROMPTS, SamplingParams(max_new_tokens=2), eos_id=-1, pad_id=PAD)


def prefill_logits(model, fp32, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per prompt, the next-token logits of the quantized ``model``'s fast path, of its own
    forward, and of the ``fp32`` model's forward."""
    P = max(len(p) for p in PROMPTS)
    prompts = sorted(PROMPTS, key=len)
    with torch.inference_mode():
        fast = LlamaFastPath(model, P + 1, precision.fast_linears(model))
        logits_UV, _, _ = fast.prefill(prompts, new_cache(model, P + 1)[0])
        return [(logits_UV[i], model(input_ids=torch.tensor([p], device=device)).logits[0, -1],
                 fp32(input_ids=torch.tensor([p], device=device)).logits[0, -1]) for i, p in enumerate(prompts)]


@needs_int8
@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_llama_fast_path_and_model_forward_sample_from_the_quantized_model(name):
    """Both paths compute with quantized kernels: their logits agree with each other to
    quantization noise, and differ from fp32's by more than the fast path's 1e-4."""
    fp32, model = llama(tied=True), llama(tied=True)
    precision.quantize_(model, name).refresh()
    for fast_V, own_V, ref_V in prefill_logits(model, fp32):
        assert (fast_V - own_V).abs().max() < 0.05
        assert (own_V - ref_V).abs().max() > 1e-4


def test_recorded_logprobs_are_the_quantized_models():
    """GPT-2 samples through its own forward: the log-probs the sampler records are those
    the bf16 model gives the tokens, not the fp32 model's. (bf16 rounds each row alone;
    int8's activation scale is one per batch, so its log-probs also move with what else
    is in the batch, and no second forward reproduces them exactly.)"""
    fp32, model = gpt2(), gpt2()
    precision.quantize_(model, "bf16").refresh()
    out = sample(model, PROMPTS, SamplingParams(max_new_tokens=6), eos_id=-1, pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    rollouts = [Rollout(prompt_ids=p, completion_ids=out.completion_ids(i), behaviour_logprobs=[], version=0)
                for i, p in enumerate(PROMPTS)]
    with torch.no_grad():
        own_BT, mask_BT = rl.completion_logprobs(model, rollouts, pad_id=PAD)
        ref_BT, _ = rl.completion_logprobs(fp32, rollouts, pad_id=PAD)
    own_gap = ((out.logprobs_BT - own_BT) * mask_BT).abs().max()
    fp32_gap = ((out.logprobs_BT - ref_BT) * mask_BT).abs().max()
    assert own_gap < fp32_gap / 10


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama-fast-path", "gpt2-own-forward"])
def test_sampling_at_a_precision_is_the_quantized_models_and_leaves_the_model_as_it_was(make):
    """The trainer's held-out evaluation at the generators' precision: inside the block
    the model samples exactly what a ``quantize_``d copy samples (same tokens, same
    log-probs); after it, the same modules and parameters, fp32 logits bit for bit."""
    model, generator_copy = make(), make()
    precision.quantize_(generator_copy, "bf16").refresh()
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    ids = [torch.tensor([p]) for p in PROMPTS]
    with torch.no_grad():
        before = [model(input_ids=x).logits for x in ids]
    modules, parameters = dict(model.named_modules()), dict(model.named_parameters())

    def draw(m):
        return sample(m, PROMPTS, params, eos_id=-1, pad_id=PAD, generator=torch.Generator().manual_seed(3))

    with precision.sampling_at(model, "bf16"):
        inside = draw(model)
    expected, fp32 = draw(generator_copy), draw(model)
    assert torch.equal(inside.tokens_BT, expected.tokens_BT)
    assert torch.equal(inside.logprobs_BT, expected.logprobs_BT)
    assert not torch.equal(inside.logprobs_BT, fp32.logprobs_BT)  # bf16 it was
    assert dict(model.named_modules()) == modules and dict(model.named_parameters()) == parameters
    assert precision.fast_linears(model) is None
    with torch.no_grad():
        assert all(torch.equal(model(input_ids=x).logits, b) for x, b in zip(ids, before))
    with precision.sampling_at(model, "fp32"):  # nothing changes
        assert dict(model.named_modules()) == modules
    with pytest.raises(ValueError, match="already runs at a precision"):
        with precision.sampling_at(generator_copy, "bf16"):
            pass
    with pytest.raises(ValueError, match="--eval-precision 'fp8' cannot run on cpu"):
        with precision.sampling_at(model, "fp8"):
            pass
