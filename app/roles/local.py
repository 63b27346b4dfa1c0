"""The single-process synchronous RL loop: the reference the distributed app must match.

Each step: draw prompts, sample G completions each with the current weights, score them
with the configured rewards, compute group-relative advantages, take one AIPO (or
PPO-clip) step. Held-out greedy accuracy every ``eval_every`` steps. Writes a run
directory with the same metrics as the distributed app.

    python -m llamarl.app.roles.local --steps 30
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llamarl.app import errors
from llamarl.app import cli
from llamarl.app.data import sources as data
from llamarl.app import devices
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.rl import steps
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.model.policy import load_policy
from llamarl.app.rewards import build_reward
from llamarl.app.sampling import quantize_, sampling_at


@dataclass
class LocalResult:
    run_dir: Path
    evals: list[tuple[int, dict[str, float]]]
    """(step, metrics) of every held-out evaluation, the first at step 0."""
    seconds: float


def run(cfg: TrainerConfig, gen: GeneratorConfig, *, log: Callable[[str], None] = print) -> LocalResult:
    if gen.env:
        raise errors.ConfigError("--env runs episodes in the app's generators (torchx run ... -- --env ...); "
                                 "the local loop samples single completions")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.time()
    device = devices.choose_device(cfg.device)
    dtype = devices.train_dtype(cfg.train_precision, device)
    sources = data.read(cfg, log=log)  # a bad dataset stops here, before the warm start
    policy = data.resolve_policy(cfg.policy, log=log)
    cfg = data.fit_prompt_budget(cfg, gen, policy, log=log)
    model, tokenizer = load_policy(policy, device=device)
    prompts = data.prepare(sources, cfg, tokenizer, log=log)
    ref_model = copy.deepcopy(model).eval() if cfg.kl_coef > 0 else None
    # Below fp32, rollouts come from a quantized copy, refreshed from the trained weights
    # before every step: the same behaviour policy as a generator at --gen-precision.
    gen_model = copy.deepcopy(model).eval() if gen.gen_precision != "fp32" else model
    gen_weights = quantize_(gen_model, gen.gen_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s)
    reward.load()
    config = {"mode": "local", **cli.to_dict(cfg), **cli.to_dict(gen)}
    run_dir = metrics.new_run_dir(cfg.runs_dir, cfg.run_id, config)
    writer = metrics.MetricsWriter(run_dir, run_id=run_dir.name, config=config)
    timeline = metrics.Timeline("local", busy_ends=functools.partial(devices.synchronize, device))
    sampling, step_cfg = gen.sampling(), cfg.step_config(gen)
    rng = devices.seeded_generator(device, cfg.seed)
    guard = steps.SkipGuard()
    evals: list[tuple[int, dict[str, float]]] = []

    def evaluate(step: int) -> None:
        with timeline.busy("eval"), sampling_at(model, cfg.eval_at(gen)):
            m = steps.evaluate(model, tokenizer, prompts.held_out, gen, step, prompts.format_prompt,
                               samples=cfg.eval_samples)
        evals.append((step, m))
        writer.write(steps.eval_events(m, step=step, role="trainer"))
        log(f"step {step:4d}  held-out accuracy {m['accuracy']:.3f} (greedy), "
            f"{m['sampled_accuracy']:.3f} (sampled)  format {m['format']:.3f}")

    try:
        writer.write(metrics.scalars(prompts.counts, role="trainer", step=0))
        if prompts.held_out:
            evaluate(0)
        for step in range(1, cfg.steps + 1):
            t0 = time.time()
            B = cfg.prompts_per_step
            if gen_weights is not None:
                with timeline.busy("quantize"), torch.no_grad():
                    for dst, src in zip(gen_model.parameters(), model.parameters()):
                        dst.copy_(src)
                    writer.write(metrics.scalars({names.WEIGHTS_QUANTIZE_S: gen_weights.refresh()},
                                                 role="generator", step=step - 1))
            with timeline.busy("generate"):
                groups = rl.generate_groups(gen_model, tokenizer, prompts.order.take(B),
                                            group_size=cfg.group_size, params=sampling,
                                            version=step - 1, rng=rng, first_seq=(step - 1) * B,
                                            format_prompt=prompts.format_prompt, decoder=gen.gen_decoder)
            t_gen = time.time() - t0
            with timeline.busy("reward"):
                rl.score_groups(groups, reward)
            train = None
            t1 = time.time()
            if not guard.should_skip(groups, step):
                trained = steps.usable(groups)
                rl.set_group_advantages(trained, normalize_std=cfg.normalize_std)
                with timeline.busy("train"), devices.autocast(device, dtype):
                    train = rl.train_step(model, optimizer, trained, step_cfg,
                                          pad_id=tokenizer.pad_token_id, ref_model=ref_model,
                                          policy_version=step - 1)
            t_train, step_s = time.time() - t1, time.time() - t0
            rollouts = [r for g in groups for r in g.rollouts]
            values = steps.step_values(groups=groups, train=train, t_train=t_train, step_s=step_s,
                                       consumed_version=step - 1, skipped=guard.skipped, dropped=0,
                                       idle_fraction=timeline.idle_fraction(), eos_id=tokenizer.eos_token_id)
            values.update(devices.device_metrics(device))
            values.update({names.GEN_TOKENS_PER_S: sum(len(r.completion_ids) for r in rollouts) / t_gen,
                           names.GEN_SEQS_PER_S: len(rollouts) / t_gen})
            events, values = steps.step_events(step, groups, values, consumed_version=step - 1,
                                               reward_names=reward.names, role="trainer")
            writer.write(events + timeline.drain())
            log(steps.summary(step, cfg.steps, groups, values))
            warning = steps.no_answer_warning(step, values, max_new_tokens=gen.max_new_tokens) if step == 1 else None
            if warning:
                log(f"WARNING: {warning}")
            if prompts.held_out and (step % cfg.eval_every == 0 or step == cfg.steps):
                evaluate(step)
    finally:
        writer.close(finished=True)
        reward.close()
    return LocalResult(run_dir=run_dir, evals=evals, seconds=time.time() - t_start)


def main(argv: list[str] | None = None) -> None:
    cfg, gen = cli.parse(argv, TrainerConfig, GeneratorConfig, description=__doc__.splitlines()[0],
                         prog="python -m llamarl.app.roles.local")
    try:
        result = run(cfg, gen)
    except errors.ConfigError as e:  # refused input (a dataset, a policy): its message says everything
        raise SystemExit(f"error: {e}") from None
    if not result.evals:
        print(f"done in {result.seconds:.0f}s (no held-out evaluation); run directory {result.run_dir}")
        return
    first, last = result.evals[0][1]["accuracy"], result.evals[-1][1]["accuracy"]
    print(f"done in {result.seconds:.0f}s: held-out accuracy {first:.3f} -> {last:.3f}; run directory {result.run_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
