"""The trainer's pass over a batch: packed rows against padded batches, on the default task.

    python benchmarks/trainer_pass.py --json benchmarks/results/trainer_pass.json

Samples ``--batches`` batches of the default task with the warm-started default policy
and the default config (16 prompts x 8 completions, up to 48 new tokens, temperature 1),
scores them with the default reward and sets group advantages, as the trainer does. Then,
side by side on the same batches, one ``rl.train_step`` per pass (``--trainer-pass
padded`` and ``packed``), each from the same copy of the policy and a fresh AdamW,
alternating, ``--repeats`` times. Reports per pass the share of fed token slots that were
padding (over the micro-batches ``train_step`` runs) and the median step time, and the
largest difference of the loss and of the updated parameters between the passes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # `python benchmarks/trainer_pass.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.app.data import sources as data
from llamarl.app.rl import packing
from llamarl.app.rl import step as rl
from llamarl.app.rl import steps
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.model.policy import load_policy
from llamarl.app.rewards import build_reward
from benchmarks.table import Table

PASSES = ("padded", "packed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--batches", type=int, default=3, help="sampled batches, each timed in both passes")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per pass and batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def padding(chunks: list[list[rl.Rollout]], pad_id: int) -> dict[str, dict[str, int]]:
    """Token slots fed and real tokens among them, per pass, over ``chunks``."""
    out = {name: {"slots": 0, "real": 0} for name in PASSES}
    for chunk in chunks:
        rows = packing.pack(chunk, pad_id=pad_id, device=torch.device("cpu"))
        for name, slots in (("padded", packing.padded_tokens(chunk)), ("packed", rows.ids_RL.numel())):
            out[name]["slots"] += slots
            out[name]["real"] += rows.real_tokens
    return out


def sample_batches(cfg: TrainerConfig, gen: GeneratorConfig, n: int, seed: int):
    model, tokenizer = load_policy(data.resolve_policy(cfg.policy, log=print))
    prompts = data.prepare(data.read(cfg, log=print), cfg, tokenizer, log=print)
    reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s)
    reward.load()
    rng = torch.Generator().manual_seed(seed)
    batches = []
    try:
        for b in range(n):
            groups = rl.generate_groups(model, tokenizer, prompts.order.take(cfg.prompts_per_step),
                                        group_size=cfg.group_size, params=gen.sampling(), version=0, rng=rng,
                                        first_seq=b * cfg.prompts_per_step, format_prompt=prompts.format_prompt)
            rl.score_groups(groups, reward)
            usable = steps.usable(groups)
            rl.set_group_advantages(usable, normalize_std=cfg.normalize_std)
            batches.append(usable)
    finally:
        reward.close()
    return model, tokenizer, batches


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, gen = TrainerConfig(), GeneratorConfig()
    model, tokenizer, batches = sample_batches(cfg, gen, args.batches, args.seed)
    pad_id = tokenizer.pad_token_id
    step_cfgs = {name: dataclasses.replace(cfg.step_config(gen), trainer_pass=name) for name in PASSES}
    times: dict[str, list[float]] = {name: [] for name in PASSES}
    counts = {name: {"slots": 0, "real": 0} for name in PASSES}
    loss_diff = param_diff = 0.0
    for rollouts in batches:
        for name, c in padding(rl.micro_batches(rollouts, step_cfgs["packed"]), pad_id).items():
            counts[name]["slots"] += c["slots"]
            counts[name]["real"] += c["real"]
        for _ in range(args.repeats):
            results = {}
            for name in PASSES:
                m = copy.deepcopy(model)
                optimizer = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=0.0)
                t0 = time.perf_counter()
                stats = rl.train_step(m, optimizer, rollouts, step_cfgs[name], pad_id=pad_id)
                times[name].append(time.perf_counter() - t0)
                results[name] = (stats["loss"], [p.detach() for p in m.parameters()])
            loss_diff = max(loss_diff, abs(results["packed"][0] - results["padded"][0]))
            param_diff = max(param_diff, max((a - b).abs().max().item()
                                             for a, b in zip(results["packed"][1], results["padded"][1])))
    out = {
        "config": {"prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size,
                   "max_new_tokens": gen.max_new_tokens, "micro_batch": cfg.micro_batch,
                   "batches": args.batches, "repeats": args.repeats, "threads": args.threads,
                   "rollouts_per_batch": [len(b) for b in batches],
                   "mean_completion_tokens": statistics.mean(len(r.completion_ids) for b in batches for r in b)},
        **{name: {"padding_share": 1 - counts[name]["real"] / counts[name]["slots"],
                  "fed_slots": counts[name]["slots"], "real_tokens": counts[name]["real"],
                  "step_s_median": statistics.median(times[name]), "step_s": times[name]} for name in PASSES},
        "max_abs_loss_diff": loss_diff,
        "max_abs_param_diff": param_diff,
    }
    out["speedup_packed_vs_padded"] = out["padded"]["step_s_median"] / out["packed"]["step_s_median"]
    table = Table(("pass", "8"), ("padding share", ">14.1%"), ("fed slots", ">10d"), ("step s (median)", ">16.3f"),
                  sep=" ")
    print(table.header())
    for name in PASSES:
        r = out[name]
        print(table.row(name, r["padding_share"], r["fed_slots"], r["step_s_median"]))
    print(f"packed is {out['speedup_packed_vs_padded']:.2f}x the padded pass's speed; largest loss difference "
          f"{loss_diff:.2e}, parameter difference {param_diff:.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
