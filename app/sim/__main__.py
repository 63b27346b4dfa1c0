"""Predict llamarl's loop: step time, idle per executor, staleness and throughput.

    python -m llamarl.app.sim --from-run runs/<id> [--generators 2] [--max-staleness 0] [--json out.json]
    python -m llamarl.app.sim --spec examples/sim/llama-70b-async.json

``--from-run`` fits every cost model from the run's metrics database
(``llamarl.app.sim.calibrate``) and predicts that run's configuration, or another one
given by the flags; ``--spec`` builds them from a spec file (``llamarl.app.sim.spec``).
Beside the prediction it prints what one more generator and other staleness bounds would
give (the dashboard's "what if").
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from llamarl.app import cli
from llamarl.app.sim import calibrate, engine, spec
from llamarl.app.sim.costs import Loop


@dataclass(kw_only=True)
class SimConfig:
    """What to simulate, and where to write it."""

    from_run: str = ""
    """A run directory (runs/<id>) to fit the cost models from."""
    spec: str = ""
    """A spec file (JSON) to build the cost models from instead."""
    json: str = ""
    """Also write the report here (JSON)."""
    generators: int = 0
    """Generator instances (0: the run's or the spec's)."""
    max_staleness: int = -1
    """The staleness bound (-1: the run's or the spec's; 0 is synchronous)."""
    prompts_per_step: int = 0
    """Prompts per step (0: the run's or the spec's)."""
    group_size: int = 0
    """Completions per prompt (0: the run's or the spec's)."""
    gen_batch_prompts: int = 0
    """Prompts per generator batch (0: the run's or the spec's)."""
    reward_executors: int = -1
    """Reward executors (-1: the run's or the spec's; 0 scores inline)."""
    steps: int = 0
    """Steps to simulate (0: the run's or the spec's)."""
    seed: int = 0
    """Seed of the completion lengths drawn."""
    host_load: float = -1.0
    """Other programs' runnable threads on a shared CPU host (-1: the run's, measured from
    its CPU seconds, or the spec's; 0: a machine of its own)."""

    def __post_init__(self) -> None:
        if bool(self.from_run) == bool(self.spec):
            raise ValueError("give one of --from-run RUN_DIR and --spec FILE")
        if self.max_staleness < -1 or self.reward_executors < -1 or min(
                self.generators, self.prompts_per_step, self.group_size, self.gen_batch_prompts, self.steps) < 0:
            raise ValueError("counts must be >= 0 (or -1 where it means 'as given')")
        if self.host_load < 0 and self.host_load != -1:
            raise ValueError(f"host_load must be >= 0 (or -1: as given), got {self.host_load}")

    def overrides(self) -> dict[str, float]:
        given = {"generators": self.generators, "prompts_per_step": self.prompts_per_step,
                 "group_size": self.group_size, "gen_batch_prompts": self.gen_batch_prompts, "steps": self.steps}
        out = {k: v for k, v in given.items() if v > 0}
        out.update({k: v for k, v in (("max_staleness", self.max_staleness),
                                      ("reward_executors", self.reward_executors),
                                      ("host_load", self.host_load)) if v >= 0})
        return out


def build(cfg: SimConfig) -> tuple[Loop, dict]:
    """The loop to simulate and what it was built from."""
    if cfg.from_run:
        fit = calibrate.from_run(cfg.from_run)
        return fit.loop(**cfg.overrides()), {"from_run": cfg.from_run, "fit": fit.summary()}
    loaded = spec.load(cfg.spec)
    return replace(loaded.loop(), **cfg.overrides()), {"spec": cfg.spec, "name": loaded.name}


def describe(loop: Loop, report: engine.Report) -> str:
    lines = [f"B={loop.prompts_per_step} G={loop.group_size} K={loop.max_staleness} generators={loop.generators} "
             f"reward executors={loop.reward_executors} trainer ranks={loop.trainer_ranks}",
             f"median step time  {report.median_step_s:.3f} s",
             f"throughput        {report.samples_per_s:.1f} rollouts/s, {report.tokens_per_s:.0f} tokens/s",
             "idle fraction     " + idle_line(report),
             "staleness         " + ", ".join(f"{k}: {v}" for k, v in sorted(report.staleness.items()))
             + f" groups (mean {report.mean_staleness:.2f}, dropped {report.dropped})"]
    return "\n".join(lines)


def idle_line(report: engine.Report) -> str:
    """Each executor's idle fraction; a role of more than four replicas as its mean and range."""
    by_role: dict[str, list[tuple[str, float]]] = {}
    for name, value in report.idle_per_executor.items():
        by_role.setdefault(name.split("/")[0], []).append((name, value))
    parts = []
    for role, items in sorted(by_role.items()):
        values = [v for _, v in items]
        if len(items) > 4:
            parts.append(f"{role} x{len(items)} mean {sum(values) / len(values):.2f} "
                         f"(min {min(values):.2f}, max {max(values):.2f})")
        else:
            parts += [f"{name} {v:.2f}" for name, v in sorted(items)]
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    (cfg,) = cli.parse(argv, SimConfig, description=__doc__.splitlines()[0], prog="python -m llamarl.app.sim")
    try:
        loop, source = build(cfg)
    except (OSError, ValueError) as e:
        sys.exit(f"llamarl.app.sim: {e}")
    cases = engine.what_if(loop, seed=cfg.seed)
    report = cases[0][1]
    print(describe(loop, report))
    print("\nwhat if                 step (s)   idle: generator  reward  trainer")
    for label, r in cases:
        print(f"{label:22}{r.median_step_s:10.3f}         {r.idle.get('generator', 0):8.2f}"
              f"{r.idle.get('reward', 0):8.2f}{r.idle.get('trainer', 0):9.2f}")
    if cfg.json:
        out = {"source": source, "loop": loop.to_dict(), "report": report.to_dict(),
               "what_if": [{"case": label, **r.to_dict()} for label, r in cases]}
        Path(cfg.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {cfg.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
