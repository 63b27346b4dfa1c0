"""Trainer executor: consumes scored rollouts, steps the optimizer, publishes weights.

    torchrun --standalone --nproc_per_node 1 -m app.trainer --store-port 29600 \\
        --num-generators 2 --num-reward 0 [TrainerConfig and GeneratorConfig flags]

Replica 0 is the single controller: it hosts the control store, publishes the run's
config and policy, is the only writer of the metrics database, sends weights to the
generators after every step, watches every role's health, and ends the run. With
``nproc_per_node > 1`` the trainer ranks train data-parallel over torchrun's
group (gradients averaged once per step); each rank pulls its share of groups from the
same queue.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from app import cli, metrics, rl, runtime, transport
from app.config import GeneratorConfig, TrainerConfig
from app.generator import WEIGHT_TIMEOUT_S, publish_config
from app.local import eval_problems, resolve_policy
from app.policy import load_policy
from app.rewards import (build_reward, exit_without_teardown_if_calls_hang, parse_spec,
                         reward_events)
from app.weight_sync import WeightSender, flatten_parameters_, init_weight_group
from pipelines.rollouts import RolloutStream

log = logging.getLogger("llamarl")


def _staleness(batch: list[rl.Rollout], version: int, step: int) -> tuple[list[dict], dict[str, float]]:
    """One staleness row per consumed rollout, and the step's mean and max lag."""
    lags = [version - r.version for r in batch]
    rows = [metrics.staleness(step, r.version, lag, True) for r, lag in zip(batch, lags)]
    return rows, {"staleness/mean": sum(lags) / len(lags), "staleness/max": max(lags)}


def average_across_ranks(grads: list[torch.Tensor]) -> None:
    """Data parallel: every trainer rank ends with the mean gradient. One flat all-reduce
    per step, called by every rank exactly once (unlike DDP's hooks, which need the same
    number of backward passes on every rank: not so when ranks skip different rollouts)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def raise_if_all_quarantined(groups: list[list[rl.Rollout]], step: int) -> None:
    """A whole batch without one usable reward means the reward setup is broken (every
    component raising, say): stop with the reasons rather than train on nothing."""
    reasons = sorted({str(r.meta["reward_result"].quarantined) for g in groups for r in g})
    raise RuntimeError(f"step {step}: every rollout of the batch was quarantined by the rewards "
                       f"({', '.join(reasons)}); check --rewards")


class Trainer:
    def __init__(self, rt: runtime.Runtime, cfg: TrainerConfig, gen: GeneratorConfig, *,
                 num_generators: int, num_reward: int, rank: int, world: int) -> None:
        self.rt, self.cfg, self.gen = rt, cfg, gen
        self.num_generators, self.num_reward = num_generators, num_reward
        self.rank, self.world = rank, world
        self.timeline = metrics.Timeline("trainer", rank)
        self.version = 0
        self.dropped = 0

    # --- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        cfg, rt = self.cfg, self.rt
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.rank == 0:
            policy = resolve_policy(cfg.policy, log=log.info)
            rt.store.add(runtime.RESERVED_KEY, 0)
            rt.store.add(runtime.DROPPED_KEY, 0)
            self.run_dir = metrics.new_run_dir(cfg.runs_dir, cfg.run_id, self._config_dict())
            runtime.log_to_run_dir(str(self.run_dir), "trainer", 0)
            self.writer = metrics.MetricsWriter(self.run_dir, run_id=self.run_dir.name, config=self._config_dict())
            publish_config(rt.store, cfg, self.gen, str(policy.resolve()), str(self.run_dir.resolve()))
            log.info("run directory %s", self.run_dir)
        else:
            from app.generator import read_config
            _, _, policy = read_config(rt.store, rt, 900.0)
        self.model, self.tokenizer = load_policy(policy)
        # Before DDP and the optimizer: they then update the flat buffers the weight sync
        # broadcasts without packing.
        flatten_parameters_(self.model)
        self.held_out = eval_problems(cfg)
        self.ref_model = copy.deepcopy(self.model).eval() if cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        inline = self.num_reward == 0
        self.reward_names = [c.name for c in parse_spec(cfg.rewards)]
        self.reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s) if inline else None
        if self.reward is not None:
            self.reward.load()
        expected = {"generator": self.num_generators, "reward": self.num_reward, "trainer": self.world}
        rt.control.wait_for_members(expected, timeout_s=900.0, should_stop=rt.should_stop)
        if self.rank == 0:
            group = init_weight_group(rt.store, rank=0, world_size=self.num_generators + 1,
                                      device=torch.device("cpu"), timeout_s=WEIGHT_TIMEOUT_S)
            self.sender = WeightSender(group, list(self.model.named_parameters()))
            self._sync()
        self.stream = RolloutStream(
            rt.queue(runtime.ROLLOUTS if inline else runtime.SCORED), reward=self.reward,
            reward_timeout_s=cfg.reward_timeout_s, groups_per_batch=cfg.prompts_per_step // self.world,
            max_staleness=cfg.max_staleness, current_version=lambda: self.version,
            on_drop=self._on_drop, normalize_std=cfg.normalize_std, should_stop=rt.should_stop,
            timeout_s=600.0)

    def _config_dict(self) -> dict:
        return {"mode": "async" if self.cfg.max_staleness > 0 else "sync",
                "num_generators": self.num_generators, "num_reward": self.num_reward,
                "trainer_ranks": self.world, **cli.to_dict(self.cfg), **cli.to_dict(self.gen)}

    # --- the loop ----------------------------------------------------------------------
    def _on_drop(self, group: list[rl.Rollout], lag: int) -> None:
        self.dropped += 1
        self.rt.store.add(runtime.DROPPED_KEY, 1)  # generators may fill the slot again
        self.rt.emit([metrics.staleness(self.version + 1, r.version, lag, False) for r in group])

    def _sync(self) -> None:
        with self.timeline.busy("weight_sync"):
            stats = self.sender.send(self.version)
        self.rt.control.set_version(self.version)
        self.rt.emit([metrics.weight_sync(stats.version, "trainer", stats.bytes, stats.seconds)])

    def _check_health(self) -> None:
        failures = self.rt.control.failures()
        if failures:
            who, err = next(iter(failures.items()))
            raise RuntimeError(f"{who} failed: {err}")
        dead = self.rt.control.dead_members(max_age_s=60.0)
        if dead:
            raise RuntimeError(f"no heartbeat for 60 s from {', '.join(dead)}: the role is gone")

    def _drain_metrics(self) -> None:
        """Replica 0 writes its own events directly and everyone else's from the queue."""
        self.writer.write(self.rt.take_metrics() + self.timeline.drain())
        queue = self.rt.queue(runtime.METRICS)
        while msgs := queue.pop_many(256, timeout_s=0.0):
            self.writer.write(e for m in msgs for e in m["events"])

    def evaluate(self, step: int) -> dict[str, float]:
        with self.timeline.busy("eval"):
            m = rl.evaluate(self.model, self.tokenizer, self.held_out,
                            max_new_tokens=self.gen.max_new_tokens)
        self.rt.emit(metrics.scalars({f"eval/{k}": v for k, v in m.items()}, role="trainer", step=step))
        log.info("step %d held-out accuracy %.3f", step, m["accuracy"])
        return m

    def run(self) -> None:
        cfg = self.cfg
        step_cfg = cfg.step_config(self.gen.temperature)
        if self.rank == 0:
            self.evaluate(0)
        t_prev = time.time()
        for step in range(1, cfg.steps + 1):
            with self.timeline.idle("wait_rollouts"):
                groups = self.stream.next_batch()
            batch = [r for g in groups for r in g if r.reward is not None]
            t0 = time.time()
            if not batch:
                raise_if_all_quarantined(groups, step)
            with self.timeline.busy("train"):
                m = rl.train_step(self.model, self.optimizer, batch, step_cfg,
                                  pad_id=self.tokenizer.pad_token_id, ref_model=self.ref_model,
                                  reduce_grads=average_across_ranks if self.world > 1 else None)
            t_train = time.time() - t0
            consumed_version = self.version
            self.version += 1
            events, values_staleness = _staleness(batch, consumed_version, step)
            all_rollouts = [r for g in groups for r in g]
            tokens = sum(len(r.completion_ids) for r in batch)
            step_s = time.time() - t_prev
            t_prev = time.time()
            values = {("aipo/" + k if k in ("ratio_mean", "ratio_max", "frac_truncated") else k): v
                      for k, v in m.items()}
            values.update({"train/tokens_per_s": tokens / t_train, "train/samples_per_s": len(batch) / t_train,
                           "train/step_s": step_s, "train/steps_per_min": 60.0 / step_s,
                           "dropped_stale": self.dropped, "train/version": self.version,
                           "idle_fraction": self.timeline.idle_fraction(),
                           "queue/rollouts": self.rt.queue(runtime.ROLLOUTS).depth(),
                           "queue/scored": self.rt.queue(runtime.SCORED).depth(),
                           **values_staleness})
            events += metrics.scalars(values, role="trainer", replica=self.rank, step=step)
            events += reward_events([r.meta["reward_result"] for r in all_rollouts], self.reward_names,
                                    step, role="trainer", replica=self.rank)
            if self.rank != 0:  # the other ranks' events travel to replica 0 in batches
                self.rt.emit(events + self.timeline.drain())
            else:
                self.rt.emit(events)
            if self.rank == 0:
                self._sync()
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    self.evaluate(step)
                self._check_health()
                self._drain_metrics()
                log.info("step %d/%d reward %.3f loss %+.4f staleness mean %.2f max %d dropped %d %.2fs",
                         step, cfg.steps, sum(r.reward for r in batch) / len(batch), m["loss"], values["staleness/mean"],
                         values["staleness/max"], self.dropped, step_s)

    def close(self, reason: str, *, failed: bool = False) -> None:
        """Every rank: stop the rollout stream's thread. Replica 0 then asks every role to
        stop, keeps the store up until they acknowledge, and writes the last metrics."""
        if hasattr(self, "stream"):
            try:
                self.stream.close()
            except TimeoutError as e:
                log.error("%s", e)
        if self.rank != 0:
            return
        if failed:
            self.rt.control.mark_failed("trainer", 0, reason)
        else:
            self.rt.control.request_stop(reason)
        missing = [m for m in self.rt.control.members() if m != "trainer/0"]
        deadline = time.monotonic() + 60.0
        while missing and time.monotonic() < deadline:
            missing = runtime.wait_for_exits(self.rt.store, missing, timeout_s=1.0)
            # A killed process never acknowledges: stop waiting once its heartbeat is still.
            dead = [m for m in self.rt.control.dead_members(max_age_s=10.0) if m in missing]
            if dead:
                log.error("%s: no heartbeat for 10 s and no stop acknowledged: the process is gone",
                          ", ".join(dead))
                missing = [m for m in missing if m not in dead]
        if missing:
            log.warning("roles that did not acknowledge the stop within 60 s: %s", ", ".join(missing))
        if hasattr(self, "writer"):
            try:
                self._drain_metrics()
            finally:
                self.writer.close(finished=not failed)
            log.info("run %s: %s; run directory %s", "failed" if failed else "finished", reason, self.run_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-port", type=int, default=29600, help="port of the control store on replica 0")
    parser.add_argument("--num-generators", type=int, required=True, help="generator replicas in the app")
    parser.add_argument("--num-reward", type=int, default=0, help="reward replicas (0: score inline)")
    cli.add_config_args(parser, TrainerConfig)
    cli.add_config_args(parser, GeneratorConfig)
    args = parser.parse_args(argv)
    try:
        cfg, gen = cli.config_from_args(args, TrainerConfig), cli.config_from_args(args, GeneratorConfig)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if cfg.prompts_per_step % int(os.environ.get("WORLD_SIZE", "1")):
        parser.error("prompts_per_step must be divisible by the number of trainer ranks")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    runtime.setup_logging("trainer", rank)
    if world > 1:
        dist.init_process_group("gloo")
    try:
        store = (transport.host_store(args.store_port) if rank == 0
                 else transport.connect_store(f"127.0.0.1:{args.store_port}", 300.0))
        with runtime.Runtime.join("trainer", rank, store) as rt:
            trainer = Trainer(rt, cfg, gen, num_generators=args.num_generators, num_reward=args.num_reward,
                              rank=rank, world=world)
            try:
                trainer.start()
                trainer.run()
            except transport.Stopped:
                trainer.close(rt.control.stop_reason() or "stopped", failed=True)
                raise
            except Exception as e:
                trainer.close(f"{type(e).__name__}: {e}", failed=True)
                raise
            trainer.close(f"finished {cfg.steps} steps")
    finally:
        if world > 1:
            dist.destroy_process_group()
    exit_without_teardown_if_calls_hang()


if __name__ == "__main__":
    main(sys.argv[1:])
