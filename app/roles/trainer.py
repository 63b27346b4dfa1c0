"""Trainer executor: consumes scored rollouts, steps the optimizer, publishes weights.

    python -m llamarl.app.roles.launch --nproc-per-node 1 --store-port 29600 --app-id APP \\
        --num-generators 2 --num-reward 0 [TrainerConfig and GeneratorConfig flags]

The loop this module drives (one message per rollout group; app/rl/contract.py)::

    generator/i --(queue "rollouts")--> [reward/j --(queue "scored")-->] trainer pipeline
        ^                                                                      |
        |                  pipelines/rollouts.py: poll -> contract check -> score (inline)
        |                  -> advantages -> staleness filter -> batch          |
        |                                                                      v
        |                                                 rl.train_step (AIPO), version += 1
        |                                                                      |
        +-------- weight plane: broadcast of version v+1 (gloo / NCCL) <-------+

Replica 0 is the single controller: it hosts the control store, publishes the run's
config and policy, is the only writer of the metrics database, sends weights to the
generators after every step, watches every role's health, and ends the run. With
``nproc_per_node > 1`` the policy is sharded over the trainer ranks with FSDP2
(``llamarl.app.rl.sharding``); each rank pulls its share of groups from the same queue, and a step
is the one a single process would take on all the ranks' groups. Every rank sends its
own shard straight to every generator after every step (``llamarl.app.weights.plane``). Replica 0
also keeps a whole copy of the policy, gathered from the shards on the steps that need
it: what it evaluates and saves as the Hugging Face policy.

Checkpoints (``--save-every``) hold the policy and the training state
(``llamarl.app.state.train_state``); ``--resume`` continues a run from its newest one. The run's
config, model and prompt order are checked before anything is written, the metrics
database drops what was recorded after the checkpoint, and the generators regenerate
the groups the checkpoint had not consumed (the slot ledger): no group is trained twice.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.app import errors
from llamarl.app.state import checkpoint
from llamarl.app import cli
from llamarl.app.data import sources as data
from llamarl.app import devices
from llamarl.app.control import frames
from llamarl.app.control import health
from llamarl.app.control import incarnations
from llamarl.app.control import membership
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.control import runtime
from llamarl.app.control import slots
from llamarl.app.rl import sharding
from llamarl.app.rl import steps
from llamarl.app.state import train_state
from llamarl.app.control import transport
from llamarl.app.weights import digest as weight_digest
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.rl.contract import Rejections
from llamarl.app.model.policy import load_policy, load_tokenizer
from llamarl.app.rewards import build_reward, parse_spec
from llamarl.app.control.seen_groups import REPLAY, SeenIds
from llamarl.app.sampling.precision import check_precision
from llamarl.app.metrics.tensorboard import TensorBoardMirror, summary_writer_class
from llamarl.app.weights.plane import elastic_sender
from llamarl.app.weights.sync import flatten_parameters_
from llamarl.pipelines.rollouts import RolloutStream

log = logging.getLogger("llamarl")

RANK_CONNECT_TIMEOUT_S = 60.0
"""Trainer ranks > 0 reach replica 0's store (``--store-host``); torchrun starts them together."""


class Trainer:
    def __init__(self, rt: runtime.Runtime, cfg: TrainerConfig, gen: GeneratorConfig, *,
                 num_generators: int, num_reward: int, rank: int, world: int) -> None:
        self.rt, self.cfg, self.gen = rt, cfg, gen
        self.num_generators, self.num_reward = num_generators, num_reward
        self.rank, self.world = rank, world
        self.device = devices.choose_device(cfg.device)
        self.dtype = devices.train_dtype(cfg.train_precision, self.device)
        log.info("trainer rank %d on %s, training in %s", rank, devices.describe(self.device),
                 "bf16 autocast over fp32 weights" if self.dtype == torch.bfloat16 else "fp32")
        # On a GPU a busy interval ends when the GPU is done: idle time is GPU idle time.
        self.timeline = metrics.Timeline("trainer", rank,
                                         busy_ends=functools.partial(devices.synchronize, self.device))
        self.version = 0
        self.guard = steps.SkipGuard()
        self.rejections = Rejections(f"trainer/{rank}")
        self.seen_batches = SeenIds()  # the metrics batches written (replica 0)
        self.tensorboard: TensorBoardMirror | None = None  # replica 0 with --tensorboard
        self.start_step = 0  # the checkpoint's step after a resume
        self.resumed_dropped = self.resumed_freed = 0  # replica 0: the checkpoint's slot counters
        self.membership: membership.Membership | None = None  # replica 0

    # --- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        cfg, rt = self.cfg, self.rt
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # A bad reward spec (an unknown name, bad options) fails first, in a second; the
        # reward executors resolve their own copy.
        self.reward_names = [c.name for c in parse_spec(cfg.rewards)]
        self.reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s) if self.num_reward == 0 else None
        if self.rank == 0:
            # Bad input stops the run here, before the warm start and before anything trains;
            # the store is up, so the error is the app's failure cause for every role.
            cfg = self.cfg = data.absolute_paths(cfg)
            # The generators' precision, against this machine's kind of device; each
            # generator checks its own device again before it loads weights.
            check_precision(self.gen.gen_precision, "cuda" if torch.cuda.is_available() else "cpu")
            if cfg.tensorboard:
                summary_writer_class()  # a missing package fails here, before the run directory
            resume = train_state.find_resume(cfg.runs_dir, cfg.run_id, cfg.resume)
            if resume is not None:
                resume.check(self._config_dict(), steps=cfg.steps)
            elif cfg.resume:
                log.info("--resume auto: no run to resume in %s; starting run %s", cfg.runs_dir, cfg.run_id)
            policy = data.resolve_policy(cfg.policy, log=log.info)
            sources = data.read(cfg, log=log.info)
            self.data = data.prepare(sources, cfg, load_tokenizer(policy), log=log.info)
            self.model, self.tokenizer = load_policy(policy, device=self.device)
            if resume is not None:  # every check before the run directory is touched
                self._check_resume(resume)
            self._open_run_dir(resume)
            data.publish(rt.signed, self.data)  # before the config: generators read it after
            runtime.publish_config(rt.signed, cfg, self.gen, policy_path=str(policy.resolve()),
                                   run_dir=str(self.run_dir.resolve()))
            if self.start_step == 0:
                rt.emit(metrics.scalars(self.data.counts, role="trainer", step=0))
            log.info("run directory %s", self.run_dir)
        else:
            _, _, policy = runtime.read_config(rt, 900.0)
            self.run_dir = Path(rt.signed.get(names.CONFIG_KEY)["run_dir"])
            self.model, self.tokenizer = load_policy(policy, device=self.device)
        self.attempt = runtime.run_attempt(rt)  # this start's: groups and metrics batches of another are refused
        resumed = rt.wait_key(names.RESUME_KEY, 60.0, "resume point")
        self.start_step = self.version = resumed["step"]
        self.slots = slots.Settlement(
            rt.signed, rank=self.rank, world=self.world, max_staleness=cfg.max_staleness,
            ledger=slots.SlotLedger.from_state(rt.wait_key(names.SLOTS_DONE_KEY, 60.0, "slot ledger")),
            rejections=self.rejections, emit=rt.emit, dropped=self.resumed_dropped, freed=self.resumed_freed)
        # The KL reference is a whole copy on every rank, never sharded: it runs forward
        # passes only, no collective.
        self.ref_model = copy.deepcopy(self.model).eval() if cfg.kl_coef > 0 else None
        self._shard()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        if resumed["train_state"]:  # after the reference copy: the KL stays to the starting policy
            train_state.load(resumed["train_state"], self.model, self.optimizer)
            self._gather_full_model()
            log.info("resumed from %s at step %d", resumed["train_state"], self.start_step)
        inline = self.num_reward == 0
        if self.reward is not None:
            self.reward.load()
        expected = {"generator": self.num_generators, "reward": self.num_reward, "trainer": self.world}
        if self.rank == 0:
            # A generator or reward executor killed before it registers is lost from here,
            # survivable while others of its role are alive (llamarl.app.control.membership); not waited for.
            self.membership = membership.Membership(rt.signed, {"generator": self.num_generators,
                                                               "reward": self.num_reward},
                                                    watch_heartbeats=False)
            self.membership.start()
        # A member that fails or dies while the others start is named at once, not after 900 s.
        alive = functools.partial(health.check_health, rt.control)
        rt.control.wait_for_members(expected, timeout_s=900.0, should_stop=rt.should_stop, health=alive)
        if self.rank == 0:
            data.wait_for_checks(rt, [names.member("generator", i) for i in range(self.num_generators)],
                                 timeout_s=900.0, health=alive)
            # From here a silent generator or reward executor is lost too (survivable while
            # others of its role are alive); the weight plane regroups without it.
            self.membership.watch_heartbeats = True
        # Every trainer rank sends its own shard straight to every generator (no gather);
        # rank 0 leads the plane's epochs (llamarl.app.weights.plane).
        self.sender = elastic_sender(rt.signed, list(self.model.named_parameters()), rank=self.rank,
                                     ranks=self.world, num_generators=self.num_generators,
                                     timeout_s=cfg.weight_sync_timeout_s,
                                     gone=self.membership.gone if self.membership else None,
                                     should_stop=rt.should_stop)
        # Every rank signs the digest of the shard it sends: no gather for it.
        self.digest = (weight_digest.ShardDigest(rt.signed, list(self.model.named_parameters()), rank=self.rank,
                                                 ranks=self.world) if cfg.weight_digest else None)
        self.sender.start()
        self._sync()
        self.stream = RolloutStream(
            rt.queue(names.ROLLOUTS if inline else names.SCORED), reward=self.reward,
            reward_timeout_s=cfg.reward_timeout_s, groups_per_batch=cfg.prompts_per_step // self.world,
            ranks=self.world,
            max_staleness=cfg.max_staleness, current_version=lambda: self.version,
            on_drop=self.slots.on_drop, normalize_std=cfg.normalize_std, should_stop=rt.should_stop,
            timeout_s=600.0, rejections=self.rejections, group_size=cfg.group_size,
            health=lambda: health.check_health(rt.control),
            admit=incarnations.admission(rt.signed, self.attempt, current_version=lambda: self.version,
                                         published_version=rt.control.version),
            vocab_size=self.model.get_input_embeddings().num_embeddings)

    def _shard(self) -> None:
        """One rank trains the model itself. Several shard it with FSDP2, and replica 0
        first keeps a whole copy (``full_model``), refreshed from the shards on the steps
        that evaluate or save (``_gather_full_model``): it is what held-out evaluation
        samples from (so no rank waits in a sharded forward pass that the others never
        run) and what the Hugging Face policy of a checkpoint is written from. It costs
        replica 0 one more copy of the weights (not of gradients or optimizer state); the
        weight sync does not use it: every rank sends its own shard. The whole model's
        parameters are views of one flat buffer per dtype (with one rank, the weight sync
        sends each as one broadcast with no packing)."""
        self.ranks: sharding.Ranks | None = None
        if self.world == 1:
            self.full_model = self.model
        else:
            self.full_model = copy.deepcopy(self.model) if self.rank == 0 else None
            self.ranks = sharding.Ranks(next(self.model.parameters()).device)
            sharding.shard(self.model)
        if self.full_model is not None:
            flatten_parameters_(self.full_model)

    def _gather_full_model(self) -> None:
        """Every rank (a collective with several): the shards' current values into replica
        0's whole copy (``sharding.gather_full_weights``)."""
        if self.world == 1:
            return
        with self.timeline.busy("weight_gather"):
            sharding.gather_full_weights(
                self.model, None if self.full_model is None else list(self.full_model.parameters()))

    def _check_resume(self, resume: train_state.Resume) -> None:
        """Replica 0: the checkpoint's model and prompt order are this run's, or
        ``ResumeError``; then the counters continue from it."""
        resume.check_model(self.model)
        if resume.path is None:
            return
        try:
            self.data.order.load_state_dict(resume.state["order"])
            if self.cfg.dataset and resume.state["data_fingerprint"] != self.data.fingerprint:
                raise ValueError(f"the prompts' fingerprint was {resume.state['data_fingerprint'][:16]}, "
                                 f"it is {self.data.fingerprint[:16]} now: the dataset file changed")
        except (KeyError, ValueError) as e:
            raise train_state.ResumeError(f"checkpoint {resume.path}: another prompt order than this "
                                          f"run's ({e})") from None
        self.resumed_dropped = resume.state["dropped"]
        self.guard.skipped = resume.state["skipped"]
        train_state.set_rng_state(resume.state["rng"])

    def _open_run_dir(self, resume: train_state.Resume | None) -> None:
        """Replica 0: a new run directory, or the resumed one with the metrics recorded
        after its checkpoint deleted; the staleness-slot counters the generators share."""
        cfg, signed = self.cfg, self.rt.signed
        state = resume.state if resume is not None else {}
        ledger = slots.SlotLedger.from_state(state.get("ledger", slots.SlotLedger().state_dict()))
        self.run_dir = resume.run_dir if resume else metrics.new_run_dir(cfg.runs_dir, cfg.run_id, self._config_dict())
        runtime.log_to_run_dir(str(self.run_dir), "trainer", 0)
        self.writer = metrics.MetricsWriter(self.run_dir, run_id=self.run_dir.name, config=self._config_dict())
        if resume is not None:
            # No checkpoint (step 0): nothing of the earlier attempt is kept.
            self.writer.resume_at(resume.step if resume.path else -1, state.get("saved_at", 0.0))
            log.info("resuming run %s at step %d (%d groups consumed, %d lost in flight to regenerate first)",
                     self.run_dir.name, resume.step, ledger.count, ledger.missing)
        self.tensorboard = TensorBoardMirror(self.run_dir) if cfg.tensorboard else None
        # Signed records (llamarl.app.control.signed); the ledger and the resume point are re-published if
        # anyone overwrites them.
        self.resumed_freed = state.get("dropped_groups", 0)  # their slots were refilled
        slots.publish_start(signed, ledger, self.resumed_freed)
        signed.put(names.RESUME_KEY, {
            "step": resume.step if resume else 0,
            "train_state": str(resume.train_state) if resume and resume.train_state else ""}, keep=True)

    def _config_dict(self) -> dict:
        return {"mode": "async" if self.cfg.max_staleness > 0 else "sync",
                "num_generators": self.num_generators, "num_reward": self.num_reward,
                "trainer_ranks": self.world, **cli.to_dict(self.cfg), **cli.to_dict(self.gen)}

    # --- the loop ----------------------------------------------------------------------
    def _sync(self) -> None:
        """Every rank: its shard of the current version to every generator; its bytes and
        seconds are the dashboard's per-sender row (``trainer/<rank>``). With the digest
        on, the rank hashes that shard on a thread while it is on the wire and publishes
        the signed record after the send (``llamarl.app.weights.digest``: a generator hashes what
        it received first, then waits for the record)."""
        pending = self.digest.start(self.version) if self.digest is not None else None
        if self.rank == 0:
            # Published before the send: a generator may push a group of this version as soon
            # as it has the weights, and a reader (a reward executor) refuses a version it has
            # not seen published as from the future.
            self.rt.control.set_version(self.version)
        with self.timeline.busy("weight_sync"):
            stats = self.sender.send(self.version)
        if pending is not None:
            t0 = time.perf_counter()
            with self.timeline.busy("weight_digest"):
                hashed_s = pending.publish()
            self.rt.emit(metrics.scalars({names.WEIGHT_DIGEST_S: hashed_s,
                                          names.WEIGHT_DIGEST_WAIT_S: time.perf_counter() - t0},
                                         role="trainer", replica=self.rank, step=self.version))
        self.rt.emit([metrics.weight_sync(stats.version, names.member("trainer", self.rank), stats.bytes,
                                          stats.seconds)])

    def _drain_metrics(self) -> None:
        """Replica 0 writes its own events directly and everyone else's from the queue."""
        self._record(self.rt.take_metrics() + self.timeline.drain())
        queue = self.rt.queue(names.METRICS)
        while msgs := queue.pop_many(256, timeout_s=0.0, on_reject=self.rejections):
            events = []
            for m in msgs:
                try:
                    source, seq, batch = metrics.checked_batch(m)
                except metrics.MalformedEvents as e:  # signed, yet not ours: dropped, counted
                    self.rejections(e.reason, f"queue {names.METRICS!r}: {e}", "events")
                    continue
                if source[2] != self.attempt:  # captured before a resume: its events were written then
                    self.rejections(REPLAY, f"queue {names.METRICS!r}: batch {seq} of {source[0]} of another attempt")
                    continue
                if not self.seen_batches.add(source, seq):
                    self.rejections(REPLAY, f"queue {names.METRICS!r}: batch {seq} of {source[0]} again")
                    continue
                self.rejections.accepted()
                events += batch
            self._record(events)

    def _record(self, events: list[dict]) -> None:
        self.writer.write(events)
        if self.tensorboard is not None:
            self.tensorboard.write(events)

    def evaluate(self, step: int) -> dict[str, float]:
        if not self.data.held_out:  # a dataset without --eval-dataset or --eval-fraction
            return {}
        with self.timeline.busy("eval"):
            m = steps.evaluate(self.full_model, self.tokenizer, self.data.held_out, self.gen, step,
                               self.data.format_prompt)
        self.rt.emit(steps.eval_events(m, step=step, role="trainer"))
        log.info("step %d held-out accuracy %.3f (greedy), %.3f (sampled)", step, m["accuracy"],
                 m["sampled_accuracy"])
        return m

    def save_checkpoint(self, step: int) -> None:
        """Every rank (the training state is a collective): the policy and the training
        state after ``step`` steps to ``checkpoints/step-<step>/``. Replica 0 writes the
        directory, deletes the oldest beyond ``keep_last`` and names it in config.json and
        the metrics DB."""
        t0 = time.time()
        ledger = self.slots.ledger  # every rank's (consume_across_ranks)
        root = self.run_dir / checkpoint.DIR_NAME
        if self.rank != 0:
            dist.barrier()  # replica 0 has made the step's temporary directory
            train_state.save(checkpoint.partial_path(root, step) / train_state.DIR_NAME, self.model,
                             self.optimizer, None)
            return

        def with_train_state(partial: Path) -> None:
            if self.world > 1:
                dist.barrier()
            train_state.save(partial / train_state.DIR_NAME, self.model, self.optimizer,
                             self._train_state(step, ledger))

        with self.timeline.busy("checkpoint"):
            path = checkpoint.save(self.full_model, self.tokenizer, root, step, extra=with_train_state).resolve()
            pruned = checkpoint.prune(root, self.cfg.keep_last)
            checkpoint.record_latest(self.run_dir / "config.json", step, path)
        seconds = time.time() - t0
        self.writer.set_meta(metrics.LAST_CHECKPOINT, json.dumps({"step": step, "path": str(path)}))
        self.rt.emit(metrics.scalars({names.CHECKPOINT_SAVE_S: seconds, names.CHECKPOINT_STEP: step,
                                      names.DATA_SLOT: ledger.frontier}, role="trainer", step=step))
        log.info("saved checkpoint %s in %.2f s%s", path, seconds,
                 f" (deleted {', '.join(p.name for p in pruned)})" if pruned else "")

    def _train_state(self, step: int, ledger: slots.SlotLedger) -> dict:
        """Replica 0: what ``state.json`` holds besides the model and optimizer."""
        self.data.order.position = ledger.frontier
        return {"step": step, "version": self.version, "ledger": ledger.state_dict(),
                "order": self.data.order.state_dict(), "data_fingerprint": self.data.fingerprint,
                "dropped": self.slots.dropped,
                "dropped_groups": slots.given_back(self.rt.signed, [names.member("trainer", r)
                                                                    for r in range(self.world)]),
                "skipped": self.guard.skipped, "fingerprint": train_state.fingerprint(self.full_model),
                "parameter_shapes": train_state.parameter_shapes(self.full_model),
                "rng": train_state.rng_state(), "config": self._config_dict()}

    def run(self) -> None:
        cfg = self.cfg
        step_cfg = cfg.step_config(self.gen)
        if self.rank == 0 and self.start_step == 0:
            self.evaluate(0)
        t_prev = time.time()
        for step in range(self.start_step + 1, cfg.steps + 1):
            with self.timeline.idle("wait_rollouts"):
                groups = self.stream.next_batch()
            groups = self.slots.settle(groups, self.version)
            t0 = time.time()
            train = None
            # Every rank decides alone: with several ranks, one rank's share may have no
            # usable rollout while another's has; it still takes part in the sharded step.
            if not self.guard.should_skip(groups, step) or self.world > 1:
                with self.timeline.busy("train"), devices.autocast(self.device, self.dtype):
                    train = rl.train_step(self.model, self.optimizer, steps.usable(groups), step_cfg,
                                          pad_id=self.tokenizer.pad_token_id, ref_model=self.ref_model,
                                          ranks=self.ranks,
                                          policy_version=self.version) or None  # {}: no rank had a rollout
            t_train = time.time() - t0
            save = (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps
            # The whole copy's uses: evaluation and checkpoints (the weight sync and its
            # digest are per shard).
            if step % cfg.eval_every == 0 or step == cfg.steps or save:
                self._gather_full_model()
            consumed_version = self.version
            self.version += 1
            step_s, t_prev = time.time() - t_prev, time.time()
            values = steps.step_values(groups=groups, train=train, t_train=t_train, step_s=step_s,
                                       consumed_version=consumed_version, skipped=self.guard.skipped,
                                       dropped=self.slots.dropped, idle_fraction=self.timeline.idle_fraction())
            values.update(devices.device_metrics(self.device))
            values.update({names.queue_metric(q): self.rt.queue(q).depth() for q in (names.ROLLOUTS, names.SCORED)})
            values.update(self.rejections.metrics())
            values.update(self.rt.security_metrics())
            events, values = steps.step_events(step, groups, values, consumed_version=consumed_version,
                                               reward_names=self.reward_names, role="trainer",
                                               replica=self.rank)
            if self.rank != 0:  # the other ranks' events travel to replica 0 in batches
                self.rt.emit(events + self.timeline.drain())
                self._sync()
                if save:
                    self.save_checkpoint(step)
                continue
            self.rt.emit(events + self._membership_events(step))
            self._sync()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                self.evaluate(step)
            if save:
                self.save_checkpoint(step)
            health.check_health(self.rt.control)
            self._drain_metrics()
            log.info("%s", steps.summary(step, cfg.steps, groups, values))

    def _membership_events(self, step: int) -> list[dict]:
        """Replica 0: losses and the executors alive, for the dashboard's Executors tab."""
        m = self.membership
        values = {names.FAULTS_LOST_GROUPS: m.lost_groups(),
                  names.FAULTS_DUPLICATE_GROUPS: self.slots.duplicates,
                  names.WEIGHT_REGROUPS: self.sender.regroups,
                  names.members_metric("generator"): len(m.alive("generator"))}
        if self.num_reward:
            values[names.members_metric("reward")] = len(m.alive("reward"))
        return metrics.scalars(values, role="trainer", step=step)

    def close(self, reason: str, *, failed: bool = False) -> None:
        """Every rank: stop the rollout stream's thread. Replica 0 then asks every role to
        stop, keeps the store up until they acknowledge, and writes the last metrics."""
        if hasattr(self, "stream"):
            try:
                self.stream.close()
            except TimeoutError as e:
                log.error("%s", e)
        if getattr(self, "reward", None) is not None:
            self.reward.close()  # its worker processes
        if self.rank != 0:
            return
        if self.membership is not None:
            self.membership.stop()
        runtime.end_app(self.rt, expected_members(self.num_generators, self.num_reward, self.world), reason,
                        failed=failed)
        if hasattr(self, "writer"):
            try:
                self._drain_metrics()
                # What was refused after the last step (frames, control writes) is counted too.
                if counts := {**self.rejections.metrics(), **self.rt.security_metrics()}:
                    self._record(metrics.scalars(counts, role="trainer", step=self.version))
            finally:
                self.writer.close(finished=not failed)
                if self.tensorboard is not None:
                    self.tensorboard.close()
            log.info("run %s: %s; run directory %s", "failed" if failed else "finished", reason, self.run_dir)


def trainer_parser() -> argparse.ArgumentParser:
    parser = cli.RaisingParser(prog="llamarl.app.roles.trainer", description=__doc__.splitlines()[0])
    cli.add_store_arguments(parser)
    parser.add_argument("--num-generators", type=int, required=True, help="generator replicas in the app")
    parser.add_argument("--num-reward", type=int, default=0, help="reward replicas (0: score inline)")
    cli.add_config_args(parser, TrainerConfig)
    cli.add_config_args(parser, GeneratorConfig)
    return parser


def _early_arguments(argv: list[str]) -> argparse.Namespace:
    """What replica 0 needs before it validates anything: where to host the store, and
    which roles to wait for if the rest of the flags are wrong (counts read leniently)."""
    parser = argparse.ArgumentParser(add_help=False)
    cli.add_store_arguments(parser)
    for flag in ("--num-generators", "--num-reward"):
        parser.add_argument(flag, default="0")
    args, _ = parser.parse_known_args(argv)
    for name in ("num_generators", "num_reward"):
        value = getattr(args, name)
        setattr(args, name, int(value) if value.isdigit() else 0)
    return args


def _parse(parser: argparse.ArgumentParser, argv: list[str], world: int):
    args = parser.parse_args(argv)
    try:
        cfg, gen = cli.config_from_args(args, TrainerConfig), cli.config_from_args(args, GeneratorConfig)
    except (TypeError, ValueError) as e:
        raise errors.ConfigError(f"llamarl.app.roles.trainer: {e}") from None
    if cfg.prompts_per_step % world:
        raise errors.ConfigError("llamarl.app.roles.trainer: prompts_per_step must be divisible by the number of trainer ranks")
    return args, cfg, gen


def expected_members(num_generators: int, num_reward: int, world: int) -> list[str]:
    """Every member of the app, whether it has registered yet or not."""
    return ([names.member("generator", i) for i in range(num_generators)]
            + [names.member("reward", i) for i in range(num_reward)]
            + [names.member("trainer", r) for r in range(world)])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        trainer_parser().parse_args(argv)  # prints the help and exits
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    health.enable_crash_reports(names.member("trainer", rank))
    runtime.setup_logging("trainer", rank)
    with health.reported(stops=True):
        early = _early_arguments(argv)
        port = names.store_port(early.store_port, early.app_id)
        if world > 1:
            # Gloo for CPU tensors, NCCL for CUDA ones: --device is read after this.
            dist.init_process_group(devices.trainer_backend())
        try:
            # Replica 0 hosts the store before it reads a single flag: whatever fails from
            # here on is published as the app's failure cause, and every role stops.
            host = transport.store_client_host(early.store_bind, early.store_host)
            store = (runtime.host_app_store(port, early.app_id, early.store_bind) if rank == 0
                     else runtime.connect_app_store(f"{host}:{port}", early.app_id, RANK_CONNECT_TIMEOUT_S))
            if rank != 0:
                log.info("reached the control store at %s:%d", host, port)
            secret = frames.read_secret(early.secret_file)
            with runtime.Runtime.join("trainer", rank, store, secret) as rt:
                if "LOCAL_RANK" in os.environ:  # under torchrun: do not outlive its agent
                    health.watch_parent(lambda pid: rt.control.mark_failed(
                        "trainer", rank, f"its torchrun agent (pid {pid}) is gone"))
                _train(rt, argv, early, rank, world)
        finally:
            if world > 1:
                dist.destroy_process_group()


def _train(rt: runtime.Runtime, argv: list[str], early: argparse.Namespace, rank: int, world: int) -> None:
    trainer: Trainer | None = None
    try:
        args, cfg, gen = _parse(trainer_parser(), argv, world)
        trainer = Trainer(rt, cfg, gen, num_generators=args.num_generators, num_reward=args.num_reward,
                          rank=rank, world=world)
        trainer.start()
        trainer.run()
    except BaseException as e:
        # "Connection reset by peer" is not a cause: the member that vanished is.
        own = (transport.Stopped, health.AppFailed, errors.ConfigError)
        peer = health.blame_peer(rt.control, e) if isinstance(e, Exception) and not isinstance(e, own) else None
        if isinstance(e, transport.Stopped):
            reason = rt.control.stop_reason() or "stopped"
        else:
            reason = f"{type(peer or e).__name__}: {peer or e}"
        # Said now, not only at exit: ending the app waits for the others' acknowledgements,
        # and a scheduler that kills the job when the first role exits non-zero (SLURM's
        # heterogeneous job) may end this process in that wait.
        log.error("failed: %s", reason)
        rt.failure_logged = True
        if trainer is not None:
            trainer.close(reason, failed=True)
        elif rank == 0:
            runtime.end_app(rt, expected_members(early.num_generators, early.num_reward, world), reason,
                            failed=True)
        if peer is not None:
            raise peer from e
        raise
    trainer.close(f"finished {cfg.steps} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
