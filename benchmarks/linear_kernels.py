"""Which int8 kernel a CPU generator should use: one linear layer, ``y = x @ W^T``, timed
for every candidate in the pinned torch, at the decode shapes of the sampler's Llama fast
path (fused q/k/v, o, fused gate/up, down) of the default policy and of the 30M-parameter
Llama of ``benchmarks/sampler.py --precision``, at 8, 32 and 64 rows.

Candidates: fp32 ``torch.mm`` (the baseline), bf16 ``torch.mm``, ``linear_dynamic``
(``kernels.Int8DynamicKernel``: int8 weights prepacked once, activations quantized per
call by ``torch.ops.quantized.linear_dynamic``), ``int_mm`` (activations quantized per row
by hand around ``torch._int_mm``), ``int8pack_mm`` (weight-only, ``torch._weight_int8pack_mm``),
``onednn_qlinear`` (``torch.ops.onednn.qlinear_pointwise``, activation scale per call),
and torchao's int8 dynamic-activation and weight-only configs when torchao is importable
(it is not a dependency: ``pip install torchao`` to include them). Each is timed
interleaved with the others (medians of ``--repeats``), one torch thread.

    python benchmarks/linear_kernels.py --json benchmarks/results/linear_kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from llamarl.app.sampling.kernels import DenseKernel, Int8DynamicKernel, int8_per_channel

SHAPES = {  # name: (in, out)
    "default qkv": (128, 384), "default gate_up": (128, 768),
    "large qkv": (512, 1536), "large o": (512, 512), "large gate_up": (512, 3584), "large down": (1792, 512),
}


def int_mm_kernel(w_MK: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    q = int8_per_channel(w_MK)
    w8_KM, scale_M = q.int_repr().t().contiguous(), q.q_per_channel_scales().float()

    def run(x_NK: torch.Tensor) -> torch.Tensor:
        sx_N1 = x_NK.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        x8_NK = torch.round(x_NK / sx_N1).to(torch.int8)
        return torch._int_mm(x8_NK, w8_KM).float() * sx_N1 * scale_M
    return run


def int8pack_kernel(w_MK: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    q = int8_per_channel(w_MK)
    w8_MK, scale_M = q.int_repr().contiguous(), q.q_per_channel_scales().float()
    return lambda x_NK: torch._weight_int8pack_mm(x_NK, w8_MK, scale_M)


def onednn_kernel(w_MK: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    q = int8_per_channel(w_MK)
    packed = torch.ops.onednn.qlinear_prepack(q.int_repr(), None)
    scale_M, zero_M = q.q_per_channel_scales().float(), torch.zeros(w_MK.shape[0], dtype=torch.int32)

    def run(x_NK: torch.Tensor) -> torch.Tensor:
        lo, hi = (float(v) for v in x_NK.aminmax())
        scale = (max(hi, 0.0) - min(lo, 0.0)) / 255 or 1.0
        zero = int(round(-min(lo, 0.0) / scale))
        qx = torch.clamp(torch.round(x_NK / scale) + zero, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zero, packed, scale_M, zero_M, None, 1.0, 0,
                                                  torch.float32, "none", [], "")
    return run


def torchao_kernels() -> dict[str, Callable[[torch.Tensor], Callable]]:
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        return {}

    def make(config_cls) -> Callable[[torch.Tensor], Callable]:
        def build(w_MK: torch.Tensor) -> Callable:
            layer = torch.nn.Linear(w_MK.shape[1], w_MK.shape[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(w_MK)
            quantize_(layer, config_cls())
            return layer
        return build
    return {"torchao_int8_dynamic": make(Int8DynamicActivationInt8WeightConfig),
            "torchao_int8_weight_only": make(Int8WeightOnlyConfig)}


def candidates() -> dict[str, Callable[[torch.Tensor], Callable]]:
    return {"fp32": lambda w: DenseKernel(w), "bf16": lambda w: DenseKernel(w, torch.bfloat16),
            "linear_dynamic": Int8DynamicKernel, "int_mm": int_mm_kernel, "int8pack_mm": int8pack_kernel,
            "onednn_qlinear": onednn_kernel, **torchao_kernels()}


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # qint8 deprecation, torchao notices
    torch.manual_seed(0)
    runs = []
    print(f"{'shape':<16}{'rows':>5}  " + "  ".join(f"{k:>14}" for k in candidates()) + "   (us; x = speedup vs fp32)")
    for shape, (K, M) in SHAPES.items():
        w_MK = torch.randn(M, K) * K ** -0.5
        kernels = {}
        for name, build in candidates().items():
            try:
                kernels[name] = build(w_MK)
            except (RuntimeError, NotImplementedError) as e:  # not in this build
                print(f"{name}: unavailable ({str(e).splitlines()[0][:80]})")
        for rows in args.rows:
            x_NK = torch.randn(rows, K)
            with torch.inference_mode():
                us = time_interleaved({k: (lambda f=f: f(x_NK)) for k, f in kernels.items()}, args.repeats)
            runs += [{"shape": shape, "in": K, "out": M, "rows": rows, "kernel": k, "us": v,
                      "speedup_vs_fp32": us["fp32"] / v} for k, v in us.items()]
            print(f"{shape:<16}{rows:>5}  " + "  ".join(f"{us[k]:>8.0f} {us['fp32'] / us[k]:>4.1f}x"
                                                        for k in kernels))
    result = {"device": "cpu", "torch": torch.__version__, "torch_threads": 1,
              "quantized_engine": torch.backends.quantized.engine, "repeats": args.repeats, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
