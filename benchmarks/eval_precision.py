"""The real-model job's held-out evaluation as the trainer runs it, at fp32 and at the
generators' precision, side by side.

    python benchmarks/eval_precision.py --json benchmarks/results/eval_precision.json
    python benchmarks/eval_precision.py --problems 8 --samples 2      # the quick version

One evaluation is what ``llamarl.app.rl.steps.evaluate`` does at a checkpoint: a greedy
pass over the held-out problems and ``--samples`` sampled passes (``--eval-samples``),
here on SmolLM2-135M-Instruct with the real-model job's own flags
(``components.llamarl.REAL_MODEL_JOB_ARGS``: the shipped sample's held-out split, the chat
template and system prompt, 128 new tokens, temperature 0.7, bf16 generators). Sides:

- ``fp32_strided``: the trainer's fp32 weights, each problem's samples a held-out set apart
  (``problems * K``: what the evaluation did before; a ``sample`` call of 128 rows holds
  some problems twice and most once, so most prompts are prefilled K times);
- ``fp32``: fp32, a problem's K samples side by side (each prompt prefilled once a call);
- ``gen``: the same at the generators' precision (``--eval-precision gen``, the default:
  bf16 in the real-model job), through ``llamarl.app.sampling.sampling_at``.

The sides run in turn, ``--rounds`` times (the load of the moment falls on each); the
JSON holds each side's seconds per round, accuracies (greedy and sampled: bf16 rounding
changes some completions, fp32's two orders draw different samples) and the speedups of
the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # `python benchmarks/eval_precision.py`: the repository root, for `components`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.app import cli, devices  # noqa: E402
from llamarl.app.config import GeneratorConfig, TrainerConfig  # noqa: E402
from llamarl.app.data import sources as data  # noqa: E402
from llamarl.app.model import gguf_policy  # noqa: E402
from llamarl.app.model.policy import load_policy  # noqa: E402
from llamarl.app.rl import step as rl  # noqa: E402
from llamarl.app.rl import steps  # noqa: E402
from llamarl.app.sampling import sampling_at  # noqa: E402
from llamarl.components.llamarl import REAL_MODEL_JOB_ARGS, REAL_MODEL_POLICY  # noqa: E402
from benchmarks.real_model_precision import cpu_bf16_flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--problems", type=int, default=50, help="held-out problems (the job evaluates 100)")
    p.add_argument("--samples", type=int, default=4, help="sampled passes a problem (--eval-samples)")
    p.add_argument("--rounds", type=int, default=1, help="times each side runs, in turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer runs 1)")
    return p.parse_args(argv)


def evaluate(model, tokenizer, problems, gen: GeneratorConfig, format_prompt, *, samples: int, strided: bool,
             precision: str) -> tuple[dict[str, float], float]:
    """One evaluation at ``precision``: the trainer's own (``steps.evaluate``), or, with
    ``strided``, its passes with the sampled problems in the order before; the greedy and
    sampled accuracy and the seconds it took."""
    t0 = time.perf_counter()
    with sampling_at(model, precision):
        if strided:
            m = rl.evaluate(model, tokenizer, problems, max_new_tokens=gen.max_new_tokens, format_prompt=format_prompt)
            m["sampled_accuracy"] = rl.evaluate(
                model, tokenizer, list(problems) * samples, max_new_tokens=gen.max_new_tokens,
                temperature=gen.temperature, generator=devices.seeded_generator(torch.device("cpu"), 0),
                format_prompt=format_prompt)["accuracy"]
        else:
            m = steps.evaluate(model, tokenizer, problems, gen, 0, format_prompt, samples=samples)
    return {"greedy": m["accuracy"], "sampled": m["sampled_accuracy"]}, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, gen = cli.parse([*REAL_MODEL_JOB_ARGS, "--eval-size", str(args.problems)], TrainerConfig, GeneratorConfig)
    model, tokenizer = load_policy(gguf_policy.ensure_converted(REAL_MODEL_POLICY), device="cpu")
    run = data.load(cfg, tokenizer, log=lambda _: None)
    problems = run.held_out[: args.problems]
    sides = {"fp32_strided": (True, "fp32"), "fp32": (False, "fp32"), "gen": (False, cfg.eval_at(gen))}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    accuracy: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for name, (strided, precision) in sides.items():
            accuracy[name], s = evaluate(model, tokenizer, problems, gen, run.format_prompt, samples=args.samples,
                                         strided=strided, precision=precision)
            seconds[name].append(s)
            print(f"round {r}: {name} ({precision}) {s:.1f} s, greedy {accuracy[name]['greedy']:.3f}, "
                  f"sampled {accuracy[name]['sampled']:.3f}", file=sys.stderr, flush=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    result = {
        "policy": REAL_MODEL_POLICY, "problems": len(problems), "samples": args.samples, "rounds": args.rounds,
        "threads": args.threads, "gen_precision": cfg.eval_at(gen), "max_new_tokens": gen.max_new_tokens,
        "seconds": seconds, "median_s": median, "accuracy": accuracy,
        "speedup_adjacent": median["fp32_strided"] / median["fp32"],
        "speedup_gen_precision": median["fp32"] / median["gen"],
        "speedup_total": median["fp32_strided"] / median["gen"],
        "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
        "cpu_bf16_flags": cpu_bf16_flags(),
    }
    print(f"{len(problems)} problems x (1 greedy + {args.samples} sampled): fp32 strided {median['fp32_strided']:.1f} s, "
          f"fp32 {median['fp32']:.1f} s ({result['speedup_adjacent']:.2f}x), {cfg.eval_at(gen)} {median['gen']:.1f} s "
          f"({result['speedup_gen_precision']:.2f}x more; {result['speedup_total']:.2f}x in all)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
