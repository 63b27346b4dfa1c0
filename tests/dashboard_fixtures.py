"""Run directories for the dashboard tests, written by the project's own metrics code.

Every event goes through ``llamarl.app.metrics.events`` (``MetricsWriter``, ``Timeline`` and the event
constructors), so the dashboard is tested against exactly what the app writes. Until
the single-process loop (``python -m llamarl.app.roles.local``) exists, ``make_run`` simulates the
executors of a sync or async run; switching the fixtures to real short runs means
replacing the body of ``make_run`` only.

Broken cases: ``make_empty_run`` (no database), ``make_meta_only_run`` (writer opened,
nothing written), ``make_old_schema_run``, ``make_corrupt_run`` and ``LiveRun`` (a
writer thread appending steps while the dashboard reads).
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Literal

from llamarl.app.metrics import events as m

Mode = Literal["sync", "async"]
T_START = 1_700_000_000.0  # a fixed clock so fixture runs are identical every time
REWARD_COMPONENTS = ("correctness", "format")


def make_run(run_dir: str | Path, *, mode: Mode = "async", steps: int = 40, n_generators: int = 2,
             seed: int = 0, checkpoint_step: int | None = None, auto: bool = False) -> Path:
    """A finished run in ``run_dir``: the one function to swap for ``python -m llamarl.app.roles.local``;
    ``checkpoint_step`` names a saved checkpoint the way the trainer does; ``auto``: a run
    with ``--max-staleness auto`` whose bound went 1 -> 2 after step 3 and back after step 6."""
    run_dir = Path(run_dir)
    config = {**run_config(mode, n_generators=n_generators), **({"max_staleness": "auto"} if auto else {})}
    write_config(run_dir, config)
    writer = m.MetricsWriter(run_dir, run_id=run_dir.name, config=config)
    try:
        writer.set_meta("started_at", repr(T_START))
        for events in simulate(mode, steps=steps, n_generators=n_generators, t_start=T_START, seed=seed):
            writer.write(events)
        if auto:
            bounds = {s: 2 if 3 < s <= 6 else 1 for s in range(1, steps + 1)}
            writer.write([m.scalar(k, v, role="trainer", step=s, t=T_START + s) for s, b in bounds.items()
                          for k, v in {"staleness/bound": b, "staleness/blocked": 0.5 if b == 1 else 0.1,
                                       "aipo/ess": 0.99}.items()])
            writer.write([m.bound_change(3, 1, 2, "generators blocked 50% of the last 2 steps, ratios tame"),
                          m.bound_change(6, 2, 1, "ESS 0.812 < 0.9")])
        if checkpoint_step is not None:
            path = run_dir / "checkpoints" / f"step-{checkpoint_step}"
            writer.set_meta(m.LAST_CHECKPOINT, json.dumps({"step": checkpoint_step, "path": str(path)}))
    finally:
        writer.close()
    return run_dir


def make_runs_root(root: str | Path, *, broken: bool = True) -> Path:
    """A runs directory with a sync and an async run, and (``broken``) every broken case."""
    root = Path(root)
    make_run(root / "sync-run", mode="sync", seed=1)
    make_run(root / "async-run", mode="async", seed=2, checkpoint_step=40)
    if broken:
        make_empty_run(root / "empty-run")
        make_meta_only_run(root / "meta-only-run")
        make_old_schema_run(root / "old-schema-run")
        make_corrupt_run(root / "corrupt-run")
    return root


def run_config(mode: Mode, *, n_generators: int = 2) -> dict[str, Any]:
    return {"mode": mode, "max_staleness": 0 if mode == "sync" else 2, "rho_max": 4.0,
            "group_size": 4, "prompts_per_step": 4, "n_generators": n_generators,
            "model": "tiny-llama-test", "gen_precision": "fp32" if mode == "sync" else "int8"}


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------- broken runs


def make_empty_run(run_dir: str | Path) -> Path:
    """A run directory the app created but has not opened its database in."""
    run_dir = Path(run_dir)
    write_config(run_dir, run_config("async"))
    return run_dir


def make_meta_only_run(run_dir: str | Path) -> Path:
    """The writer opened the database (tables and meta) but recorded no event yet."""
    run_dir = Path(run_dir)
    config = run_config("async")
    write_config(run_dir, config)
    m.MetricsWriter(run_dir, run_id=run_dir.name, config=config).close()
    return run_dir


def make_old_schema_run(run_dir: str | Path) -> Path:
    """A database from before the current schema: version 0 and no weight_sync table.

    The current writer cannot produce an old schema, so the run is written with it and
    then taken back a version, as a database of an earlier release would look.
    """
    run_dir = make_run(run_dir, mode="async", steps=5)
    db = sqlite3.connect(run_dir / m.DB_NAME)
    with db:
        db.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
        db.execute("DROP TABLE weight_sync")
    db.close()
    return run_dir


def make_corrupt_run(run_dir: str | Path) -> Path:
    """``metrics.db`` holds random bytes (a truncated copy, a disk error)."""
    run_dir = Path(run_dir)
    write_config(run_dir, run_config("async"))
    (run_dir / m.DB_NAME).write_bytes(random.Random(7).randbytes(8192))
    return run_dir


class LiveRun:
    """A run still being written: a thread appends one simulated step every ``period_s``.

    ``with LiveRun(path) as live: ...``; ``live.steps_written`` counts the steps so far.
    """

    def __init__(self, run_dir: str | Path, *, mode: Mode = "async", period_s: float = 0.05,
                 max_steps: int = 10_000) -> None:
        self.run_dir = Path(run_dir)
        self.mode, self.period_s, self.max_steps = mode, period_s, max_steps
        self.steps_written = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._first_step = threading.Event()
        self._thread = threading.Thread(target=self._write, name="live-run-writer", daemon=True)

    def __enter__(self) -> "LiveRun":
        config = run_config(self.mode)
        write_config(self.run_dir, config)
        self._writer = m.MetricsWriter(self.run_dir, run_id=self.run_dir.name, config=config)
        self._thread.start()
        if not self._first_step.wait(timeout=30):
            raise TimeoutError(f"live run writer wrote no step into {self.run_dir} within 30 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._writer.close()
        if self.error is not None:
            raise RuntimeError("live run writer failed") from self.error

    def wait_for_steps(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps_written < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"live run reached {self.steps_written} of {n} steps in {timeout_s} s")
            time.sleep(0.01)

    def _write(self) -> None:
        try:
            # Simulated time runs at wall-clock pace from now, so the run looks live.
            for events in simulate(self.mode, steps=self.max_steps, n_generators=2,
                                   t_start=time.time(), seed=3, step_s=self.period_s):
                if self._stop.is_set():
                    return
                self._writer.write(events)
                self.steps_written += 1
                self._first_step.set()
                time.sleep(self.period_s)
        except BaseException as err:  # surfaced by __exit__
            self.error = err
            self._first_step.set()


# --------------------------------------------------------------------------- simulation


def simulate(mode: Mode, *, steps: int, n_generators: int, t_start: float, seed: int,
             step_s: float = 2.0) -> Iterator[list[dict[str, Any]]]:
    """The events of each training step of a simulated run, as the executors record them.

    ``sync``: generators generate, then the trainer trains while generators wait for
    weights, then weights move; every rollout has staleness 0. ``async``: generation of
    step N+1 overlaps training of step N; rollouts lag by 0..2 versions and a few that
    lag more are dropped.
    """
    rng = random.Random(seed)
    trainer, reward_tl = m.Timeline("trainer"), m.Timeline("reward")
    generators = [m.Timeline("generator", replica=i) for i in range(n_generators)]
    max_staleness = 0 if mode == "sync" else 2
    rollouts_per_step, tokens_per_rollout = 16, 96
    param_bytes = 2 * 124_000_000  # a 124M-parameter policy in bf16
    t = t_start
    for step in range(1, steps + 1):
        gen_s = step_s * (0.55 + 0.1 * rng.random())
        train_s = step_s * (0.35 + 0.05 * rng.random())
        sync_s = step_s * 0.05 * (1 + 0.3 * rng.random())
        if mode == "sync":
            for g in generators:
                g.record("busy", "generate", t, t + gen_s)
                g.record("idle", "wait_weights", t + gen_s, t + gen_s + train_s)
                g.record("busy", "receive_weights", t + gen_s + train_s, t + gen_s + train_s + sync_s)
            reward_tl.record("idle", "wait_rollouts", t, t + gen_s)
            reward_tl.record("busy", "score", t + gen_s, t + gen_s + 0.1 * step_s)
            reward_tl.record("idle", "wait_rollouts", t + gen_s + 0.1 * step_s, t + gen_s + train_s + sync_s)
            trainer.record("idle", "wait_rollouts", t, t + gen_s + 0.1 * step_s)
            trainer.record("busy", "train", t + gen_s + 0.1 * step_s, t + gen_s + train_s)
            trainer.record("busy", "sync_weights", t + gen_s + train_s, t + gen_s + train_s + sync_s)
            dt = gen_s + train_s + sync_s
        else:
            # Training sets the pace; generators keep generating and wait only on backpressure.
            dt = train_s + sync_s + 0.03 * step_s
            for g in generators:
                busy = (dt - sync_s) * (0.85 + 0.13 * rng.random())
                g.record("busy", "generate", t, t + busy)
                g.record("idle", "wait_queue", t + busy, t + dt - sync_s)
                g.record("busy", "receive_weights", t + dt - sync_s, t + dt)
            reward_tl.record("busy", "score", t, t + 0.3 * dt)
            reward_tl.record("idle", "wait_rollouts", t + 0.3 * dt, t + dt)
            trainer.record("idle", "wait_rollouts", t, t + 0.03 * step_s)
            trainer.record("busy", "train", t + 0.03 * step_s, t + dt - sync_s)
            trainer.record("busy", "sync_weights", t + dt - sync_s, t + dt)
        end = t + dt

        events: list[dict[str, Any]] = []
        lags = [0] * rollouts_per_step if mode == "sync" else [
            min(int(rng.expovariate(1.2)), 4) for _ in range(rollouts_per_step)]
        for lag in lags:
            events.append({**m.staleness(step, max(0, step - 1 - lag), lag, lag <= max_staleness), "t": end})
        used = [lag for lag in lags if lag <= max_staleness]
        progress = step / steps
        accuracy = min(0.9, 0.15 + 0.6 * progress + 0.05 * rng.random())
        quarantined = 0
        for _ in range(rollouts_per_step):
            if rng.random() < 0.02:
                quarantined += 1
                events.append({**m.reward("correctness", None, step=step, reason="timeout"), "t": end})
            else:
                events.append({**m.reward("correctness", float(rng.random() < accuracy), step=step), "t": end})
            events.append({**m.reward("format", 0.5 + 0.5 * min(1.0, 2 * progress) * rng.random(), step=step),
                           "t": end})
        for receiver in ["trainer/0", "trainer/1", *(f"generator{i}" for i in range(n_generators))]:
            # Two trainer ranks, each sending its half (its shard) to every generator.
            nbytes = param_bytes // 2 if receiver.startswith("trainer") else param_bytes
            events.append({**m.weight_sync(step, receiver, nbytes, sync_s * (0.9 + 0.2 * rng.random())),
                           "t": end})

        tokens = rollouts_per_step * tokens_per_rollout
        values = {
            "train/tokens_per_s": tokens / train_s, "train/samples_per_s": rollouts_per_step / train_s,
            "train/steps_per_min": 60.0 / dt, "train/step_s": dt,
            "loss": 1.5 * (1 - 0.6 * progress) + 0.1 * rng.random(), "kl": 0.02 * progress + 0.002 * rng.random(),
            "reward/total": accuracy, "aipo/ratio_mean": 1.0 + 0.05 * rng.random() * (max_staleness + 1),
            "aipo/ratio_max": 1.5 + rng.random() * (2 + max_staleness),
            "aipo/frac_truncated": 0.0 if mode == "sync" else 0.02 * rng.random(),
            "response_len": tokens_per_rollout * (1 + 0.2 * rng.random()),
            "frac_zero_var": 0.8 - 0.4 * progress, "frac_no_answer": 0.3 * (1 - progress),
            "frac_cut_off": 0.1 * rng.random(),
            "staleness/mean": sum(used) / max(1, len(used)), "staleness/max": float(max(used, default=0)),
            "dropped_stale": float(len(lags) - len(used)), "quarantined/timeout": float(quarantined),
            "queue/rollouts": float(rng.randint(0, 2) if mode == "sync" else rng.randint(4, 12)),
            "queue/prompts": float(rng.randint(0, 4) if mode == "sync" else rng.randint(6, 16)),
        }
        for lag in sorted(set(used)):  # precision (lag 0), plus policy change (lag > 0)
            values.update({f"mismatch/lag{lag}/ratio_mean": 1.0 + 0.01 * lag * rng.random(),
                           f"mismatch/lag{lag}/ratio_max": 1.2 + 0.5 * lag + 0.3 * rng.random(),
                           f"mismatch/lag{lag}/frac_truncated": 0.001 * lag * rng.random(),
                           f"mismatch/lag{lag}/kl": 0.002 + 0.01 * lag * rng.random()})
        if mode == "async":  # generators at int8 quantize every version
            events += [m.scalar("weights/quantize_s", 0.05 * (1 + 0.2 * rng.random()), role="generator",
                                replica=i, step=step, t=end) for i in range(n_generators)]
        if step % 5 == 0:
            values["eval/accuracy"] = accuracy - 0.05
        if mode == "async":  # someone on the network: a few forged frames, then one replayed
            values.update({k: v for k, v, since in [("security/rejected_frames/bad_tag", 3.0, 10),
                                                    ("security/rejected_frames/replay", 1.0, 25)]
                           if step >= since})
        events += [m.scalar(k, v, role="trainer", step=step, t=end) for k, v in values.items()]
        events.append(m.scalar("idle_fraction", trainer.idle_fraction(), role="trainer", step=step, t=end))
        events.append(m.scalar("idle_fraction", reward_tl.idle_fraction(), role="reward", step=step, t=end))
        for g in generators:
            idle = g.idle_fraction()
            spans = g.drain()
            gen_busy = max(1e-6, sum(e["t1"] - e["t0"] for e in spans if e["what"] == "generate"))
            per_replica = rollouts_per_step / n_generators
            events.append(m.scalar("gen/tokens_per_s", per_replica * tokens_per_rollout / gen_busy,
                                   role="generator", replica=g.replica, step=step, t=end))
            events.append(m.scalar("gen/seqs_per_s", per_replica / gen_busy,
                                   role="generator", replica=g.replica, step=step, t=end))
            events.append(m.scalar("idle_fraction", idle, role="generator", replica=g.replica,
                                   step=step, t=end))
            if mode == "async":  # the async run's generators run episodes (--env): their env/ counts
                events += [m.scalar(f"env/{k}", v * step, role="generator", replica=g.replica, step=step, t=end)
                           for k, v in (("episodes", per_replica), ("episode_turns", 2.5 * per_replica),
                                        ("tool_calls", 1.5 * per_replica), ("tool_errors/unparsed", 0.2),
                                        ("episode_end/done", per_replica), ("env_step_s", 0.3))]
            if mode == "async":  # the async run's executors are on GPUs (llamarl.app.devices.device_metrics)
                events += [m.scalar("device/utilization", 100 * (1 - idle) * (0.8 + 0.2 * rng.random()),
                                    role="generator", replica=g.replica, step=step, t=end),
                           m.scalar("device/max_memory_gb", 6.0 + 0.01 * step, role="generator",
                                    replica=g.replica, step=step, t=end)]
            if mode == "async" and g.replica == 1 and step >= 30:  # one weight version altered in flight
                events.append(m.scalar("security/weight_digest/mismatch", 1.0, role="generator",
                                       replica=1, step=step, t=end))
            events += spans
        if mode == "async":
            events += [m.scalar("device/utilization", 100 * (1 - trainer.idle_fraction()), role="trainer",
                                step=step, t=end),
                       m.scalar("device/max_memory_gb", 18.0, role="trainer", step=step, t=end)]
        events += trainer.drain() + reward_tl.drain()
        yield events
        t = end

