"""Generator precisions on CUDA: bf16 everywhere, fp8 from compute capability 8.9. The
same checks as the CPU's int8 (``test_precision.py``), for the GPU check to run when a
GPU machine is lent (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llamarl.app.sampling import SamplingParams, precision, sample
from llamarl.app.sampling.kernels import FP8_MIN_CAPABILITY, DenseKernel, Fp8Kernel
from test_precision import PAD, PROMPTS, prefill_logits

pytestmark = pytest.mark.gpu

def has_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


def gpu_precisions() -> list[str]:
    return ["bf16", "fp8"] if has_fp8() else ["bf16"]


def llama() -> LlamaForCausalLM:
    """Dimensions multiples of 16 (fp8's rule): q/k/v fused is 64 + 2 x 32 wide."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=PAD)).eval().cuda()


def test_cuda_supports_bf16_and_fp8_where_the_device_has_it_but_not_int8():
    supported = precision.supported_precisions("cuda")
    assert supported[:2] == ("fp32", "bf16")
    assert ("fp8" in supported) == has_fp8()
    with pytest.raises(ValueError, match="cannot run on cuda"):
        precision.check_precision("int8", "cuda")


@pytest.mark.skipif(not has_fp8(), reason="fp8 needs compute capability >= 8.9")
def test_fp8_kernel_is_within_e4m3_rounding_of_fp32():
    """e4m3 keeps 3 mantissa bits: each operand is off by at most 2^-4 relative, so a
    product by about 2^-3, and |error| <= 2^-3 * sum_k |x_k| |w_mk| (plus bf16's output
    rounding, 2^-8 relative)."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 32, device="cuda"), torch.randn(5, 32, device="cuda")
    y = Fp8Kernel(w)(x)
    bound = 2 ** -3 * (x.abs() @ w.abs().t()) + 2 ** -8 * (x @ w.t()).abs() + 1e-4
    assert ((y - x @ w.t()).abs() <= bound).all()
    h = torch.ones(5, 48, device="cuda")
    Fp8Kernel(w).add_to_(h, x)
    assert torch.allclose(h, 1 + y)


def test_bf16_kernel_on_cuda():
    w, x = torch.randn(48, 32, device="cuda"), torch.randn(5, 32, device="cuda")
    y = DenseKernel(w, torch.bfloat16)(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, x @ w.t(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", gpu_precisions())
def test_quantized_llama_samples_on_cuda_through_both_paths(name):
    fp32, model = llama(), llama()
    weights = precision.quantize_(model, name)
    assert weights.refresh() > 0.0
    for fast_V, own_V, ref_V in prefill_logits(model, fp32, "cuda"):
        assert (fast_V - own_V).abs().max() < 0.1
        assert (own_V - ref_V).abs().max() > 1e-5
    out = sample(model, PROMPTS, SamplingParams(max_new_tokens=8), eos_id=-1, pad_id=PAD,
                 generator=torch.Generator(device="cuda").manual_seed(0))
    assert out.tokens_BT.shape == (3, 8) and torch.isfinite(out.logprobs_BT).all()
    assert (out.logprobs_BT <= 0).all()
