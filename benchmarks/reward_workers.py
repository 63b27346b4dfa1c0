"""What a worker process costs a reward: per-sample scoring time inline vs in a worker,
and the time to start a worker.

The component is the documented user reward ``examples.my_reward:brevity`` (a cheap
module-level function: a regex for the answer and a word count, a few microseconds), so
the difference between the two sides is the worker's inter-process cost: one JSON
request per batch, one JSON line back per sample (flushed at once, so that each sample
can be held to its own deadline), the parent's poll and read. The samples are 1024
held-out problems with their worked solutions as completions.

Both sides score the same samples in batches of ``--batch`` (1024: one call for all; 8:
one call per group of 8, the trainer's inline scoring shape), interleaved (inline,
worker, inline, ...) so that noise from other processes hits both alike; medians of
``--repeats`` are reported. Start time: ``CompositeReward.load()`` of a fresh composite
(spawn a Python, import ``llamarl.app.rewards``, unpickle the component, answer ready), then
``close()``, repeated.

    python benchmarks/reward_workers.py --json out.json [--samples 1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/reward_workers.py`: the repository root, for `examples.*`, `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.app.tasks import arithmetic as tasks# noqa: E402
from llamarl.app.rewards import Component, CompositeReward, Sample  # noqa: E402
from examples.my_reward import brevity  # noqa: E402
from benchmarks.table import Table  # noqa: E402


def make_samples(n: int) -> list[Sample]:
    return [Sample(tasks.format_prompt(p.question), " " + tasks.format_completion(p),
                   {"answer": p.answer, "solution": p.solution, "level": p.level})
            for p in tasks.make_split("eval", n, seed=0)]


def per_sample_us(reward: CompositeReward, samples: list[Sample], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(samples), batch):
        results = reward.score(samples[i:i + batch])
        assert all(r.quarantined is None for r in results), results[0]
    return (time.perf_counter() - t0) / len(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8],
                    help="batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    samples = make_samples(args.samples)
    inline = CompositeReward([Component(name="brevity", fn=brevity, inline=True)])
    worker = CompositeReward([Component(name="brevity", fn=brevity)])
    worker.load()
    rows = []
    for batch in args.batches:
        per_sample_us(inline, samples, batch), per_sample_us(worker, samples, batch)  # warm-up
        times: dict[str, list[float]] = {"inline": [], "worker": []}
        for _ in range(args.repeats):
            times["inline"].append(per_sample_us(inline, samples, batch))
            times["worker"].append(per_sample_us(worker, samples, batch))
        inline_us, worker_us = statistics.median(times["inline"]), statistics.median(times["worker"])
        rows.append({"batch": batch, "inline_us_per_sample": inline_us, "worker_us_per_sample": worker_us,
                     "worker_overhead_us_per_sample": worker_us - inline_us,
                     "worker_ms_per_batch": worker_us * min(batch, len(samples)) / 1e3, "runs": times})
    worker.close()

    starts = []
    for _ in range(args.repeats):
        reward = CompositeReward([Component(name="brevity", fn=brevity)])
        t0 = time.perf_counter()
        reward.load()
        starts.append(time.perf_counter() - t0)
        reward.close()
    summary = {"samples": len(samples), "repeats": args.repeats, "component": "examples.my_reward:brevity",
               "by_batch": rows, "worker_start_s": statistics.median(starts), "worker_start_runs_s": starts}

    table = Table(("batch", ">6"), ("inline us/sample", ">17.1f"), ("worker us/sample", ">17.1f"),
                  ("overhead us", ">12.1f"), ("worker ms/batch", ">16.2f"), sep=" ")
    print(table.header())
    for r in rows:
        print(table.row(r["batch"], r["inline_us_per_sample"], r["worker_us_per_sample"],
                        r["worker_overhead_us_per_sample"], r["worker_ms_per_batch"]))
    print(f"worker start (load(): spawn, import, ready): median {summary['worker_start_s'] * 1e3:.0f} ms "
          f"over {args.repeats}")
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
