"""The tables of docs/simulator.md ("At the paper's scale"), from the spec files beside this
script and the simulator (``llamarl.app.sim``):

    python examples/sim/paper_scale.py

1. each size's synchronous co-located baseline and asynchronous LlamaRL-like run, next to
   the paper's step times;
2. the same asynchronous runs with llamarl's own weight plane: its measured per-byte sync
   cost (benchmarks/results/weight_sync.json: 409.8 MB to 2 generators in 0.313 s, gloo on
   CPU, one sender) and per-step and per-batch overheads (benchmarks/simulator.py's
   calibration run);
3. what it takes to reach 10x at 70B: staleness bound, generator share, batch size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llamarl.app.sim import engine, spec
from llamarl.app.sim.calibrate import expected_longest

HERE = Path(__file__).resolve().parent
PAPER = {"8b": (22.45, 8.90), "70b": (82.32, 20.67), "405b": (635.8, 59.5)}
LLAMARL_SYNC_BYTES_PER_S = 409_801_728 / 0.313  # weight_sync.json: one sender, 2 receivers
LLAMARL_TRAINER_OVERHEAD_S = 0.02  # per step outside train and sync (calibration runs here)
LLAMARL_GEN_OVERHEAD_S = 0.002  # per generator batch outside generate


def step(s: spec.Spec, **loop_changes) -> engine.Report:
    return engine.simulate(dataclasses.replace(s.loop(), **loop_changes), seed=0)


def main() -> None:
    specs = {p.stem: spec.load(p) for p in sorted(HERE.glob("llama-*.json"))}
    print("| size | GPUs | sync (paper) | sync (sim) | async (paper) | async (sim) | speedup (paper) | speedup (sim) |")
    print("|---|---|---|---|---|---|---|---|")
    base = {}
    for size, (p_sync, p_async) in PAPER.items():
        s, a = specs[f"llama-{size}-sync"], specs[f"llama-{size}-async"]
        rs, ra = step(s), step(a)
        base[size] = (rs, ra)
        print(f"| {size.upper()} | {s.gpus} | {p_sync:.2f} | {rs.median_step_s:.2f} | {p_async:.2f} | "
              f"{ra.median_step_s:.2f} | {p_sync / p_async:.2f}x | {rs.median_step_s / ra.median_step_s:.2f}x |")

    print("\nTerms of one step (s): decode step x the longest completion waited for, training, sync")
    print("| size | mode | decode step (ms) | rows per batch | longest of a batch x step | longest of a step x step "
          "| train | sync | step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in PAPER:
        for kind in ("sync", "async"):
            s = specs[f"llama-{size}-{kind}"]
            loop = s.loop()
            rows = loop.gen_batch_prompts * loop.group_size
            tail = expected_longest(loop.lengths, rows, draws=200) * loop.gen.step_s
            whole = expected_longest(loop.lengths, s.prompts_per_step * s.group_size, draws=50) * loop.gen.step_s
            tokens = s.prompts_per_step * s.group_size * loop.lengths.capped_mean()
            report = base[size][0 if kind == "sync" else 1]
            print(f"| {size.upper()} | {kind} | {loop.gen.step_s * 1e3:.1f} | {rows} | {tail:.1f} | {whole:.1f} | "
                  f"{loop.train.seconds(int(tokens)):.1f} | "
                  f"{loop.sync.seconds(senders=loop.trainer_ranks, receivers=loop.generators):.2f} | "
                  f"{report.median_step_s:.1f} |")

    print("\nllamarl's weight plane at these scales (its measured per-byte cost and overheads)")
    print("| size | sync per step (s) | async step (s) | speedup over the sync baseline |")
    print("|---|---|---|---|")
    for size in PAPER:
        a = dataclasses.replace(specs[f"llama-{size}-async"], sync_bytes_per_s=LLAMARL_SYNC_BYTES_PER_S)
        loop = a.loop()
        loop = dataclasses.replace(loop, train=dataclasses.replace(loop.train, overhead_s=LLAMARL_TRAINER_OVERHEAD_S),
                                   gen=dataclasses.replace(loop.gen, overhead_s=LLAMARL_GEN_OVERHEAD_S))
        r = engine.simulate(loop, seed=0)
        print(f"| {size.upper()} | {loop.sync.seconds(senders=loop.trainer_ranks, receivers=loop.generators):.2f} | "
              f"{r.median_step_s:.2f} | {base[size][0].median_step_s / r.median_step_s:.2f}x |")

    print("\nTo 10x at 70B (sync baseline as above)")
    print("| change | async step (s) | speedup | idle generator / trainer |")
    print("|---|---|---|---|")
    s70, a70 = base["70b"][0], specs["llama-70b-async"]
    tries = [("as above (K=1, 4 prompts per batch: one batch a step, half the GPUs generate)", a70, {}),
             ("K=2", a70, {"max_staleness": 2}),
             ("1 prompt per batch: 4 tails a step, each of 4 rows", a70, {"gen_batch_prompts": 1}),
             ("8 prompts per batch, K=2: one tail of 32 rows per 2 steps", a70,
              {"gen_batch_prompts": 8, "max_staleness": 2}),
             ("16 prompts per batch, K=4", a70, {"gen_batch_prompts": 16, "max_staleness": 4}),
             ("16 prompts per batch, K=4, 5/8 of the GPUs generate", dataclasses.replace(a70, trainer_gpus=192),
              {"gen_batch_prompts": 16, "max_staleness": 4}),
             ("16 prompts per batch, K=4, 5/8 generate, completions cut at 2048 tokens (the baseline kept at 4096)",
              dataclasses.replace(a70, trainer_gpus=192, max_new_tokens=2048),
              {"gen_batch_prompts": 16, "max_staleness": 4})]
    for label, sp, change in tries:
        r = step(sp, **change)
        print(f"| {label} | {r.median_step_s:.2f} | {s70.median_step_s / r.median_step_s:.2f}x | "
              f"{r.idle.get('generator', 0):.2f} / {r.idle.get('trainer', 0):.2f} |")


if __name__ == "__main__":
    main()
