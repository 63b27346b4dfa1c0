"""The generator's precision (``--gen-precision``): its model's linear layers computed in
fp32, bf16, int8 or fp8, rebuilt from the full-precision weights at each weight version.

The generator receives fp32 weights from the trainer (the weight plane's layout is the
trainer's) into its model's parameters, as always. ``quantize_`` then changes that
model in place: every linear layer but the LM head becomes a ``QuantizedLinear`` that
keeps the same parameters (names, storage: the weight sync goes on writing into them)
and computes with a kernel (``kernels``) built from them. ``GenWeights.refresh``, called
after each weight swap, rebuilds those kernels and the Llama fast path's fused ones, so
the model's own forward (the generic path) and the fast path sample from the same
quantized model, and the log-probs the sampler records are that model's: the trainer's
importance ratio pi_fp32 / mu_quantized carries the mismatch.

What stays fp32: embeddings, norms, rotary, attention, the LM head, the KV cache and
the logits. The matmuls of the decoder layers are where the work is (and what LlamaRL,
veRL and slime quantize); the head makes the distribution itself, so it is kept exact.

What each device runs (``supported_precisions``): fp32 everywhere; bf16 on CPU (correct
on any x86; fast where the CPU has AVX512-BF16 or AMX) and on CUDA devices with bf16;
int8 on CPU with a quantized engine (``kernels.Int8DynamicKernel``; no int8 kernel is
offered on CUDA: bf16 and fp8 are the GPU precisions); fp8 on CUDA from compute
capability 8.9. Anything else is refused at start-up with the list of what this
machine supports.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Literal, get_args

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from llamarl.app.sampling.kernels import (FP8_MIN_CAPABILITY, DenseKernel, Fp8Kernel, Int8DynamicKernel, LinearKernel,
                                  int8_engine)
from llamarl.app.sampling.llama_fast import FusedLinears, LlamaFastPath, fused_linears

GenPrecision = Literal["fp32", "bf16", "int8", "fp8"]
GEN_PRECISIONS: tuple[str, ...] = get_args(GenPrecision)

_ATTACHED = "llamarl_gen_weights"
"""The model attribute ``quantize_`` sets, as transformers marks its quantized models
(``hf_quantizer``): ``sample`` finds the fast path's kernels there."""


def supported_precisions(device: torch.device | str) -> tuple[str, ...]:
    """The generator precisions ``device`` can run, fp32 first."""
    device = torch.device(device)
    out = ["fp32"]
    if device.type == "cpu":
        out.append("bf16")
        if int8_engine() is not None:
            out.append("int8")
    elif device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            out.append("bf16")
        if torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY:
            out.append("fp8")
    return tuple(out)


def check_precision(precision: str, device: torch.device | str, flag: str = "--gen-precision") -> None:
    """``ValueError`` naming what this machine supports unless ``device`` runs ``precision``."""
    supported = supported_precisions(device)
    if precision in supported:
        return
    why = "is not a generator precision" if precision not in GEN_PRECISIONS else f"cannot run on {device}"
    raise ValueError(f"{flag} {precision!r} {why}; this machine ({torch.device(device).type}) "
                     f"supports: {', '.join(supported)}")


def make_kernel(weight_MK: torch.Tensor, precision: str) -> LinearKernel:
    """A kernel for ``weight_MK`` (``(out, in)``) at ``precision``."""
    if precision == "fp32":
        return DenseKernel(weight_MK.float())
    if precision == "bf16":
        return DenseKernel(weight_MK, torch.bfloat16)
    if precision == "int8":
        return Int8DynamicKernel(weight_MK)
    if precision == "fp8":
        return Fp8Kernel(weight_MK)
    raise ValueError(f"unknown precision {precision!r}; expected one of {GEN_PRECISIONS}")


class QuantizedLinear(nn.Module):
    """Stands in for an ``nn.Linear`` (or transformers' ``Conv1D``, which stores its
    weight transposed) of the generator's model: the same weight and bias parameters,
    a forward through a kernel built from them after each ``refresh``."""

    def __init__(self, layer: nn.Linear | Conv1D, precision: str) -> None:
        super().__init__()
        self.register_parameter("weight", layer.weight)
        self.register_parameter("bias", layer.bias)
        self.transposed = isinstance(layer, Conv1D)
        self.precision = precision
        self.refreshed = False
        self.kernel: LinearKernel | None = None

    @torch.no_grad()
    def refresh(self, *, lazy: bool = False) -> None:
        """Rebuild the kernel from the current weights, now or (``lazy``) at the next forward."""
        self.refreshed, self.kernel = True, None
        if not lazy:
            self._build()

    def _build(self) -> None:
        weight = self.weight.detach()
        self.kernel = make_kernel(weight.t() if self.transposed else weight, self.precision)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.refreshed:
            raise RuntimeError("QuantizedLinear.refresh() must run before the first forward")
        if self.kernel is None:
            self._build()
        y = self.kernel(x.reshape(-1, x.shape[-1]).contiguous())
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


class GenWeights:
    """A generator model's linear layers at ``precision``; ``refresh`` rebuilds their
    kernels from the model's full-precision weights (after each weight swap)."""

    def __init__(self, model: PreTrainedModel, precision: str) -> None:
        self.model, self.precision = model, precision
        self.layers, self._originals = _replace_linears(model, precision)
        self.fast_linears: FusedLinears | None = None
        setattr(model, _ATTACHED, self)

    def remove(self) -> None:
        """Put the model's own linear layers back: it runs at full precision again."""
        for layer, (parent, child, original) in zip(self.layers, self._originals, strict=True):
            assert getattr(parent, child) is layer, f"{child} was replaced again"
            setattr(parent, child, original)
        delattr(self.model, _ATTACHED)
        self.layers, self._originals, self.fast_linears = [], [], None

    @torch.no_grad()
    def refresh(self) -> float:
        """Quantize the current weights; returns the seconds it took. A Llama model samples
        through the fast path's fused kernels alone, so its layers' own wait until the
        model's forward is called (half the work at every version); any other model's
        are built here."""
        t0 = time.perf_counter()
        fast = LlamaFastPath.supports(self.model)
        for layer in self.layers:
            layer.refresh(lazy=fast)
        if fast:
            self.fast_linears = fused_linears(self.model, lambda w: make_kernel(w, self.precision))
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time is the kernels', not their launch's
        return time.perf_counter() - t0


def quantize_(model: PreTrainedModel, precision: str) -> GenWeights | None:
    """Run ``model``'s linear layers at ``precision`` from now on (in place; None and no
    change for fp32). Call ``refresh()`` on the result before sampling, and after every
    change of the weights."""
    check_precision(precision, next(model.parameters()).device)
    return None if precision == "fp32" else GenWeights(model, precision)


@contextmanager
def sampling_at(model: PreTrainedModel, precision: str) -> Iterator[None]:
    """``model`` samples at ``precision`` inside the block, from its current weights, and
    is the same model after it: its linear layers stand in as ``quantize_`` makes them
    (the same parameters; the kernels are the only new memory) and are put back at the
    end. The trainer's held-out evaluation runs the policy as the generators run it
    (``--eval-precision``). fp32 changes nothing."""
    if precision == "fp32":
        yield
        return
    check_precision(precision, next(model.parameters()).device, "--eval-precision")
    if getattr(model, _ATTACHED, None) is not None:
        raise ValueError("the model already runs at a precision of its own (quantize_)")
    weights = GenWeights(model, precision)
    try:
        weights.refresh()
        yield
    finally:
        weights.remove()


def fast_linears(model: PreTrainedModel) -> FusedLinears | None:
    """The fast path's kernels of a model ``quantize_`` changed; None for any other model
    (the fast path then builds fp32 ones)."""
    weights: GenWeights | None = getattr(model, _ATTACHED, None)
    if weights is None:
        return None
    if weights.fast_linears is None:
        raise RuntimeError("a quantized generator model samples before GenWeights.refresh()")
    return weights.fast_linears


def weights_stamp(model: PreTrainedModel) -> tuple:
    """Changes whenever a parameter is written in place (the weight receiver's swap) or
    rebound, or the precision's kernels are rebuilt (``GenWeights.refresh``): what the
    static decoder's fused kernels and an episode's kept keys and values were made from."""
    return (id(fast_linears(model)), *((p.data_ptr(), p._version) for p in model.parameters()))


def fast_kernel(model: PreTrainedModel) -> Callable[[torch.Tensor], LinearKernel]:
    """What builds a fast-path kernel from a full-precision weight at ``model``'s
    generator precision (fp32 for a model ``quantize_`` left alone)."""
    weights: GenWeights | None = getattr(model, _ATTACHED, None)
    if weights is None:
        return DenseKernel
    return lambda w: make_kernel(w, weights.precision)


def _replace_linears(model: PreTrainedModel, precision: str
                     ) -> tuple[list[QuantizedLinear], list[tuple[nn.Module, str, nn.Module]]]:
    head = model.get_output_embeddings()
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (nn.Linear, Conv1D)) and module is not head]
    if not targets:
        raise ValueError(f"--gen-precision {precision}: the policy ({type(model).__name__}) has no linear "
                         "layer to run at that precision")
    replaced, originals = [], []
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        quantized = QuantizedLinear(module, precision)
        setattr(parent, child, quantized)
        replaced.append(quantized)
        originals.append((parent, child, module))
    return replaced, originals
