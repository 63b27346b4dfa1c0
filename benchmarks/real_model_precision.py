"""The real-model job's step time in fp32 against bf16 (trainer and generators), side by side.

    python benchmarks/real_model_precision.py --json benchmarks/results/real_model_precision.json

Runs the real-model job (``torchx run llamarl.llamarl --policy smollm2-135m-instruct``,
``components.llamarl.REAL_MODEL_JOB_ARGS``) for ``--steps`` steps with ``--train-precision
P --gen-precision P``, P alternating fp32 and bf16 for ``--rounds`` rounds, seed 0, the
held-out evaluation cut to ``--eval-size`` problems (it is not what is timed). Reports each
run's median step time (step 1, which holds start-up, left out) and the fp32 / bf16 ratio
of the medians over rounds. bf16 on a CPU is fast only where the CPU multiplies bf16
natively (AVX512-BF16 or AMX); the JSON names the CPU's flags that say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/real_model_precision.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import real_model  # noqa: E402
from llamarl.app.data import sources as data  # noqa: E402
from llamarl.components.llamarl import REAL_MODEL_JOB_ARGS, REAL_MODEL_POLICY  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def cpu_bf16_flags() -> list[str]:
    """The CPU flags (``/proc/cpuinfo``) of native bf16 arithmetic; none off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in set(flags) if "bf16" in f or f.startswith("amx"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run")
    p.add_argument("--rounds", type=int, default=1, help="fp32 and bf16 runs, alternating, per round")
    p.add_argument("--eval-size", type=int, default=10, help="held-out problems at the start and the end")
    p.add_argument("--runs-dir", default="runs/bench-real-model-precision")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    args = p.parse_args(argv)
    args.extra = ["--eval-size", str(args.eval_size)]
    data.resolve_policy(REAL_MODEL_POLICY)  # converted once, outside every run's timing
    runs: dict[str, list[dict]] = {precision: [] for precision in PRECISIONS}
    for _ in range(args.rounds):
        for precision in PRECISIONS:
            runs[precision].append(real_model.run(
                0, 1, args, ("--train-precision", precision, "--gen-precision", precision)))
    median = {precision: statistics.median(r["median_step_s"] for r in rs) for precision, rs in runs.items()}
    result = {
        "median_step_s": median, "ratio_fp32_over_bf16": median["fp32"] / median["bf16"],
        "steps": args.steps, "rounds": args.rounds, "eval_size": args.eval_size,
        "cpu_bf16_flags": cpu_bf16_flags(), "job_args": list(REAL_MODEL_JOB_ARGS), "runs": runs,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"real-model job, median step: fp32 {median['fp32']:.1f} s, bf16 {median['bf16']:.1f} s, "
          f"fp32/bf16 {result['ratio_fp32_over_bf16']:.2f}x ({args.rounds} round(s) of {args.steps} steps; "
          f"CPU bf16 flags: {', '.join(result['cpu_bf16_flags']) or 'none'})")


if __name__ == "__main__":
    main()
