"""int8 generators against fp32 ones, through the real TorchX app, with AIPO's
correction on, and with it off.

    python benchmarks/quantized.py --json benchmarks/results/quantized.json

Three runs of the same RL job (the warm-started default policy, the same seed and so the
same prompts, one trainer and one generator, one torch thread each, ``max_staleness=1``):

- ``fp32``: generators at fp32, AIPO (the baseline);
- ``int8``: generators at ``--gen-precision int8``, AIPO: the truncated ratio
  pi_fp32 / mu_int8 weighs each token;
- ``int8_no_correction``: the same with ``--no-ratio-correction`` (coefficient 1: the
  on-policy gradient applied to the int8 model's samples).

Reported per run: held-out greedy accuracy before and after (``--eval-size`` problems;
its standard error, sqrt(p (1 - p) / n), says what "within noise" means), median step
time, the generators' median quantization time per version, and the train/inference
mismatch by lag (``llamarl.app.rl.mismatch``): the mean over steps of the mean ratio, the largest
ratio, the mean share truncated and the mean KL(mu || pi). At lag 0 the weights are the
same version, so for fp32 the ratio is 1 to float noise and for int8 the gap is the
precision's. ``--repeats`` rounds of the three runs (alternating, so load hits them
alike); the table shows each run, the JSON keeps every run's per-step series too.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/quantized.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.async_vs_sync import launch, launch_parser, summarise, warm_policy  # noqa: E402
from llamarl.app import names  # noqa: E402

RUNS = {"fp32": ["--gen-precision", "fp32"], "int8": ["--gen-precision", "int8"],
        "int8_no_correction": ["--gen-precision", "int8", "--no-ratio-correction"]}


def mismatch_figures(run_dir: Path) -> dict:
    """Per lag: the step series of every mismatch statistic and their summary."""
    db = sqlite3.connect(f"file:{run_dir / 'metrics.db'}?mode=ro", uri=True)
    series: dict[str, list[float]] = {}
    for name, value in db.execute("SELECT name, value FROM scalars WHERE name >= ? AND name < ? ORDER BY step",
                                  [names.MISMATCH_PREFIX, names.MISMATCH_PREFIX[:-1] + "0"]):
        series.setdefault(name, []).append(value)
    quantize_s = [v for (v,) in db.execute("SELECT value FROM scalars WHERE name = ?", [names.WEIGHTS_QUANTIZE_S])]
    db.close()
    by_lag: dict[str, dict] = {}
    for name, values in series.items():
        lag, stat = name[len(names.MISMATCH_PREFIX):].split("/")
        summary = max(values) if stat == "ratio_max" else statistics.mean(values)
        by_lag.setdefault(lag, {"steps": len(values)})[stat] = summary
    return {"mismatch": by_lag, "quantize_s_median": statistics.median(quantize_s) if quantize_s else None,
            "series": series}


def main() -> None:
    parser = launch_parser(__doc__.splitlines()[0], "runs/bench-quantized")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three runs")
    args = parser.parse_args()
    warm_policy(args)
    results: dict[str, list[dict]] = {name: [] for name in RUNS}
    for _ in range(args.repeats):
        for name, flags in RUNS.items():
            run_dir = launch(name, 1, args, extra=flags)
            results[name].append({**summarise(run_dir), **mismatch_figures(run_dir), "flags": flags})
    acc = statistics.mean(r["acc"] for r in results["fp32"])
    se = math.sqrt(acc * (1 - acc) / args.eval_size)
    out = {"device": "cpu", "runs": results, "accuracy_standard_error": se,
           "mean_accuracy": {name: statistics.mean(r["acc"] for r in runs) for name, runs in results.items()},
           "details": {"steps": args.steps, "generators": args.generators, "eval_size": args.eval_size,
                       "max_staleness": 1, "policy": args.policy}}
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"{'run':<20}{'acc start':>10}{'acc end':>9}{'step s':>8}{'quant s':>9}"
          f"{'lag0 ratio':>11}{'lag0 max':>9}{'lag0 trunc':>11}{'lag0 KL':>10}")
    for name, runs in results.items():
        for r in runs:
            lag0 = r["mismatch"].get("lag0", {})
            quant = f"{r['quantize_s_median']:.3f}" if r["quantize_s_median"] is not None else "-"
            print(f"{name:<20}{r['acc_start']:>10.3f}{r['acc']:>9.3f}{r['median_step_s']:>8.2f}{quant:>9}"
                  f"{lag0.get('ratio_mean', float('nan')):>11.4f}{lag0.get('ratio_max', float('nan')):>9.3f}"
                  f"{lag0.get('frac_truncated', float('nan')):>11.5f}{lag0.get('kl', float('nan')):>10.2e}")
    print(f"held-out accuracy standard error ~{se:.3f} ({args.eval_size} problems); wrote {args.json}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
