"""Generator executor: samples groups of completions with the newest weights it has.

    python -m app.generator --store-addr HOST:PORT --replica I

Everything else (policy, sampling, group size, staleness bound) comes from the trainer
through the control store, so all roles agree by construction. Weights arrive on the
weight plane in a background thread and are swapped in between decode batches.

Staleness bound: before sampling, a generator reserves group slots from a global
counter. Slot n (1-based) trains at step ceil(n / B) (B groups per step), so weights of
version v may fill slots up to (v + 1 + max_staleness) * B (plus the groups the trainer
dropped). Past that the generator waits for newer weights: it never runs more than
``max_staleness`` versions ahead, and ``max_staleness = 0`` is the synchronous baseline.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from typing import Any

import torch

from app import metrics, rl, runtime, transport
from app.config import GeneratorConfig, TrainerConfig
from app.local import train_problems
from app.policy import load_policy
from app.weight_sync import WeightReceiver, WeightSyncError, flatten_parameters_, init_weight_group

log = logging.getLogger("llamarl")

CONFIG_KEY = "llamarl/config"
WEIGHT_TIMEOUT_S = 120.0  # one weight sync may not take longer (the group's collective timeout)


def publish_config(store, trainer: TrainerConfig, gen: GeneratorConfig, policy_path: str,
                   run_dir: str) -> None:
    from app.cli import to_dict
    store.set(CONFIG_KEY, json.dumps({"trainer": to_dict(trainer), "generator": to_dict(gen),
                                      "run_dir": run_dir}))
    store.set(runtime.POLICY_KEY, policy_path)


def wait_key(store, key: str, timeout_s: float, rt: runtime.Runtime, what: str) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if rt.should_stop():
            raise transport.Stopped(f"stopped while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rt.role}/{rt.replica}: no {what} from the trainer after {timeout_s:g} s")
        time.sleep(0.05)
    return store.get(key)


def read_config(store, rt: runtime.Runtime, timeout_s: float) -> tuple[TrainerConfig, GeneratorConfig, str]:
    """The trainer's configs and policy path; from then on this role also logs to
    ``<run_dir>/logs/<role>-<replica>.log`` (when the run directory is reachable here)."""
    raw = json.loads(wait_key(store, CONFIG_KEY, timeout_s, rt, "run config"))
    policy = wait_key(store, runtime.POLICY_KEY, timeout_s, rt, "policy path").decode()
    runtime.log_to_run_dir(raw["run_dir"], rt.role, rt.replica)
    return TrainerConfig(**raw["trainer"]), GeneratorConfig(**raw["generator"]), policy


def group_message(rollouts: list[rl.Rollout], replica: int) -> dict[str, Any]:
    first = rollouts[0]
    meta = {k: v for k, v in first.meta.items() if k != "completion"}
    return {"group": first.group, "version": first.version, "generator": replica,
            "prompt_ids": first.prompt_ids, "meta": meta, "t": time.time(),
            "completions": [r.completion_ids for r in rollouts],
            "logprobs": [r.behaviour_logprobs for r in rollouts],
            "texts": [r.meta["completion"] for r in rollouts]}


class SlotBudget:
    """Reserves group slots so no rollout can be more than ``max_staleness`` stale."""

    def __init__(self, store, *, groups_per_step: int, max_staleness: int) -> None:
        self.store, self.B, self.K = store, groups_per_step, max_staleness

    def reserve(self, want: int, version: int) -> range:
        """Slots (0-based) this generator may fill with weights of ``version``; empty when
        it must wait for newer weights. Atomic across generators (compare-and-set)."""
        while True:
            cap = (version + 1 + self.K) * self.B + int(self.store.add(runtime.DROPPED_KEY, 0))
            seen = self.store.get(runtime.RESERVED_KEY).decode()  # "count" or "count token"
            start = int(seen.split()[0])
            take = min(want, cap - start)
            if take <= 0:
                return range(0)
            # A token unique to this attempt: a failed compare-and-set returns the current
            # value, and a bare count could equal ours when a rival took as many slots.
            mine = f"{start + take} {secrets.token_hex(8)}"
            if self.store.compare_set(runtime.RESERVED_KEY, seen, mine).decode() == mine:
                return range(start, start + take)


def run(rt: runtime.Runtime, *, num_generators: int, config_timeout_s: float) -> None:
    store = rt.store
    trainer_cfg, gen_cfg, policy_path = read_config(store, rt, config_timeout_s)
    if gen_cfg.gen_threads:
        torch.set_num_threads(gen_cfg.gen_threads)
    model, tokenizer = load_policy(policy_path)
    model.eval()
    flatten_parameters_(model)  # apply() is then one copy per bucket
    group = init_weight_group(store, rank=rt.replica + 1, world_size=num_generators + 1,
                              device=torch.device("cpu"), timeout_s=WEIGHT_TIMEOUT_S)
    receiver = WeightReceiver(group, list(model.named_parameters()))
    receiver.start_background(should_stop=rt.should_stop)
    try:
        _generate_forever(rt, model, tokenizer, receiver, trainer_cfg, gen_cfg)
    finally:
        # The receiver thread must leave gloo before the interpreter exits, or the process
        # aborts; it can only be stuck in a sync when the run is failing anyway.
        try:
            receiver.stop_background(timeout_s=30.0)
        except WeightSyncError as e:
            log.warning("%s", e)


def _generate_forever(rt: runtime.Runtime, model, tokenizer, receiver: WeightReceiver,
                      trainer_cfg: TrainerConfig, gen_cfg: GeneratorConfig) -> None:
    store = rt.store
    timeline = metrics.Timeline("generator", rt.replica)
    problems = train_problems(trainer_cfg)  # the local loop's problems, in the same order
    budget = SlotBudget(store, groups_per_step=trainer_cfg.prompts_per_step,
                        max_staleness=trainer_cfg.max_staleness)
    out_queue = rt.queue(runtime.ROLLOUTS)
    sampling = gen_cfg.sampling()
    rng = torch.Generator().manual_seed(gen_cfg.gen_seed + 1000 * rt.replica)
    version: int | None = None
    while True:
        with timeline.idle("wait_weights"):
            while (new := receiver.swap_if_newer()) is None and version is None:
                if rt.should_stop():
                    raise transport.Stopped("stop requested")
                time.sleep(0.005)
        version = new if new is not None else version
        slots = budget.reserve(gen_cfg.gen_batch_prompts, version)
        if not slots:
            with timeline.idle("staleness_bound"):
                while receiver.latest_version() == version:
                    if rt.should_stop():
                        raise transport.Stopped("stop requested")
                    time.sleep(0.005)
            continue
        batch = [problems[i % len(problems)] for i in slots]
        t0 = time.time()
        with timeline.busy("generate"):
            rollouts = rl.generate_rollouts(model, tokenizer, batch, group_size=trainer_cfg.group_size,
                                            params=sampling, version=version, generator=rng,
                                            group_prefix="slot")
        # group ids carry the global slot, so messages from all generators stay distinct
        for r in rollouts:
            r.group = f"slot{slots[int(r.group.removeprefix('slot'))]}"
        dt = time.time() - t0
        with timeline.idle("queue_full"):
            for g in range(len(batch)):
                out_queue.push(group_message(rollouts[g * trainer_cfg.group_size:(g + 1) * trainer_cfg.group_size],
                                             rt.replica), timeout_s=600.0, should_stop=rt.should_stop)
        tokens = sum(len(r.completion_ids) for r in rollouts)
        events = metrics.scalars({"gen/tokens_per_s": tokens / dt, "gen/seqs_per_s": len(rollouts) / dt,
                                  "gen/version": version, "idle_fraction": timeline.idle_fraction()},
                                 role="generator", replica=rt.replica)
        events += [metrics.weight_sync(s.version, f"generator/{rt.replica}", s.bytes, s.seconds)
                   for s in receiver.pop_stats()]
        rt.emit(events + timeline.drain(), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = runtime.role_arguments("generator", __doc__.splitlines()[0])
    parser.add_argument("--num-generators", type=int, required=True, help="generators in the app")
    args = parser.parse_args(argv)
    with runtime.join_role("generator", args) as rt:
        run(rt, num_generators=args.num_generators, config_timeout_s=args.config_timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
