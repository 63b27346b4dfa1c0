"""Trainer replica 0's duties as the app's single controller, and the other ranks' share.

Replica 0 of the trainer hosts the control store (``llamarl.app.roles.trainer.main``) and,
in ``Controller``:

- refuses bad input before anything trains (data, rewards, precision, a resume that does
  not match), reads and prepares the prompts, and opens the run directory (a new one, or
  the resumed one with what was recorded after its checkpoint deleted);
- publishes the run's config, prompts and policy, the slot records the generators
  reserve from (``llamarl.app.control.slots.publish_start``) and the resume point;
- with ``--max-staleness auto``, decides the staleness bound between steps
  (``llamarl.app.control.bound``);
- watches which executors are alive (``llamarl.app.control.membership``) and waits for
  every generator's check of the prompts;
- keeps a whole copy of the policy (with several ranks; with one it is the policy): what held-out
  evaluation samples from (at ``--eval-precision``) and what a checkpoint's policy is written from;
- after every step: the losses and executors alive, evaluation, the checkpoint's directory, the
  health check, and the metrics: it is the only writer of the metrics database (and the
  TensorBoard mirror), draining every role's events;
- ends the app: asks every role to stop (or publishes the failure), waits for their
  acknowledgements, writes the last metrics.

Every other trainer rank holds a ``Follower``: the same calls, with only its share of
them (its shard of each checkpoint). The trainer's loop calls whichever it holds, with
no rank test of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import socket
import time
from typing import IO
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.app import cli, names
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.control import bound, health, membership, overdue, runtime, slots
from llamarl.app.control.seen_groups import REPLAY, SeenIds
from llamarl.app.data import sources as data
from llamarl.app.envs import slots as env_slots
from llamarl.app.metrics import events as metrics
from llamarl.app.metrics.tensorboard import TensorBoardMirror, summary_writer_class
from llamarl.app.model.policy import load_tokenizer
from llamarl.app.rl import steps
from llamarl.app.rl.contract import Rejections, RolloutGroup
from llamarl.app.sampling.precision import check_precision, sampling_at
from llamarl.app.state import checkpoint, train_state
from llamarl.app.weights.layout import flatten_parameters_

log = logging.getLogger("llamarl")

START_TIMEOUT_S = 900.0
"""How long the start waits for the config, the members and the generators' check of the prompts."""


@dataclasses.dataclass
class Carried:
    """The counters a resumed run continues from its checkpoint (replica 0's)."""

    dropped: int = 0
    skipped: int = 0
    given_back: int = 0


@dataclasses.dataclass
class Snapshot:
    """One trainer rank's part of a checkpoint: its model and optimizer (shards of them
    with several ranks) and the loop's counters."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    version: int
    ledger: slots.SlotLedger
    dropped: int
    skipped: int


@dataclasses.dataclass
class StepDone:
    """What one training step leaves for the controller's hook."""

    step: int
    version: int
    """The policy version the step made."""
    groups: list[RolloutGroup]
    values: dict[str, float]
    duplicates: int
    checkpoint: Snapshot | None
    """The step's checkpoint, when it saves one."""


def expected_members(num_generators: int, num_reward: int, world: int) -> list[str]:
    """Every member of the app, whether it has registered yet or not."""
    return ([names.member("generator", i) for i in range(num_generators)]
            + [names.member("reward", i) for i in range(num_reward)]
            + [names.member("trainer", r) for r in range(world)])


def wait_for_members(rt: runtime.Runtime, num_generators: int, num_reward: int, world: int) -> None:
    """Until every member registered; one that fails or dies meanwhile is named at once."""
    expected = {"generator": num_generators, "reward": num_reward, "trainer": world}
    rt.control.wait_for_members(expected, timeout_s=START_TIMEOUT_S, should_stop=rt.should_stop,
                                health=lambda: health.check_health(rt.control))


class Controller:
    """Trainer replica 0's duties (module docstring), in the order the trainer calls them: ``prepare``,
    ``open_run``, ``wait_for_members``, then ``before_steps``, ``after_step`` once per step, ``close``."""

    def __init__(self, rt: runtime.Runtime, cfg: TrainerConfig, gen: GeneratorConfig, *, num_generators: int,
                 num_reward: int, world: int, timeline: metrics.Timeline, rejections: Rejections) -> None:
        self.rt, self.cfg, self.gen = rt, cfg, gen
        self.num_generators, self.num_reward, self.world = num_generators, num_reward, world
        self.timeline, self.rejections = timeline, rejections
        self.resume: train_state.Resume | None = None
        self.policy: Path | None = None
        self.version = 0  # the last step's policy version: what the last metrics are recorded at
        self.first_step = 1  # this start's first step (``before_steps``)
        self.data: data.RunData | None = None
        self.full_model: torch.nn.Module | None = None  # the whole copy (``open_run``)
        self.tokenizer = None
        self.run_dir: Path | None = None
        self.writer: metrics.MetricsWriter | None = None
        self.run_lock: IO[str] | None = None  # the run directory's (``train_state.hold_run_dir``)
        self.tensorboard: TensorBoardMirror | None = None
        self.weight_plane = None  # this rank's sender, the plane's leader (``watch_weight_plane``)
        self.attempt = ""  # this start's: metrics batches of another are refused
        self.seen_batches = SeenIds()  # the metrics batches written
        # A generator or reward executor killed before it registers is lost from the start
        # of the wait for members, survivable while others of its role are alive.
        self.membership = membership.Membership(rt.signed, {"generator": num_generators, "reward": num_reward},
                                                watch_heartbeats=False)
        self.bound = (bound.AutoBound(rt.signed, cfg, generators=lambda: len(self.membership.alive("generator")),
                                      emit=rt.emit) if cfg.auto else None)

    # --- start -------------------------------------------------------------------------
    def prepare(self) -> Path:
        """Bad input stops the run here, before the policy loads and anything trains; the
        store is up, so the error is the app's failure cause for every role. The prompts
        read and prepared; the policy's path."""
        cfg = self.cfg = data.absolute_paths(self.cfg)
        # The generators' and the evaluation's precision, against this machine's kind of
        # device; each generator checks its own device again before it loads weights.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        check_precision(self.gen.gen_precision, device)
        check_precision(cfg.eval_at(self.gen), device, "--eval-precision")
        if cfg.tensorboard:
            summary_writer_class()  # a missing package fails here, before the run directory
        self.resume = train_state.find_resume(cfg.runs_dir, cfg.run_id, cfg.resume)
        if self.resume is not None:  # before anything of the run is read or written
            self.run_lock = train_state.hold_run_dir(self.resume.run_dir, self._holder())
        policy = data.resolve_policy(cfg.policy, env=self.gen.env, log=log.info)
        # Capped before it is checked against a resumed run's config and published.
        cfg = self.cfg = data.fit_prompt_budget(cfg, self.gen, policy, log=log.info)
        if self.resume is not None:
            self.resume.check(self._config_dict(), steps=cfg.steps)
        elif cfg.resume:
            log.info("--resume auto: no run to resume in %s; starting run %s", cfg.runs_dir, cfg.run_id)
        self.data = data.prepare(data.read(cfg, log=log.info), cfg, load_tokenizer(policy), log=log.info)
        self.policy = policy
        return policy

    def open_run(self, model: torch.nn.Module, tokenizer) -> Carried:
        """The loaded policy against the checkpoint (every check before the run directory
        is touched); then the run directory, and everything the other roles read. Keeps
        the whole copy: ``model`` itself with one rank, a copy of it (before it is
        sharded) with several; its parameters are views of one flat buffer per dtype (with
        one rank, the weight sync sends each as one broadcast with no packing)."""
        carried = self._check_resume(model) if self.resume is not None else Carried()
        self._open_run_dir(carried)
        data.publish(self.rt.signed, self.data)  # before the config: generators read it after
        runtime.publish_config(self.rt.signed, self.cfg, self.gen, policy_path=str(self.policy.resolve()),
                               run_dir=str(self.run_dir.resolve()))
        self.attempt = runtime.run_attempt(self.rt)
        self.version = self.resume.step if self.resume is not None else 0
        self.rt.emit(metrics.scalars(self.data.counts, role="trainer", step=0))
        log.info("run directory %s", self.run_dir)
        self.full_model = model if self.world == 1 else copy.deepcopy(model)
        flatten_parameters_(self.full_model)
        self.tokenizer = tokenizer
        return carried

    def _check_resume(self, model: torch.nn.Module) -> Carried:
        """The checkpoint's model and prompt order are this run's, or ``ResumeError``; then
        the counters continue from it."""
        resume = self.resume
        resume.check_model(model)
        if resume.path is None:
            return Carried()
        try:
            self.data.order.load_state_dict(resume.state["order"])
            if self.cfg.dataset and resume.state["data_fingerprint"] != self.data.fingerprint:
                raise ValueError(f"the prompts' fingerprint was {resume.state['data_fingerprint'][:16]}, "
                                 f"it is {self.data.fingerprint[:16]} now: the dataset file changed")
        except (KeyError, ValueError) as e:
            raise train_state.ResumeError(f"checkpoint {resume.path}: another prompt order than this "
                                          f"run's ({e})") from None
        train_state.set_rng_state(resume.state["rng"])
        return Carried(dropped=resume.state["dropped"], skipped=resume.state["skipped"],
                       given_back=resume.state.get("dropped_groups", 0))

    def _open_run_dir(self, carried: Carried) -> None:
        """A new run directory, or the resumed one with the metrics recorded after its
        checkpoint deleted; the slot records the generators share; the resume point."""
        cfg, resume, signed = self.cfg, self.resume, self.rt.signed
        state = resume.state if resume is not None else {}
        ledger = slots.SlotLedger.from_state(state.get("ledger", slots.SlotLedger().state_dict()))
        self.run_dir = resume.run_dir if resume else metrics.new_run_dir(cfg.runs_dir, cfg.run_id, self._config_dict())
        if self.run_lock is None:  # a new run: a --resume of it while it runs is refused
            self.run_lock = train_state.hold_run_dir(self.run_dir, self._holder())
        runtime.log_to_run_dir(str(self.run_dir), "trainer", 0)
        self.writer = metrics.MetricsWriter(self.run_dir, run_id=self.run_dir.name, config=self._config_dict())
        if resume is not None:
            # No checkpoint (step 0): nothing of the earlier attempt is kept.
            self.writer.resume_at(resume.step if resume.path else -1, state.get("saved_at", 0.0))
            log.info("resuming run %s at step %d (%d groups consumed, %d lost in flight to regenerate first)",
                     self.run_dir.name, resume.step, ledger.count, ledger.missing)
        self.tensorboard = TensorBoardMirror(self.run_dir) if cfg.tensorboard else None
        # Signed records (llamarl.app.control.signed), re-published if anyone overwrites them.
        slots.publish_start(signed, ledger, carried.given_back)  # their slots were refilled
        if self.bound is not None:  # before the trainer ranks read it (``published_bound``)
            self.bound.start(resume.step if resume else 0, state.get("staleness_bound"))
        signed.put(names.RESUME_KEY, {
            "step": resume.step if resume else 0,
            "train_state": str(resume.train_state) if resume and resume.train_state else ""}, keep=True)

    def _config_dict(self) -> dict:
        return {"mode": "async" if self.cfg.auto or self.cfg.max_staleness > 0 else "sync",
                "num_generators": self.num_generators, "num_reward": self.num_reward,
                "trainer_ranks": self.world, **cli.to_dict(self.cfg), **cli.to_dict(self.gen)}

    def wait_for_members(self) -> None:
        """Every member registered and every generator checked the prompts; from then on
        a silent generator or reward executor is lost too (survivable while others of its
        role are alive); the weight plane regroups without it."""
        self.membership.start()
        wait_for_members(self.rt, self.num_generators, self.num_reward, self.world)
        data.wait_for_checks(self.rt, [names.member("generator", i) for i in range(self.num_generators)],
                             timeout_s=START_TIMEOUT_S, health=lambda: health.check_health(self.rt.control))
        self.membership.watch_heartbeats = True

    def _holder(self) -> str:
        where = f"pid {os.getpid()} on {socket.gethostname()}"
        if not self.rt.store.check([names.APP_ID_KEY]):  # a store made by hand, without an app
            return f"a trainer ({where})"
        return f"app {self.rt.store.get(names.APP_ID_KEY).decode(errors='replace')} ({where})"

    def watch_weight_plane(self, sender) -> None:
        """Replica 0's sender leads the weight plane: its regroups are the Executors tab's."""
        self.weight_plane = sender

    @property
    def gone(self):
        """The executors taken out of the run (the weight plane leaves them out)."""
        return self.membership.gone

    def watch_slots(self, ledger: slots.SlotLedger, waited: overdue.WaitClock) -> None:
        """From now on the watcher returns overdue slots (``llamarl.app.control.overdue``):
        ``ledger`` is this rank's, before it consumes anything; ``waited``, the time its
        loop spent waiting for rollouts."""
        m, trainers = self.membership, [names.member("trainer", r) for r in range(self.world)]
        m.deadlines = overdue.Deadlines(m.signed, ledger, waited, deadline_s=self.cfg.slot_deadline_s,
                                        holders=lambda: m.alive("generator") + m.alive("reward") + trainers)

    # --- every step --------------------------------------------------------------------
    def before_steps(self, start_step: int) -> None:
        self.first_step = start_step + 1  # the step whose completions no_answer_warning looks at
        if start_step == 0:
            self.evaluate(0)

    def after_step(self, done: StepDone) -> None:
        step, cfg = done.step, self.cfg
        self.version = done.version
        m = self.membership
        faults = {names.FAULTS_LOST_GROUPS: m.lost_groups(), names.FAULTS_DUPLICATE_GROUPS: done.duplicates,
                  names.FAULTS_OVERDUE_GROUPS: m.deadlines.overdue if m.deadlines is not None else 0,
                  names.WEIGHT_REGROUPS: self.weight_plane.regroups if self.weight_plane is not None else 0,
                  names.members_metric("generator"): len(m.alive("generator"))}
        if self.num_reward:
            faults[names.members_metric("reward")] = len(m.alive("reward"))
        self.rt.emit(metrics.scalars(faults, role="trainer", step=step))  # the Executors tab
        if step % cfg.eval_every == 0 or step == cfg.steps:
            self.evaluate(step)
        if done.checkpoint is not None:
            self._drain_metrics()  # the step's metrics in the DB before a checkpoint says it happened
            self.save_checkpoint(step, done.checkpoint)
        health.check_health(self.rt.control)
        self._drain_metrics()
        log.info("%s", steps.summary(step, cfg.steps, done.groups, done.values))
        warning = (steps.no_answer_warning(step, done.values, max_new_tokens=self.gen.max_new_tokens)
                   if step == self.first_step else None)
        if warning:
            log.warning("%s", warning)

    def next_bound(self, step: int, version: int, values: dict[str, float]) -> int:
        """``--max-staleness auto``: the bound for the batches from ``version`` on, decided
        from ``step``'s scalars and published to the generators (``llamarl.app.control.bound``)."""
        return self.bound.decide(step, version, values).bound

    def evaluate(self, step: int) -> dict[str, float]:
        if not self.data.held_out and not self.gen.env:  # a dataset without --eval-dataset or --eval-fraction
            return {}
        with self.timeline.busy("eval"), sampling_at(self.full_model, self.cfg.eval_at(self.gen)):
            m = (env_slots.evaluate(self.full_model, self.tokenizer, self.cfg, self.gen, step) if self.gen.env else
                 steps.evaluate(self.full_model, self.tokenizer, self.data.held_out, self.gen, step,
                                self.data.format_prompt, samples=self.cfg.eval_samples))
        self.rt.emit(steps.eval_events(m, step=step, role="trainer"))
        log.info("step %d held-out accuracy %.3f (greedy), %.3f (sampled)", step, m["accuracy"], m["sampled_accuracy"])
        return m

    def save_checkpoint(self, step: int, snap: Snapshot) -> None:
        """With every other rank (the training state is a collective): the policy and training state
        after ``step`` to ``checkpoints/step-<step>/``, pruned to ``keep_last``, named in config.json and the DB."""
        t0 = time.time()
        root = self.run_dir / checkpoint.DIR_NAME

        def with_train_state(partial: Path) -> None:
            if self.world > 1:
                dist.barrier()  # the followers write their shards into it from here
            train_state.save(partial / train_state.DIR_NAME, snap.model, snap.optimizer, self._train_state(step, snap))

        with self.timeline.busy("checkpoint"):
            path = checkpoint.save(self.full_model, self.tokenizer, root, step, extra=with_train_state).resolve()
            pruned = checkpoint.prune(root, self.cfg.keep_last)
            checkpoint.record_latest(self.run_dir / "config.json", step, path)
        seconds = time.time() - t0
        self.writer.set_meta(metrics.LAST_CHECKPOINT, json.dumps({"step": step, "path": str(path)}))
        self._record(metrics.scalars({names.CHECKPOINT_SAVE_S: seconds, names.CHECKPOINT_STEP: step,
                                      names.DATA_SLOT: snap.ledger.frontier}, role="trainer", step=step))
        log.info("saved checkpoint %s in %.2f s%s", path, seconds,
                 f" (deleted {', '.join(p.name for p in pruned)})" if pruned else "")

    def _train_state(self, step: int, snap: Snapshot) -> dict:
        """What ``state.json`` holds besides the model and optimizer."""
        self.data.order.position = snap.ledger.frontier
        return {"step": step, "version": snap.version, "ledger": snap.ledger.state_dict(),
                "order": self.data.order.state_dict(), "data_fingerprint": self.data.fingerprint,
                "dropped": snap.dropped,
                "dropped_groups": slots.given_back(self.rt.signed, [names.member("trainer", r)
                                                                    for r in range(self.world)]),
                "skipped": snap.skipped, "fingerprint": train_state.fingerprint(self.full_model),
                "parameter_shapes": train_state.parameter_shapes(self.full_model),
                "rng": train_state.rng_state(), "config": self._config_dict(),
                "staleness_bound": self.bound.state_dict() if self.bound is not None else None}

    def _drain_metrics(self) -> None:
        """Its own events directly, and everyone else's from the queue."""
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
        if self.bound is not None:
            self.bound.saw(events)
        self.writer.write(events)
        if self.tensorboard is not None:
            self.tensorboard.write(events)

    # --- the end -----------------------------------------------------------------------
    def close(self, reason: str, *, failed: bool = False) -> None:
        """Ask every role to stop, keep the store up until they acknowledge, and write the
        last metrics (once the run directory is open)."""
        self.membership.stop()
        runtime.end_app(self.rt, expected_members(self.num_generators, self.num_reward, self.world), reason,
                        failed=failed)
        if self.writer is None:
            return
        try:
            self._drain_metrics()
            # What was refused after the last step (frames, control writes) is counted too.
            if counts := {**self.rejections.metrics(), **self.rt.security_metrics()}:
                self._record(metrics.scalars(counts, role="trainer", step=self.version))
        finally:
            self.writer.close(finished=not failed)
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.run_lock is not None:
                self.run_lock.close()
        log.info("run %s: %s; run directory %s", "failed" if failed else "finished", reason, self.run_dir)


class Follower:
    """A trainer rank other than 0: the controller's calls, with only its share of them."""

    def __init__(self, rt: runtime.Runtime, *, num_generators: int, num_reward: int, world: int) -> None:
        self.rt = rt
        self.num_generators, self.num_reward, self.world = num_generators, num_reward, world
        self.run_dir: Path | None = None
        self.full_model: torch.nn.Module | None = None  # replica 0 keeps the whole copy
        self.gone = None  # replica 0 watches the executors

    def prepare(self) -> str:
        """The policy's path, once replica 0 published the run's config."""
        _, _, policy = runtime.read_config(self.rt, START_TIMEOUT_S)
        self.run_dir = Path(self.rt.signed.get(names.CONFIG_KEY)["run_dir"])
        return policy

    def open_run(self, model: torch.nn.Module, tokenizer) -> Carried:
        return Carried()

    def wait_for_members(self) -> None:
        wait_for_members(self.rt, self.num_generators, self.num_reward, self.world)

    def watch_weight_plane(self, sender) -> None:
        pass

    def watch_slots(self, ledger: slots.SlotLedger, waited: overdue.WaitClock) -> None:
        pass  # replica 0 watches the slots

    def before_steps(self, start_step: int) -> None:
        pass

    def next_bound(self, step: int, version: int, values: dict[str, float]) -> int:
        return -1  # replica 0 decides; the trainer's loop shares its decision (a collective)

    def after_step(self, done: StepDone) -> None:
        """Its shard of the step's checkpoint, into the directory replica 0 made."""
        if done.checkpoint is None:
            return
        dist.barrier()  # replica 0 has made the step's temporary directory
        root = self.run_dir / checkpoint.DIR_NAME
        train_state.save(checkpoint.partial_path(root, done.step) / train_state.DIR_NAME, done.checkpoint.model,
                         done.checkpoint.optimizer, None)

    def close(self, reason: str, *, failed: bool = False) -> None:
        pass
