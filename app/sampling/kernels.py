"""Linear kernels: ``y = x @ W^T`` for one weight matrix, at one precision.

A kernel is built once from a full-precision weight ``W`` (``(out, in)``, ``nn.Linear``'s
layout) and called many times: the sampler's Llama fast path holds one per fused matrix,
``precision.QuantizedLinear`` one per linear layer of the model's own forward. Outputs
have the inputs' dtype (fp32 in a generator) whatever the kernel computes in, so the
residual stream, norms, attention and logits keep the model's precision and only the
matmuls change.

- ``DenseKernel``: fp32 (the weight itself, no copy) or bf16 (a copy), any device.
- ``Int8DynamicKernel``: CPU. Weights int8, symmetric per output channel, prepacked once
  (``torch.ops.quantized.linear_prepack``); activations quantized per call, per tensor,
  inside ``torch.ops.quantized.linear_dynamic`` (fbgemm/x86 or qnnpack).
- ``Fp8Kernel``: CUDA with compute capability >= 8.9. Weights and activations e4m3 with
  one scale per tensor, ``torch._scaled_mm``.

Why ``linear_dynamic`` for int8 on CPU (torch 2.13; ``benchmarks/linear_kernels.py``, one
thread, at the decode shapes of the fast path's fused matrices, on this project's shared
2-core AMD EPYC; figures in benchmarks/README.md): at the 30M-parameter Llama's shapes it was the
fastest int8 kernel at 8 rows and among the fastest at 32-64, 3.5-6x fp32 ``torch.mm`` in
a quiet probe (1.2-12x under heavy load). The others: dynamic quantization written by
hand around ``torch._int_mm``, 1.5-3x (slower than ``linear_dynamic`` at 8 rows, once
ahead at 32 under load); torchao 0.18's int8 dynamic-activation config, slower than fp32
at 8 rows and at most 1.8x at 64; int8 weight-only (torchao's, and
``torch._weight_int8pack_mm``, 10-1000x slower here), no faster than fp32; oneDNN's
``qlinear_pointwise``, 0.5-3.5x, with a host sync per call for its activation scale. At
the default policy's 128-wide matrices no int8 kernel beats fp32 (0.4-0.9x): int8 pays
off from a few hundred columns on. The price: prepacking needs a ``qint8`` tensor, whose
creation torch 2.13 marks deprecated (the warning is silenced where it is made), so this
is to be measured again when the pinned torch moves.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

INT8_ENGINES = ("x86", "fbgemm", "qnnpack")
"""Quantized engines with a dynamic int8 linear kernel."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which ``torch._scaled_mm`` runs e4m3 (Ada, Hopper and later)."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


class LinearKernel(Protocol):
    def __call__(self, x_NK: torch.Tensor) -> torch.Tensor:
        """``x_NK @ W^T``, fp32 ``(N, M)``."""
        ...

    def add_to_(self, h_NM: torch.Tensor, x_NK: torch.Tensor) -> None:
        """``h_NM += x_NK @ W^T`` in place (the residual add of a decoder layer)."""
        ...

    def load_(self, other: "LinearKernel") -> None:
        """Take ``other``'s weights (a kernel of the same kind and shape, built from a
        newer version) into this kernel's own storage, in place: what a captured CUDA
        graph reads stays where it was captured (``static_decode``)."""
        ...


class DenseKernel:
    """The matmul in ``dtype``: fp32 uses the weight as given (a transposed view, no
    copy: ``torch.mm`` and ``addmm_`` as the fp32 fast path always did); bf16 a copy."""

    def __init__(self, weight_MK: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        # detach(): an fp32 kernel of a parameter is a view of it, often made in inference
        # mode, and the weight receiver then copies into the parameter in normal mode;
        # torch.compile refuses to trace such an autograd view ("a view was created in
        # inference mode and its base ... modified inplace in normal mode"), a detached
        # alias of the same storage it reads like any tensor. Kernels never take gradients.
        self.w_KM = (weight_MK.detach() if weight_MK.dtype == dtype else weight_MK.to(dtype)).t()

    def __call__(self, x_NK: torch.Tensor) -> torch.Tensor:
        if x_NK.dtype == self.w_KM.dtype:
            return torch.mm(x_NK, self.w_KM)
        return torch.mm(x_NK.to(self.w_KM.dtype), self.w_KM).to(x_NK.dtype)

    def add_to_(self, h_NM: torch.Tensor, x_NK: torch.Tensor) -> None:
        if x_NK.dtype == self.w_KM.dtype == h_NM.dtype:
            h_NM.addmm_(x_NK, self.w_KM)  # the add fused into the matmul
        else:
            h_NM.add_(self(x_NK))

    def load_(self, other: DenseKernel) -> None:
        # fp32 kernels of unfused matrices (o, down) are the parameters themselves, which
        # the weight swap has already written.
        if self.w_KM.data_ptr() != other.w_KM.data_ptr():
            self.w_KM.copy_(other.w_KM)


def int8_engine() -> str | None:
    """The quantized engine ``Int8DynamicKernel`` runs on, or None when this build has none."""
    engine = torch.backends.quantized.engine
    return engine if engine in INT8_ENGINES else None


def int8_per_channel(weight_MK: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel int8, as a ``qint8`` tensor: ``W ~= q * scale``,
    ``|q| <= 127`` (a zero row gets scale 1, so nothing divides by 0). Two passes over
    the weight (its row maxima, then the quantization), since this runs at every version."""
    w_MK = weight_MK.detach().float()
    amax_M = torch.linalg.vector_norm(w_MK, ord=float("inf"), dim=1)
    scale_M = torch.where(amax_M > 0, amax_M / 127.0, torch.ones_like(amax_M)).double()
    with warnings.catch_warnings():  # qint8 tensors are deprecated in torch 2.13: see above
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(w_MK, scale_M, torch.zeros_like(scale_M, dtype=torch.long), 0,
                                          torch.qint8)


class Int8DynamicKernel:
    """int8 weights (per output channel) prepacked once; activations quantized per call
    by ``linear_dynamic`` (per tensor, asymmetric uint8). See the module docstring."""

    def __init__(self, weight_MK: torch.Tensor) -> None:
        engine = int8_engine()
        if engine is None or weight_MK.device.type != "cpu":
            raise ValueError(f"int8 runs on CPU with a quantized engine among {INT8_ENGINES}; "
                             f"here: device {weight_MK.device}, engine {torch.backends.quantized.engine}")
        self.packed = torch.ops.quantized.linear_prepack(int8_per_channel(weight_MK), None)
        # Without VNNI, fbgemm adds pairs of uint8 x int8 products in int16: 7-bit
        # activations keep that from saturating. With VNNI (and on qnnpack) the products
        # accumulate in int32, and the 8th bit halves the activations' rounding error.
        self.reduce_range = engine in ("x86", "fbgemm") and not torch.cpu._is_vnni_supported()

    def __call__(self, x_NK: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x_NK.float(), self.packed, self.reduce_range).to(x_NK.dtype)

    def add_to_(self, h_NM: torch.Tensor, x_NK: torch.Tensor) -> None:
        h_NM.add_(self(x_NK))

    def load_(self, other: Int8DynamicKernel) -> None:
        # An opaque prepacked object: taken as it is. CPU only, where nothing is captured.
        self.packed = other.packed


class Fp8Kernel:
    """e4m3 weights and activations with one scale per tensor (rowwise scales need
    Hopper; one scale runs from Ada on), fp32 accumulation in ``torch._scaled_mm``.
    Both dimensions of the weight must be multiples of 16 (cuBLASLt's fp8 rule)."""

    def __init__(self, weight_MK: torch.Tensor) -> None:
        M, K = weight_MK.shape
        if weight_MK.device.type != "cuda" or M % 16 or K % 16:
            raise ValueError(f"fp8 needs a CUDA weight with both dimensions multiples of 16, got "
                             f"{tuple(weight_MK.shape)} on {weight_MK.device}")
        w_MK = weight_MK.detach().float()
        self.w_scale = (w_MK.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(())
        self.w_MK = (w_MK / self.w_scale).to(FP8_DTYPE)  # row-major (M, K): .t() is column-major

    def __call__(self, x_NK: torch.Tensor) -> torch.Tensor:
        x32_NK = x_NK.float()
        x_scale = (x32_NK.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(())
        x8_NK = (x32_NK / x_scale).to(FP8_DTYPE)
        # bf16 out: every cuBLASLt fp8 configuration offers it (accumulation is fp32 either way).
        y_NM = torch._scaled_mm(x8_NK, self.w_MK.t(), scale_a=x_scale, scale_b=self.w_scale,
                                out_dtype=torch.bfloat16)
        return y_NM.to(x_NK.dtype)

    def add_to_(self, h_NM: torch.Tensor, x_NK: torch.Tensor) -> None:
        h_NM.add_(self(x_NK))

    def load_(self, other: Fp8Kernel) -> None:
        self.w_MK.copy_(other.w_MK)
        self.w_scale.copy_(other.w_scale)
