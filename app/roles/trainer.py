"""Trainer executor: consumes scored rollouts, steps the optimizer, publishes weights.

    python -m llamarl.app.roles.launch --nproc-per-node 1 --store-port 29600 --app-id APP \\
        --num-generators 2 --num-reward 0 [TrainerConfig and GeneratorConfig flags]

The loop every trainer rank runs (one message per rollout group; app/rl/contract.py)::

    generator/i --(queue "rollouts")--> [reward/j --(queue "scored")-->] trainer pipeline
        ^                                                                      |
        |                  pipelines/rollouts.py: poll -> contract check -> score (inline)
        |                  -> advantages -> staleness filter -> batch          |
        |                                       slots settled (app/control/slots.py)
        |                                                                      v
        |                                                 rl.train_step (AIPO), version += 1
        |                                                                      |
        +-------- weight plane: broadcast of version v+1 (gloo / NCCL) <-------+
                                                                               |
                                               controller hook (app/roles/controller.py)

Replica 0 is also the app's single controller (``llamarl.app.roles.controller.Controller``:
run directory, config, metrics, membership, evaluation, checkpoints, the end of the app);
the other ranks hold a ``Follower`` in its place. With ``nproc_per_node > 1`` the policy
is sharded over the trainer ranks with FSDP2 (``llamarl.app.rl.sharding``); each rank
pulls its share of groups from the same queue, and a step is the one a single process
would take on all the ranks' groups. Every rank sends its own shard straight to every
generator after every step (``llamarl.app.weights.publisher``).

Checkpoints (``--save-every``) hold the policy and the training state
(``llamarl.app.state.train_state``); ``--resume`` continues a run from its newest one. The run's
config, model and prompt order are checked before anything is written, the metrics
database drops what was recorded after the checkpoint, and the generators regenerate
the groups the checkpoint had not consumed (the slot ledger): no group is trained twice.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from llamarl.app import cli, devices, errors, names
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.control import frames, health, incarnations, overdue, runtime, slots, transport
from llamarl.app.control.bound import published_bound
from llamarl.app.metrics import events as metrics
from llamarl.app.model.policy import load_policy
from llamarl.app.rewards import build_reward, parse_spec
from llamarl.app.rl import sharding, steps
from llamarl.app.rl import step as rl
from llamarl.app.rl.contract import Rejections, RolloutGroup
from llamarl.app.roles.controller import Controller, Follower, Snapshot, StepDone, expected_members
from llamarl.app.state import train_state
from llamarl.app.weights.publisher import Publisher
from llamarl.pipelines.rollouts import RolloutStream

log = logging.getLogger("llamarl")

ROLLOUT_SILENCE_S = 600.0
"""No rollout at all for this long (or twice ``--slot-deadline-s``, if longer: a lost
group is regenerated before then) fails the run: are the producers alive?"""
RANK_CONNECT_TIMEOUT_S = 60.0
"""Trainer ranks > 0 reach replica 0's store (``--store-host``); torchrun starts them together."""


class Trainer:
    """One trainer rank: ``start`` (the policy, the optimizer, the weight plane, the
    rollout stream), ``run`` (the loop), ``close``. ``duties``: replica 0's
    ``Controller``, a ``Follower`` on the other ranks."""

    def __init__(self, rt: runtime.Runtime, cfg: TrainerConfig, gen: GeneratorConfig, *,
                 num_generators: int, num_reward: int, rank: int, world: int) -> None:
        self.rt, self.cfg, self.gen = rt, cfg, gen
        self.num_generators, self.num_reward = num_generators, num_reward
        self.rank, self.world = rank, world
        self.device = devices.choose_device(cfg.device)
        self.dtype = devices.train_dtype(cfg.train_precision, self.device)
        # On a GPU a busy interval ends when the GPU is done: idle time is GPU idle time.
        self.timeline = metrics.Timeline("trainer", rank,
                                         busy_ends=functools.partial(devices.synchronize, self.device))
        self.rejections = Rejections(f"trainer/{rank}")
        counts = dict(num_generators=num_generators, num_reward=num_reward, world=world)
        self.duties: Controller | Follower = (
            Controller(rt, cfg, gen, timeline=self.timeline, rejections=self.rejections, **counts) if rank == 0
            else Follower(rt, **counts))
        self.guard = steps.SkipGuard()
        self.version = self.start_step = 0  # the checkpoint's step after a resume
        self.reward_names: list[str] = []
        self.reward = None  # inline scoring (no reward executors)
        self.model = self.tokenizer = self.ref_model = self.optimizer = None
        self.ranks: sharding.Ranks | None = None  # several ranks: the policy is sharded
        self.slots: slots.Settlement | None = None
        self.publisher: Publisher | None = None  # the weight plane (``publish_weights``)
        self.stream: RolloutStream | None = None
        self.waited = overdue.WaitClock()  # for the overdue slots' deadline (replica 0)

    # --- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        cfg, rt = self.cfg, self.rt
        log.info("trainer rank %d on %s, training in %s", self.rank, devices.describe(self.device),
                 "bf16 autocast over fp32 weights" if self.dtype == torch.bfloat16 else "fp32")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # A bad reward spec (an unknown name, bad options) fails first, in a second; the
        # reward executors resolve their own copy.
        self.reward_names = [c.name for c in parse_spec(cfg.rewards)]
        self.reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s) if self.num_reward == 0 else None
        policy = self.duties.prepare()
        self.model, self.tokenizer = load_policy(policy, device=self.device)
        # The KL reference is a whole copy on every rank, never sharded: it runs forward
        # passes only, no collective. Made before a resumed state loads: the KL stays to
        # the starting policy.
        self.ref_model = copy.deepcopy(self.model).eval() if cfg.kl_coef > 0 else None
        carried = self.duties.open_run(self.model, self.tokenizer)
        self.guard.skipped = carried.skipped
        attempt = runtime.run_attempt(rt)  # this start's: groups of another are refused
        resumed = rt.wait_key(names.RESUME_KEY, 60.0, "resume point")
        self.start_step = self.version = resumed["step"]
        # auto: the bound replica 0 published before the resume point (a resumed run's own)
        bound = published_bound(rt.signed, cfg.start_bound) if cfg.auto else cfg.start_bound
        self.slots = slots.Settlement(
            rt.signed, rank=self.rank, world=self.world, max_staleness=bound,
            ledger=slots.SlotLedger.from_state(rt.wait_key(names.SLOTS_DONE_KEY, 60.0, "slot ledger")),
            rejections=self.rejections, emit=rt.emit, dropped=carried.dropped, freed=carried.given_back)
        self.duties.watch_slots(self.slots.ledger, self.waited)
        if self.world > 1:  # replica 0 keeps a whole copy (``Controller.open_run``)
            self.ranks = sharding.Ranks(next(self.model.parameters()).device)
            described = sharding.shard(self.model)  # every rank: it gathers each rank's share
            if self.rank == 0:
                log.info(described)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        if resumed["train_state"]:
            train_state.load(resumed["train_state"], self.model, self.optimizer)
            self._gather_full_model()
            log.info("resumed from %s at step %d", resumed["train_state"], self.start_step)
        if self.reward is not None:
            self.reward.load()
        self.duties.wait_for_members()
        self._open_weight_plane()
        inline = self.num_reward == 0
        self.stream = RolloutStream(
            rt.queue(names.ROLLOUTS if inline else names.SCORED),
            cfg.stream_config(ranks=self.world, vocab_size=self.model.get_input_embeddings().num_embeddings,
                              silence_s=ROLLOUT_SILENCE_S),
            reward=self.reward, settlement=self.slots, rejections=self.rejections, should_stop=rt.should_stop,
            health=lambda: health.check_health(rt.control),
            # A version from the future is one above the newest published (replica 0 publishes
            # each before it sends it): one store read per new version.
            admit=incarnations.admission(rt.signed, attempt, published_version=rt.control.version))
        if cfg.auto:
            self.stream.set_bound(bound)

    def _gather_full_model(self) -> None:
        """Every rank (a collective with several): the shards' current values into replica
        0's whole copy (``sharding.gather_full_weights``), what it evaluates and saves."""
        if self.world == 1:
            return
        full = self.duties.full_model
        with self.timeline.busy("weight_gather"):
            sharding.gather_full_weights(self.model, None if full is None else list(full.parameters()))

    # --- the weight plane ------------------------------------------------------------------
    def _open_weight_plane(self) -> None:
        """Every trainer rank sends its own shard straight to every generator (no gather);
        rank 0 leads the plane's epochs; each signs its shard's digest
        (``llamarl.app.weights.publisher``); then the first version goes out."""
        self.publisher = Publisher(self.rt, list(self.model.named_parameters()), rank=self.rank, ranks=self.world,
                                   num_generators=self.num_generators, timeout_s=self.cfg.weight_sync_timeout_s,
                                   digest=self.cfg.weight_digest, gone=self.duties.gone, timeline=self.timeline)
        self.duties.watch_weight_plane(self.publisher)
        self.publisher.start()
        self.publish_weights()

    def publish_weights(self) -> None:
        """Every rank: its shard of the current version to every generator, with its signed
        digest and metrics (``llamarl.app.weights.publisher``)."""
        self.publisher.publish(self.version)

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        """next batch (settled) -> train step -> publish weights -> controller hook."""
        cfg, t_prev = self.cfg, time.time()
        self.duties.before_steps(self.start_step)
        for step in range(self.start_step + 1, cfg.steps + 1):
            with self.timeline.idle("wait_rollouts"), self.waited:
                groups = self.stream.next_batch(self.version)  # settled: what this step trains
            t0, cpu0 = time.time(), time.thread_time()
            train = self.train_step(groups, step)
            t_train, cpu_train = time.time() - t0, time.thread_time() - cpu0
            requested = self._save_requested(step)  # every step: with several ranks, a collective
            save = bool(cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or requested
            if step % cfg.eval_every == 0 or step == cfg.steps or save:
                self._gather_full_model()  # the whole copy's uses: evaluation and checkpoints
            self.version += 1
            step_s, t_prev = time.time() - t_prev, time.time()
            values = self._record_step(step, groups, train, t_train, step_s, cpu_train)
            if cfg.auto:
                self._next_bound(step, values)
            self.publish_weights()
            snapshot = (Snapshot(self.model, self.optimizer, self.version, self.slots.ledger, self.slots.dropped,
                                 self.guard.skipped) if save else None)
            self.duties.after_step(StepDone(step, self.version, groups, values, self.slots.duplicates, snapshot))

    def _save_requested(self, step: int) -> bool:
        """Whether a checkpoint was asked for at the end of ``step``: the file
        ``$LLAMARL_SAVE_REQUEST`` names exists (slurm_llamarl's batch script makes it on the
        SIGUSR1 SLURM sends it ahead of the time limit; a file, not a signal to the ranks,
        which one that came before a rank's start would miss). Every rank decides alike
        (with several, the flag is reduced: one rank may see the file a step before
        another), and the request is consumed."""
        request_file = os.environ.get(SAVE_REQUEST_ENV, "")
        if not request_file:
            return False
        wanted = os.path.exists(request_file)
        if self.ranks is not None:
            wanted = bool(self.ranks.max([float(wanted)])[0])
        if wanted:
            if self.rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(request_file)
                log.warning("a checkpoint was asked for (SLURM: the job's time limit is near): saving one at step %d; "
                            "--resume %s continues from it", step, self.cfg.run_id or "<run id>")
        return wanted

    def _next_bound(self, step: int, values: dict[str, float]) -> None:
        """``--max-staleness auto``, every rank at the same point of the loop: replica 0
        decides the bound for the batches from the new version on (and publishes it to the
        generators before that version's weights go out); the others take its decision in
        a collective (``llamarl.app.control.bound``)."""
        bound = self.duties.next_bound(step, self.version, values)
        if self.ranks is not None:
            bound = int(self.ranks.max([bound])[0])  # the followers offer -1
        self.stream.set_bound(bound)

    def train_step(self, groups: list[RolloutGroup], step: int) -> dict[str, float] | None:
        """One optimizer step on ``groups`` (None: skipped). Every rank decides alone: with
        several ranks, one rank's share may have no usable rollout while another's has;
        it still takes part in the sharded step."""
        if self.guard.should_skip(groups, step) and self.world == 1:
            return None
        with self.timeline.busy("train"), devices.autocast(self.device, self.dtype):
            return rl.train_step(self.model, self.optimizer, steps.usable(groups), self.cfg.step_config(self.gen),
                                 pad_id=self.tokenizer.pad_token_id, ref_model=self.ref_model, ranks=self.ranks,
                                 policy_version=self.version) or None  # {}: no rank had a rollout

    def _record_step(self, step: int, groups: list[RolloutGroup], train: dict[str, float] | None,
                     t_train: float, step_s: float, cpu_train: float) -> dict[str, float]:
        """Emits the step's events (with the timeline's intervals so far) and returns its
        scalars; the groups it trained were consumed at the version before this step's."""
        values = steps.step_values(groups=groups, train=train, t_train=t_train, step_s=step_s,
                                   consumed_version=self.version - 1, skipped=self.guard.skipped,
                                   dropped=self.slots.dropped, idle_fraction=self.timeline.idle_fraction(),
                                   eos_id=self.tokenizer.eos_token_id)
        values[names.STALENESS_BOUND] = self.stream.filter.max_staleness
        if train is not None:
            values[names.TRAIN_CPU_S] = cpu_train
        values.update(devices.device_metrics(self.device))
        values.update({names.queue_metric(q): self.rt.queue(q).depth() for q in (names.ROLLOUTS, names.SCORED)})
        values.update(self.rejections.metrics())
        values.update(self.rt.security_metrics())
        events, values = steps.step_events(step, groups, values, consumed_version=self.version - 1,
                                           reward_names=self.reward_names, role="trainer", replica=self.rank)
        self.rt.emit(events + self.timeline.drain())
        return values

    def close(self, reason: str, *, failed: bool = False) -> None:
        """Every rank: stop the rollout stream's thread and the reward workers; then
        replica 0 ends the app (``Controller.close``)."""
        if self.stream is not None:
            try:
                self.stream.close()
            except TimeoutError as e:
                log.error("%s", e)
        if self.reward is not None:
            self.reward.close()  # its worker processes
        self.duties.close(reason, failed=failed)


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


SAVE_REQUEST_ENV = "LLAMARL_SAVE_REQUEST"
"""Names a file whose existence asks for a checkpoint at the end of the current step."""


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
