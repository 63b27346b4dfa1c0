"""Batched autoregressive sampling with a KV cache, for any Hugging Face causal LM.

Returns what RL needs and ``model.generate`` does not hand out cheaply: the log-prob of
each sampled token under the distribution it was actually drawn from (after temperature
and top-p), which the trainer uses as the behaviour policy mu in AIPO. Speed comes from
doing less per step than ``generate``.

Which code runs when (``sample`` decides, once per call):

- ``LlamaFastPath.supports(model)`` (Llama architecture, static rotary; the default
  policy): prefill and decode steps run straight from the weights
  (``llama_fast.LlamaFastPath``: fused and folded weights, packed prefill, the last
  layer's MLP only for the tokens whose logits are wanted), into a cache of
  ``KVBufferLayer``s whose storage, on CPU, is lent by ``kv_cache.KV_STORAGE`` (one
  buffer reused from call to call: fresh memory costs a page fault per 4 KiB on first
  touch). On CUDA the storage is fresh memory from torch's caching allocator.
- any other model runs its own forward (``generic``): into ``KVBufferLayer``s with a
  ready 4D decode mask when every layer is plain full attention (GPT-2, ...), prompts
  prefilled in length groups; into transformers' ``DynamicCache`` with 2D masks when
  some layer is not (sliding windows, linear attention): slower, still correct.

On CUDA a Llama-architecture model decodes through ``static_decode`` instead (the same
fast path and sampling in fixed-shape steps, captured as CUDA graphs; ``decoder`` and
``DEFAULT_DECODER`` below); on CPU, and for every other model, the eager loop runs.

Both eager paths go through the same loop (``decode.run``): identical prompts prefilled
once and fanned out, finished rows dropped from the batch and the cache, one token per step drawn
from ``logits.process_logits`` with one uniform number per row (``logits.draw``), its
log-prob recorded by ``logits.token_logprobs``, the function the trainer's
``rl.completion_logprobs`` uses too.

A generator may run its model's linear layers at another precision than fp32
(``precision.quantize_``: bf16, int8, fp8): both paths then compute with the same
quantized kernels, and the log-probs recorded are the quantized model's.

Modules: ``logits`` (the distribution and its log-probs), ``kv_cache`` (the cache, its
storage, the transformers version check), ``llama_fast``, ``generic``, ``decode``,
``static_decode``, ``kernels`` (linear kernels per precision) and ``precision`` (the
generator's precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from transformers import PreTrainedModel

from llamarl.app.errors import check_at_least
# kv_cache first: importing it checks the transformers version before anything uses it.
from llamarl.app.sampling import kv_cache
from llamarl.app.sampling import decode, precision, static_decode
from llamarl.app.sampling.decode import Samples, Then
from llamarl.app.sampling.generic import cache_kwarg, prefill_groups
from llamarl.app.sampling.kv_cache import TESTED_TRANSFORMERS, KVBufferLayer, Prefixes, ReusedStorage, new_cache
from llamarl.app.sampling.llama_fast import LlamaFastPath
from llamarl.app.sampling.logits import draw, process_logits, token_logprobs
from llamarl.app.sampling.precision import GEN_PRECISIONS, GenPrecision, GenWeights, quantize_, sampling_at

__all__ = ["SamplingParams", "Samples", "Then", "sample", "process_logits", "token_logprobs", "draw",
           "cache_kwarg", "prefill_groups", "KVBufferLayer", "Prefixes", "ReusedStorage", "new_cache",
           "LlamaFastPath", "TESTED_TRANSFORMERS", "GEN_PRECISIONS", "GenPrecision", "GenWeights",
           "quantize_", "sampling_at", "Decoder", "DEFAULT_DECODER"]

Decoder = Literal["auto", "eager", "static", "compiled"]
"""How ``sample`` decodes: ``eager`` the loop of ``decode.run``; ``static`` the
fixed-shape steps of ``static_decode`` (captured as CUDA graphs on CUDA; Llama fast
path only); ``compiled`` the same steps through ``torch.compile(mode="reduce-overhead")``
(``StaticDecoder(compiled=True)``: inductor's kernels, CUDA graphs on CUDA; fp32, bf16
and fp8); ``auto`` what ``DEFAULT_DECODER`` says for the model's device."""

DEFAULT_DECODER = {"cuda": "static", "cpu": "eager"}
"""``auto``'s choice per device type (others: eager). CUDA: static, captured (the
point of ``static_decode``; its speed-up is to be measured on a GPU,
``benchmarks/gpu_check.py``). CPU: eager, because the static steps were slower there,
side by side (``benchmarks/sampler.py --sampler captured eager ... --config default``,
default policy, 2 shared cores): 0.65x eager at 32 rows in one run, 0.94x (32 rows) and
0.76-0.89x (64 rows) in another, 0.76x and 0.62x in a third (15 repeats); at par on a random-init 60M Llama, where the matmuls
dominate (1.04x fp32, 0.94x int8, 16 rows). A CPU has no launches to save, and pays for
what static shapes add: attention over the full capacity, rows kept until the next
bucket down. Not ``compiled`` either, by the numbers: side by side with the two
(``--sampler compiled captured eager --config default --rows 32 64 --repeats 15``,
``benchmarks/results/sampler_compiled_cpu.json``) it beat the uncaptured static steps
(7667 vs 6114 tokens/s at 32 rows, 7951 vs 7095 at 64) but not the eager loop (9846
and 9649: 0.78x and 0.82x), and cost 20-33 s of compilation."""


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int = 32
    """Upper bound on generated tokens per sequence (EOS included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "max_new_tokens")
        check_at_least(self, 0, "temperature")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@torch.inference_mode()
def sample(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
           eos_id: int, pad_id: int, generator: torch.Generator | None = None,
           decoder: Decoder = "auto", then: Then | None = None, prefixes: Prefixes | None = None
           ) -> Samples | None:
    """Sample one completion per prompt (repeat a prompt G times for G samples: it is
    prefilled once). Rows stop at ``eos_id`` (kept, and counted in ``lengths_B``) or after
    ``params.max_new_tokens``; ``generator`` makes the draws reproducible (the eager and
    the static decoder use it differently: the same seed draws different samples, and
    equal greedy tokens). The ``Samples`` are returned, or, with ``then``, handed on to it
    from the decode loop as it ends (``decode.finish``) and nothing is returned.
    ``prefixes``: keys and values of the prompts' first tokens, kept from an earlier call
    with the same weights, and those of every prompt kept for a later one (``Prefixes``;
    the Llama fast path only: other models prefill whole prompts and keep none)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    weight = next(model.parameters())
    if decoder == "auto":
        decoder = "static" if (DEFAULT_DECODER.get(weight.device.type) == "static"
                               and LlamaFastPath.supports(model)) else "eager"
    if decoder in ("static", "compiled"):
        return static_decode.decoder_for(model, compiled=decoder == "compiled").run(
            prompts, params, eos_id=eos_id, pad_id=pad_id, generator=generator, then=then, prefixes=prefixes)
    if decoder != "eager":
        raise ValueError(f"decoder must be one of {', '.join(get_args(Decoder))}; got {decoder!r}")
    B, T = len(prompts), params.max_new_tokens
    P = max(len(p) for p in prompts)
    fast_path = (LlamaFastPath(model, P + T, precision.fast_linears(model))
                 if LlamaFastPath.supports(model) else None)
    shape = fast_path.storage_shape(B, P + T) if fast_path is not None else None
    with kv_cache.KV_STORAGE.lend(shape, weight.dtype, weight.device) as storage:
        cache, fast = new_cache(model, P + T, storage)
        return decode.run(model, prompts, params, cache, fast=fast, fast_path=fast_path if fast else None,
                          eos_id=eos_id, pad_id=pad_id, generator=generator, then=then, prefixes=prefixes)
