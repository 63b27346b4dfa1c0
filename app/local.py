"""The single-process synchronous RL loop: the reference the distributed app must match.

Each step: draw prompts, sample G completions each with the current weights, score them
with the configured rewards, compute group-relative advantages, take one AIPO (or
PPO-clip) step. Held-out greedy accuracy every ``eval_every`` steps. Writes a run
directory with the same metrics as the distributed app.

    python -m app.local --steps 30
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from app import cli, metrics, rl, tasks
from app.config import GeneratorConfig, TrainerConfig, parse_levels
from app.policy import load_policy
from app.rewards import (build_reward, exit_without_teardown_if_calls_hang, quarantine_counts,
                         reward_events)
from app.warmstart import ensure_warmstart


def resolve_policy(spec: str, *, log: Callable[[str], None] = print) -> Path:
    return ensure_warmstart(log=log) if spec == "warmstart" else Path(spec)


@dataclass
class LocalResult:
    run_dir: Path
    evals: list[tuple[int, dict[str, float]]]
    """(step, metrics) of every held-out evaluation, the first at step 0."""
    seconds: float


def train_problems(cfg: TrainerConfig) -> list[tasks.Problem]:
    n = cfg.steps * cfg.prompts_per_step
    return tasks.make_split("train", n, seed=cfg.seed + 1, levels=parse_levels(cfg.levels))


def eval_problems(cfg: TrainerConfig) -> list[tasks.Problem]:
    return tasks.make_split("eval", cfg.eval_size, seed=cfg.seed, levels=parse_levels(cfg.levels))


def run(cfg: TrainerConfig, gen: GeneratorConfig, *, log: Callable[[str], None] = print) -> LocalResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.time()
    model, tokenizer = load_policy(resolve_policy(cfg.policy, log=log))
    ref_model = copy.deepcopy(model).eval() if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s)
    reward.load()
    run_dir = metrics.new_run_dir(cfg.runs_dir, cfg.run_id, {"mode": "local", **cli.to_dict(cfg), **cli.to_dict(gen)})
    writer = metrics.MetricsWriter(run_dir, run_id=run_dir.name,
                                   config={"mode": "local", **cli.to_dict(cfg), **cli.to_dict(gen)})
    timeline = metrics.Timeline("local")
    problems, held_out = train_problems(cfg), eval_problems(cfg)
    sampling, step_cfg = gen.sampling(), cfg.step_config(gen.temperature)
    rng = torch.Generator().manual_seed(cfg.seed)
    evals: list[tuple[int, dict[str, float]]] = []

    def evaluate(step: int) -> None:
        with timeline.busy("eval"):
            m = rl.evaluate(model, tokenizer, held_out, max_new_tokens=gen.max_new_tokens)
            sampled = rl.evaluate(model, tokenizer, held_out, max_new_tokens=gen.max_new_tokens,
                                  temperature=gen.temperature, generator=torch.Generator().manual_seed(step))
        m["sampled_accuracy"] = sampled["accuracy"]
        evals.append((step, m))
        writer.write(metrics.scalars({f"eval/{k}": v for k, v in m.items()}, role="trainer", step=step))
        log(f"step {step:4d}  held-out accuracy {m['accuracy']:.3f} (greedy), "
            f"{m['sampled_accuracy']:.3f} (sampled)  format {m['format']:.3f}")

    def maybe_evaluate(step: int) -> None:
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate(step)

    try:
        evaluate(0)
        for step in range(1, cfg.steps + 1):
            t0 = time.time()
            batch = problems[(step - 1) * cfg.prompts_per_step: step * cfg.prompts_per_step]
            with timeline.busy("generate"):
                rollouts = rl.generate_rollouts(model, tokenizer, batch, group_size=cfg.group_size,
                                                params=sampling, version=step - 1, generator=rng,
                                                group_prefix=f"{step}/")
            t_gen = time.time() - t0
            with timeline.busy("reward"):
                results = rl.score_rollouts(rollouts, reward)
            kept = [r for r in rollouts if r.reward is not None]
            if not kept:  # nothing to learn from; the quarantine counts still reach the metrics
                writer.write(reward_events(results, reward.names, step, role="trainer") + timeline.drain())
                log(f"step {step:4d}/{cfg.steps}  skipped: every rollout was quarantined "
                    f"{dict(quarantine_counts(results))}")
                maybe_evaluate(step)
                continue
            adv_metrics = rl.set_group_advantages(kept, normalize_std=cfg.normalize_std)
            t1 = time.time()
            with timeline.busy("train"):
                step_metrics = rl.train_step(model, optimizer, kept, step_cfg, pad_id=tokenizer.pad_token_id,
                                             ref_model=ref_model)
            t_train, step_s = time.time() - t1, time.time() - t0
            gen_tokens = sum(len(r.completion_ids) for r in rollouts)
            train_tokens = sum(len(r.completion_ids) for r in kept)
            values = {**step_metrics, **adv_metrics,
                      "gen/tokens_per_s": gen_tokens / t_gen, "gen/seqs_per_s": len(rollouts) / t_gen,
                      "train/tokens_per_s": train_tokens / t_train, "train/samples_per_s": len(kept) / t_train,
                      "train/step_s": step_s, "train/steps_per_min": 60.0 / step_s,
                      "staleness/mean": 0.0, "staleness/max": 0.0, "dropped_stale": 0.0,
                      "idle_fraction": timeline.idle_fraction()}
            values = {("aipo/" + k if k in ("ratio_mean", "ratio_max", "frac_truncated") else k): v
                      for k, v in values.items()}
            events = metrics.scalars(values, role="trainer", step=step)
            events += reward_events(results, reward.names, step, role="trainer")
            events += [metrics.staleness(step, r.version, 0, True) for r in kept]
            events += timeline.drain()
            writer.write(events)
            log(f"step {step:4d}/{cfg.steps}  reward {sum(r.reward for r in kept) / len(kept):.3f}  "
                f"loss {step_metrics['loss']:+.4f}  len {step_metrics['response_len']:.1f}  "
                f"quarantined {sum(quarantine_counts(results).values())}  {step_s:.1f}s")
            maybe_evaluate(step)
    finally:
        writer.close(finished=True)
        reward.close()
    return LocalResult(run_dir=run_dir, evals=evals, seconds=time.time() - t_start)


def main(argv: list[str] | None = None) -> None:
    cfg, gen = cli.parse(argv, TrainerConfig, GeneratorConfig, description=__doc__.splitlines()[0])
    result = run(cfg, gen)
    first, last = result.evals[0][1]["accuracy"], result.evals[-1][1]["accuracy"]
    print(f"done in {result.seconds:.0f}s: held-out accuracy {first:.3f} -> {last:.3f}; run directory {result.run_dir}")
    exit_without_teardown_if_calls_hang()


if __name__ == "__main__":
    main(sys.argv[1:])
