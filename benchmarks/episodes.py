"""Multi-turn episodes with a tool: accuracy, async with a slow tool, generator tokens/s.

    python benchmarks/episodes.py --json out.json
    python benchmarks/episodes.py --only throughput --json out.json   # part 3 alone
    python benchmarks/episodes.py --only latency --json out.json      # part 2 alone

Three measurements, each side by side in one run on this machine:

1. **Tool vs no tool.** Runs of the real TorchX app with the same seed, steps and
   samples, on the built-in arithmetic task's hardest level (level 3: three chained
   operations) as an environment (``BenchCalculator``): ``tool``, the tiny policy's tool
   warm start (``llamarl.app.envs.tool_warmstart``: worked solutions and calculator calls)
   with the ``calculate`` tool described to it; ``no_tool``, the plain warm start (worked
   solutions only: the policy that does the sums in its head best) without it; and
   ``no_tool_same_start``, the tool warm start without the tool (the same environment,
   ``tool=false``). Each run's final checkpoint then plays the same held-out rows (greedy,
   one episode per row, up to ``--max-turns`` turns) with its own condition's
   environment: ``acc_tool``, ``acc_no_tool``, ``acc_no_tool_same_start`` and ``acc_se``
   (the largest binomial standard error of them).
2. **Async vs sync with a variable tool latency, beside single-turn.** App runs with
   ``max_staleness`` 0 (generate, train, sync) and ``--bound`` (default 1), of two
   workloads with the same settings: episodes whose every environment step sleeps a
   uniform 0 to ``--max-sleep-ms`` ms first (``BenchCalculator(max_sleep_ms=...)``, the
   tool's latency), and single-turn completions of the same level's problems (no
   environment); ``--pairs`` pairs of each, alternating: ``async_speedup_tool_latency``
   and ``async_speedup_single_turn`` = the median over pairs of sync median step time /
   async (``pair_speedups``, ``single_turn_pair_speedups`` each).
3. **Generator tokens/s.** In this process (``--threads`` torch threads), the policy
   plays ``--rows`` episodes at once through the episode runner under each of
   ``EPISODE_RUNS`` (each episode's keys and values kept between its turns, the default,
   and not: every turn prefilling its whole sequence), then ``sample`` writes single-turn
   completions of the same total length (the episodes' mean completion tokens, no EOS
   stop) for the same prompts: tokens per second of each (every completion token
   counted, environment tokens too), ``--repeats`` interleaved rounds after an untimed
   one, medians.

``--only`` runs some parts alone (``throughput`` takes a minute or less).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # `python benchmarks/episodes.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.app.envs.builtins import Calculator  # noqa: E402
from llamarl.app.envs.protocol import Step  # noqa: E402

ENV = "benchmarks.episodes:BenchCalculator"
LEVEL = 3  # the built-in task's hardest level: three chained operations
ROOT = Path(__file__).resolve().parents[1]


class BenchCalculator(Calculator):
    """The calculator environment on one arithmetic level, with or without its tool, each
    step first sleeping a uniform ``0..max_sleep_ms`` ms (a tool of variable latency)."""

    def __init__(self, *, tool: bool = True, level: int = LEVEL, max_sleep_ms: int = 0) -> None:
        super().__init__(levels=(level,))
        if not tool:
            self.tools = ()
        self.max_sleep_ms = max_sleep_ms
        self._rng = random.Random()

    def step(self, turn: str) -> Step:
        if self.max_sleep_ms:
            time.sleep(self._rng.uniform(0, self.max_sleep_ms) / 1000)
        return super().step(turn)


def spec(**options: Any) -> str:
    return f"{ENV}({','.join(f'{k}={str(v).lower()}' for k, v in options.items())})"


def launch(name: str, env: str, max_staleness: int, args: argparse.Namespace, policy: str) -> Path:
    from torchx.runner import get_runner
    from torchx.specs import AppState

    from benchmarks import apps

    options = ["--num_generators", "1", "--steps", str(args.steps), "--max_staleness", str(max_staleness),
               "--runs_dir", args.runs_dir, "--threads", "1", "--policy", policy]
    # ``env`` None: single-turn completions of the same level's problems, no environment.
    task = (["--env", env, "--rewards", "env_reward", "--max-turns", str(args.max_turns),
             "--max-episode-tokens", str(args.max_episode_tokens)] if env else ["--levels", str(LEVEL)])
    flags = [*task, "--max-new-tokens", str(args.max_new_tokens),
             "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
             "--gen-batch-prompts", str(args.gen_batch_prompts or args.prompts_per_step), "--seed", str(args.seed),
             "--eval-every", str(args.steps), "--eval-size", "20", "--save-every", str(args.steps)]
    t0 = time.time()
    with get_runner() as runner:
        # The roles import this module by ``ENV``: the repository root goes on their path.
        path = ":".join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
        handle = apps.start(runner, options, flags, log_dir=f"{args.runs_dir}/torchx-logs",
                            env={"PYTHONPATH": path})
        state = apps.wait(runner, handle, args.timeout_s).state
        if state != AppState.SUCCEEDED:
            raise RuntimeError(f"{name} run ended {state}: see {args.runs_dir}/torchx-logs")
    print(f"{name}: finished in {time.time() - t0:.0f} s", file=sys.stderr)
    return Path(args.runs_dir) / handle.rsplit("/", 1)[-1]


def run_summary(run_dir: Path) -> dict[str, Any]:
    from llamarl.app import names

    db = sqlite3.connect(f"file:{run_dir / 'metrics.db'}?mode=ro", uri=True)
    step_s = [v for (v,) in db.execute("SELECT value FROM scalars WHERE name = ? ORDER BY step", [names.TRAIN_STEP_S])]
    env = dict(db.execute("SELECT name, max(value) FROM scalars WHERE role = 'generator' AND name LIKE 'env/%' "
                          "GROUP BY name").fetchall())
    db.close()
    return {"run_dir": str(run_dir), "median_step_s": statistics.median(step_s[1:] or step_s), "env": env}


def _runner(policy: Path | str, env: BenchCalculator, args: argparse.Namespace, model_tokenizer=None, **gen: Any):
    from llamarl.app.config import GeneratorConfig
    from llamarl.app.envs.episodes import EpisodeRunner
    from llamarl.app.envs.slots import step_workers
    from llamarl.app.model.policy import load_policy

    model, tokenizer = model_tokenizer or load_policy(policy)
    cfg = GeneratorConfig(max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens,
                          max_new_tokens=args.max_new_tokens, **gen)
    return EpisodeRunner(model, tokenizer, lambda: BenchCalculator(tool=bool(env.tools)), cfg, greedy=True,
                         workers=step_workers(max(args.rows, args.eval_rows)))


def held_out_accuracy(policy: Path, tool: bool, args: argparse.Namespace) -> dict[str, float]:
    """Greedy, one episode per held-out row, with the condition's environment."""
    env = BenchCalculator(tool=tool)
    runner = _runner(policy, env, args)
    try:
        rows = env.rows("test", args.eval_rows, seed=args.seed)
        groups = runner.run(rows, group_size=1, version=lambda: 0)
    finally:
        runner.close()
    rewards = [sum(ep.rewards) for g in groups for ep in g]
    acc = sum(rewards) / len(rewards)
    return {"acc": acc, "se": math.sqrt(acc * (1 - acc) / len(rewards)), "n": len(rewards),
            "tool_calls": runner.stats.tool_calls, "turns": runner.stats.turns}


EPISODE_RUNS: dict[str, dict[str, Any]] = {
    "episode_before": {"episode_kv_cache_mb": 0.0},  # every turn prefills its whole sequence
    "episode": {},  # the default: keys and values kept between an episode's turns
}
"""The episode runner's settings the tokens/s figure compares (``GeneratorConfig`` fields)."""


def tokens_per_s(policy: Path | str, args: argparse.Namespace) -> dict[str, Any]:
    """Episodes in flight, under each of ``EPISODE_RUNS``, vs single-turn sampling of the
    same total length (see the module): ``--repeats`` rounds of them all in turn after one
    untimed round, each figure the median."""
    import torch

    from llamarl.app.model.policy import load_policy
    from llamarl.app.sampling import SamplingParams, sample

    torch.set_num_threads(args.threads)
    env = BenchCalculator()
    model_tokenizer = load_policy(policy)
    rows = env.rows("train", args.rows, seed=args.seed)

    def episodes(cfg: dict[str, Any]) -> tuple[float, list]:
        runner = _runner(policy, env, args, model_tokenizer, **cfg)
        runner.temperature = 1.0
        try:
            t0 = time.perf_counter()
            groups = runner.run(rows, group_size=1, version=lambda: 0, rng=torch.Generator().manual_seed(args.seed))
            seconds = time.perf_counter() - t0
        finally:
            runner.close()
        return seconds, [(ep, runner.stats) for g in groups for ep in g]

    def single_turn(prompts: list[list[int]], length: int) -> tuple[float, int]:
        model, tokenizer = model_tokenizer
        t0 = time.perf_counter()
        out = sample(model, prompts, SamplingParams(max_new_tokens=length, temperature=1.0), eos_id=-1,
                     pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(args.seed))
        return time.perf_counter() - t0, int(out.lengths_B.sum())

    rates: dict[str, list[float]] = {f"{name}_tokens_per_s": [] for name in [*EPISODE_RUNS, "single_turn"]}
    counts: dict[str, list[int]] = {k: [] for k in rates}
    turns = []
    for repeat in range(args.repeats + 1):  # the first, untimed: one-time costs (allocations, threads)
        for name, cfg in EPISODE_RUNS.items():
            seconds, played = episodes(cfg)
            tokens = sum(len(ep.ids) for ep, _ in played)
            if repeat:
                rates[f"{name}_tokens_per_s"].append(tokens / seconds)
                counts[f"{name}_tokens_per_s"].append(tokens)
                turns.append(played[0][1].turns / len(played))
        prompts = [ep.prompt_ids for ep, _ in played]
        seconds, tokens = single_turn(prompts, max(1, round(tokens / len(played))))
        if repeat:
            rates["single_turn_tokens_per_s"].append(tokens / seconds)
            counts["single_turn_tokens_per_s"].append(tokens)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rates.items()}
    out.update({k.replace("_per_s", ""): statistics.median(v) for k, v in counts.items()})
    out.update(episodes=len(played), mean_turns=statistics.mean(turns), repeats=args.repeats,
               episode_speedup=out["episode_tokens_per_s"] / out["episode_before_tokens_per_s"],
               episode_vs_single_turn=out["episode_tokens_per_s"] / out["single_turn_tokens_per_s"],
               episode_before_vs_single_turn=out["episode_before_tokens_per_s"] / out["single_turn_tokens_per_s"],
               per_repeat=rates)
    return out


def speed_line(speed: dict[str, Any]) -> str:
    runs = ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.0f}" for k, v in speed.items()
                     if k.endswith("_tokens_per_s"))
    return (f"generator tokens/s (medians of {speed['repeats']}): {runs}; episodes vs single-turn "
            f"{speed['episode_vs_single_turn']:.2f}x (before: {speed['episode_before_vs_single_turn']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--gen-batch-prompts", type=int, default=None,
                        help="groups a generator keeps in flight (default: one step's, --prompts-per-step; "
                             "more puts the next step's slots beside the current step's, which then end later)")
    parser.add_argument("--max-turns", type=int, default=3)
    # A level-3 worked solution is about 30 tokens (one per digit): the no-tool condition
    # needs room to write it.
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-episode-tokens", type=int, default=96)
    parser.add_argument("--max-sleep-ms", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=3,
                        help="sync/async pairs of runs of each workload (the slow tool, single-turn), alternating")
    parser.add_argument("--bound", type=int, default=1, help="the async runs' max_staleness")
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--rows", type=int, default=32, help="episodes in flight for the tokens/s figure")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds of the tokens/s figure")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the tokens/s figure (the app runs' generators have 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="warmstart", help="a policy directory; 'warmstart': the tool warm start")
    parser.add_argument("--plain-policy", default="warmstart",
                        help="the no-tool run's policy directory; 'warmstart': the plain warm start")
    parser.add_argument("--runs-dir", default="runs/bench-episodes")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--only", default="",
                        help="comma-separated parts to run (accuracy, latency, throughput; default all); "
                             "throughput alone takes a minute or less")
    args = parser.parse_args()
    if args.policy == "warmstart":
        from llamarl.app.envs.tool_warmstart import ensure_tool_warmstart
        args.policy = str(ensure_tool_warmstart().resolve())
    if args.plain_policy == "warmstart":
        from llamarl.app.rl.warmstart import ensure_warmstart
        args.plain_policy = str(ensure_warmstart().resolve())

    parts = {"accuracy": accuracy, "latency": latency, "throughput": throughput}
    result: dict[str, Any] = {"details": {"args": {k: v for k, v in vars(args).items() if k != "json"}}}
    for name in (args.only.split(",") if args.only else parts):
        if name not in parts:
            raise SystemExit(f"--only: unknown part {name!r} (known: {', '.join(parts)})")
        out = parts[name](args)
        result["details"].update(out.pop("details", {}))
        result.update(out)
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.json}")


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: tool vs no tool, held-out accuracy after the same steps."""
    runs = {name: run_summary(launch(name, env, 1, args, policy)) for name, env, policy in [
        ("tool", spec(tool=True), args.policy), ("no_tool", spec(tool=False), args.plain_policy),
        ("no_tool_same_start", spec(tool=False), args.policy)]}
    acc = {name: held_out_accuracy(Path(runs[name]["run_dir"]) / "checkpoints" / f"step-{args.steps}",
                                   name == "tool", args) for name in runs}
    out = {"acc_tool": acc["tool"]["acc"], "acc_no_tool": acc["no_tool"]["acc"],
           "acc_no_tool_same_start": acc["no_tool_same_start"]["acc"], "acc_se": max(a["se"] for a in acc.values()),
           "details": {"held_out": acc, "accuracy_runs": runs}}
    print(f"held-out accuracy (level {LEVEL}, {args.eval_rows} rows): tool {out['acc_tool']:.3f}, "
          f"no tool {out['acc_no_tool']:.3f}, the tool's start without it "
          f"{out['acc_no_tool_same_start']:.3f} (se {out['acc_se']:.3f})")
    return out


def latency(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: sync vs async step time, episodes with the slow tool and single-turn
    completions of the same problems, the same settings, pairs alternating."""
    workloads = {"slow_tool": spec(max_sleep_ms=args.max_sleep_ms), "single_turn": None}
    runs = {name: run_summary(launch(name, env, staleness, args, args.policy)) for name, env, staleness in [
        (f"{mode}_{work}_{i}", env, staleness) for i in range(args.pairs)
        for work, env in workloads.items() for mode, staleness in (("sync", 0), ("async", args.bound))]}
    pairs = {work: [(runs[f"sync_{work}_{i}"]["median_step_s"], runs[f"async_{work}_{i}"]["median_step_s"])
                    for i in range(args.pairs)] for work in workloads}
    speedup = {work: statistics.median(s / a for s, a in p) for work, p in pairs.items()}
    for work, what in (("slow_tool", f"episodes with a 0-{args.max_sleep_ms} ms tool"),
                       ("single_turn", "single-turn, the same problems")):
        print(f"step time, {what}: sync {statistics.median(s for s, _ in pairs[work]):.3f} s, async "
              f"(bound {args.bound}) {statistics.median(a for _, a in pairs[work]):.3f} s, speedup "
              f"{speedup[work]:.2f}x (median of {args.pairs} pairs: "
              f"{', '.join(f'{s / a:.2f}x' for s, a in pairs[work])})")
    return {
        "async_speedup_tool_latency": speedup["slow_tool"], "async_speedup_single_turn": speedup["single_turn"],
        "pair_speedups": [s / a for s, a in pairs["slow_tool"]],
        "single_turn_pair_speedups": [s / a for s, a in pairs["single_turn"]],
        "sync_step_s": statistics.median(s for s, _ in pairs["slow_tool"]),
        "async_step_s": statistics.median(a for _, a in pairs["slow_tool"]),
        "single_turn_sync_step_s": statistics.median(s for s, _ in pairs["single_turn"]),
        "single_turn_async_step_s": statistics.median(a for _, a in pairs["single_turn"]),
        "details": {"latency_runs": runs},
    }


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: generator tokens/s, in this process."""
    speed = tokens_per_s(args.policy, args)
    print(speed_line(speed))
    return speed


if __name__ == "__main__":
    main()
