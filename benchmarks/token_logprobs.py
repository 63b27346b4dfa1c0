"""The trainer's log-prob of sampled tokens: ``token_logprobs`` against plain autograd.

    python benchmarks/token_logprobs.py --json out.json                       # CPU, trainer's shape
    python benchmarks/token_logprobs.py --device cuda --shape 8 512 32000 --dtype bfloat16

Forward and backward of the log-prob of given tokens under ``softmax(logits / T)``
(``top_p`` 1 and < 1), side by side in one process: the plain formula
(``log_softmax(...).gather``, the trainer's before, which ignored top-p) and
``llamarl.app.sampling.logits.token_logprobs`` at each ``--chunk`` size (elements per chunk;
the module's default for the device when none is given). Reports the median seconds and,
on CUDA, the peak memory of each, in units of one fp32 copy of the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llamarl.app.sampling import logits as L


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", type=int, nargs=3, default=[64, 48, 300], metavar=("B", "T", "V"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk", type=int, nargs="*", default=[],
                   help="chunk sizes (elements) to try besides the module's default")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--temperature", type=float, default=0.7)
    return p.parse_args(argv)


def plain(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    z = logits.float() / temperature
    return torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1)


def measure(fn, logits, tokens, temperature, top_p, repeats, device) -> dict:
    times = []
    peak = 0
    for _ in range(repeats + 1):  # the first is a warm-up
        x = logits.detach().requires_grad_(True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn(x, tokens, temperature, top_p).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - t0)
    one_copy = logits.numel() * 4
    return {"seconds": statistics.median(times[1:]),
            "peak_fp32_copies": peak / one_copy if device.type == "cuda" else None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    B, T, V = args.shape
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((B, T, V), generator=g, device=device).mul_(3).to(getattr(torch, args.dtype))
    tokens = torch.randint(0, V, (B, T), generator=g, device=device)
    default = L.CUDA_CHUNK_ELEMENTS if device.type == "cuda" else L.CHUNK_ELEMENTS
    rows = []
    for top_p in (1.0, 0.9):
        rows.append({"impl": "plain autograd (top-p ignored)", "top_p": top_p, "chunk": None,
                     **measure(plain, logits, tokens, args.temperature, top_p, args.repeats, device)})
        for chunk in [default, *args.chunk]:
            saved = L.CHUNK_ELEMENTS, L.CUDA_CHUNK_ELEMENTS
            L.CHUNK_ELEMENTS = L.CUDA_CHUNK_ELEMENTS = chunk
            try:
                rows.append({"impl": "token_logprobs", "top_p": top_p, "chunk": chunk,
                             **measure(L.token_logprobs, logits, tokens, args.temperature, top_p,
                                       args.repeats, device)})
            finally:
                L.CHUNK_ELEMENTS, L.CUDA_CHUNK_ELEMENTS = saved
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, logits {B}x{T}x{V} {args.dtype}, temperature {args.temperature}")
    print(f"{'impl':32} {'top_p':>5} {'chunk':>10} {'ms':>9} {'peak (fp32 copies)':>19}")
    for r in rows:
        peak = "" if r["peak_fp32_copies"] is None else f"{r['peak_fp32_copies']:.2f}"
        print(f"{r['impl']:32} {r['top_p']:5.2f} {r['chunk'] or '':>10} {r['seconds'] * 1e3:9.2f} {peak:>19}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "shape": [B, T, V], "dtype": args.dtype,
                                         "temperature": args.temperature, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
