"""Generator executor: samples groups of completions with the newest weights it has.

    python -m llamarl.app.roles.generator --store-addr HOST:PORT --app-id APP --replica I [--device auto|cpu|cuda]

Everything else (policy, sampling, group size, staleness bound) comes from the trainer
through the control store, so all roles agree by construction. Weights arrive on the
weight plane in a background thread and are swapped in between decode batches (with
``--env``, between rounds of turns: episodes stream, ``_play_forever``).

Staleness bound: before sampling, a generator reserves group slots from a global
counter (``llamarl.app.control.slots.SlotBudget``: a signed record, replaced by
compare-and-set), which a resumed run restarts at the number of slots its checkpoint
consumed (the slots it lacks are filled first). Slot n (1-based) trains at step
ceil(n / B) (B groups per step), so weights of
version v may fill slots up to (v + 1 + max_staleness) * B (plus the groups the trainer
dropped). Past that the generator waits for newer weights: it never runs more than
``max_staleness`` versions ahead, and ``max_staleness = 0`` is the synchronous baseline.
With ``--max-staleness auto`` the bound is the controller's signed record, read at every
reservation (``SlotBudget``).
"""

from __future__ import annotations

if __name__ == "__main__":
    # First, before torch is imported (seconds): from here on the trainer sees this
    # generator die even before it reaches the store (llamarl.app.control.replica_lock).
    from llamarl.app.control import replica_lock

    replica_lock.hold()

import functools
import logging
import math
import sys
import time

import torch

from llamarl.app.data import sources as data
from llamarl.app import devices
from llamarl.app.control import health
from llamarl.app.control import incarnations
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.control import runtime
from llamarl.app.control import slots
from llamarl.app.control import transport
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.control.outbox import Outbox
from llamarl.app.envs.slots import SlotEpisodes
from llamarl.app.model.policy import load_policy
from llamarl.app.control.seen_groups import first_seq
from llamarl.app.weights.subscriber import Subscriber

log = logging.getLogger("llamarl")


def run(rt: runtime.Runtime, *, config_timeout_s: float, device: devices.DeviceChoice = "auto") -> None:
    where = devices.choose_device(device)
    trainer_cfg, gen_cfg, policy_path = runtime.read_config(rt, config_timeout_s)
    if gen_cfg.gen_threads:
        torch.set_num_threads(gen_cfg.gen_threads)
    model, tokenizer = load_policy(policy_path, device=where)
    log.info("generator %d on %s", rt.replica, devices.describe(where))
    model.eval()
    # The same prompts as the trainer, in the same order, or a clear failure now.
    prompts = data.load(trainer_cfg, tokenizer, log=log.info)
    data.check_published(rt, prompts, config_timeout_s)
    # On a GPU a busy interval ends when the GPU is done: idle time is GPU idle time.
    timeline = metrics.Timeline("generator", rt.replica, busy_ends=functools.partial(devices.synchronize, where))
    # Joins the weight plane (llamarl.app.weights.subscriber); --gen-precision is refused here,
    # naming what this device runs, when it cannot.
    subscriber = Subscriber(rt, model, precision=gen_cfg.gen_precision, timeout_s=trainer_cfg.weight_sync_timeout_s,
                            digest=trainer_cfg.weight_digest, timeline=timeline)
    subscriber.start()
    try:
        _generate_forever(rt, model, tokenizer, subscriber, prompts, trainer_cfg, gen_cfg, timeline)
    finally:
        subscriber.close(timeout_s=30.0)


def _generate_forever(rt: runtime.Runtime, model, tokenizer, subscriber: Subscriber,
                      prompts: data.RunData, trainer_cfg: TrainerConfig, gen_cfg: GeneratorConfig,
                      timeline: metrics.Timeline) -> None:
    device = next(model.parameters()).device
    ledger = slots.SlotLedger.from_state(rt.wait_key(names.SLOTS_DONE_KEY, 60.0, "slot ledger"))
    budget = slots.SlotBudget(rt.signed, groups_per_step=trainer_cfg.prompts_per_step,
                              max_staleness=trainer_cfg.start_bound, ledger=ledger, auto=trainer_cfg.auto)
    out_queue = rt.queue(names.ROLLOUTS)
    sampling = gen_cfg.sampling()
    rng = devices.seeded_generator(device, gen_cfg.gen_seed)  # reseeded per batch: batch_seed
    held = slots.HeldSlots(rt.signed)
    outbox = Outbox(out_queue, held, timeline, should_stop=rt.should_stop)
    version: int | None = None
    # The sequence half of this generator's group ids: a process of its own, registered
    # under this attempt, so no id is ever used twice and readers take only this
    # attempt's (they refuse a second copy, and a frame from before a resume).
    sent = first_seq(incarnations.register(rt.signed, rt.replica, runtime.run_attempt(rt)))
    if gen_cfg.env:
        episodes = SlotEpisodes(model, tokenizer, trainer_cfg, gen_cfg)
        try:
            return _play_forever(rt, model, subscriber, episodes, gen_cfg, budget=budget, held=held, outbox=outbox,
                                 rng=rng, sent=sent, timeline=timeline)
        finally:
            episodes.close()
    while True:
        with timeline.idle("wait_weights"):
            while version is None and not subscriber.waiting():
                if rt.should_stop():
                    raise transport.Stopped("stop requested")
                time.sleep(0.005)
        new = subscriber.swap_into(model)
        version = new if new is not None else version
        if version is None:
            continue  # a receive began writing staging since waiting(): wait for it
        # Slots lost with a dead executor first (outside the counter: it counted them
        # already), then new ones within the staleness bound.
        slot_ids = slots.take_lost_slots(rt.signed, gen_cfg.gen_batch_prompts)
        if not slot_ids:
            reserved = budget.reserve(gen_cfg.gen_batch_prompts, version)
            if not reserved:
                with timeline.idle("staleness_bound"):
                    _wait_for_weights_or_lost_slots(rt, subscriber, version)
                continue
            slot_ids = budget.slot_ids(reserved)
        held.take(slot_ids)
        rng.manual_seed(batch_seed(gen_cfg.gen_seed, slot_ids[0]))
        t0, cpu0 = time.time(), time.thread_time()
        # Each group goes out as the sampler's batch is cut into it (llamarl.app.control.outbox).
        outbox.open(slot_ids, first_seq=sent)
        rl.generate_groups(model, tokenizer, [prompts.order.problem(i) for i in slot_ids],
                           group_size=trainer_cfg.group_size, params=sampling, version=version, rng=rng,
                           generator_id=rt.replica, first_seq=sent, format_prompt=prompts.format_prompt,
                           decoder=gen_cfg.gen_decoder, send=outbox.send)
        outbox.close()
        sent += outbox.sent
        _report(rt, subscriber, outbox, timeline, version, device, busy_s=time.time() - t0 - outbox.push_s,
                cpu_s=time.thread_time() - cpu0)


def _report(rt: runtime.Runtime, subscriber: Subscriber, outbox: Outbox, timeline: metrics.Timeline, version: int,
            device: torch.device, *, busy_s: float, cpu_s: float, extra: dict[str, float] | None = None) -> None:
    """The generator's scalars for what ``outbox`` sent in ``busy_s`` seconds of generating."""
    busy_s = max(busy_s, 1e-9)
    events = metrics.scalars({names.GEN_TOKENS_PER_S: outbox.tokens / busy_s,
                              names.GEN_SEQS_PER_S: outbox.rollouts / busy_s,
                              names.GEN_CPU_S: cpu_s, names.GEN_VERSION: version,
                              names.IDLE_FRACTION: timeline.idle_fraction(),
                              **devices.device_metrics(device), **subscriber.digest_metrics(),
                              **rt.security_metrics(), **(extra or {})},
                             role="generator", replica=rt.replica)
    rt.emit(events + subscriber.events() + timeline.drain(), flush=True)


def _play_forever(rt: runtime.Runtime, model, subscriber: Subscriber, episodes: SlotEpisodes,
                  gen_cfg: GeneratorConfig, *, budget: slots.SlotBudget, held: slots.HeldSlots, outbox: Outbox,
                  rng: torch.Generator, sent: int, timeline: metrics.Timeline) -> None:
    """The generator's loop with ``--env``: episodes streamed. Up to ``gen_batch_prompts``
    x ``group_size`` episodes are being played; each round (one turn of every episode
    waiting for the policy, ``llamarl.app.envs.episodes.InFlight``) swaps in new weights
    first, admits a new slot's group whenever that many places are free, as far as the
    staleness bound allows, and sends each group the moment its episodes have all ended.
    A place is an episode still playing: a group's ended episodes, waiting for its slowest,
    hold none, so while some episodes wait on a slow tool, others, of the next step's
    slots when the bound allows, are sampled: the generator does not idle until the
    batch's slowest episode ends, and its decode batch stays full. An episode's turns
    may be sampled with different versions (each recorded; staleness counts the oldest).
    Synchronous (``max_staleness 0``) this is the batch loop: the next step's slots wait
    for its weights. Scalars are reported every ``gen_batch_prompts`` groups sent."""
    flight = episodes.in_flight(rng=rng, stop=rt.should_stop)
    device = next(model.parameters()).device
    version: int | None = None
    retry_at = 0.0  # the bound refused: ask again at new weights or after LOST_SLOTS_POLL_S
    outbox.open([], first_seq=sent)
    t0, cpu0, idle_s = time.time(), time.thread_time(), 0.0
    while True:
        if rt.should_stop():
            raise transport.Stopped("stop requested")
        new = subscriber.swap_into(model)
        if new is not None:
            version, retry_at = new, 0.0
        if version is None:
            outbox.close()
            with timeline.idle("wait_weights"):
                t = time.time()
                while not subscriber.waiting():
                    if rt.should_stop():
                        raise transport.Stopped("stop requested")
                    time.sleep(0.005)
                idle_s += time.time() - t
            outbox.resume()
            continue
        room = gen_cfg.gen_batch_prompts - math.ceil(flight.playing() / episodes.group_size)
        if room > 0 and time.monotonic() >= retry_at:
            slot_ids = slots.take_lost_slots(rt.signed, room) or budget.slot_ids(budget.reserve(room, version))
            if slot_ids:
                held.take(slot_ids)
                rng.manual_seed(batch_seed(gen_cfg.gen_seed, slot_ids[0]))
                outbox.add(slot_ids, first_seq=sent)
                for k, slot in enumerate(slot_ids):
                    episodes.admit(flight, slot, key=sent + k)
                sent += len(slot_ids)
            else:
                retry_at = time.monotonic() + LOST_SLOTS_POLL_S
        if not len(flight):
            outbox.close()
            with timeline.idle("staleness_bound"):
                t = time.time()
                _wait_for_weights_or_lost_slots(rt, subscriber, version)
                idle_s += time.time() - t
            retry_at = 0.0
            outbox.resume()
            continue
        # At the bound with room left, wait for a step at most until the next ask.
        for seq, played in flight.advance(version, max_wait_s=LOST_SLOTS_POLL_S).items():
            outbox.send(episodes.group(played, generator_id=rt.replica, seq=seq))
        if outbox.sent >= gen_cfg.gen_batch_prompts:
            outbox.close()
            _report(rt, subscriber, outbox, timeline, version, device,
                    busy_s=time.time() - t0 - outbox.push_s - idle_s,
                    cpu_s=time.thread_time() - cpu0, extra=episodes.metrics())
            outbox.reset_counts()
            outbox.resume()
            t0, cpu0, idle_s = time.time(), time.thread_time(), 0.0


def batch_seed(gen_seed: int, first_slot: int) -> int:
    """The sampling seed of the batch that starts at slot ``first_slot``: a function of the
    slot, not of the generator or of how long it has run, so a run resumed from a
    checkpoint (fresh generators) and a slot regenerated by another generator draw as the
    uninterrupted run would have with the same weights."""
    return (gen_seed * 0x9E3779B97F4A7C15 + first_slot) % (1 << 63)


LOST_SLOTS_POLL_S = 0.1
"""How often a generator at its staleness bound asks the store for lost slots (a store
call; new weights are a local check, made every 5 ms)."""


def _wait_for_weights_or_lost_slots(rt: runtime.Runtime, subscriber: Subscriber, version: int) -> None:
    """Until newer weights or lost slots arrive. A version refused meanwhile (its digest)
    is reported at once: this generator may not generate again before the run ends."""
    next_poll = time.monotonic()
    while subscriber.latest_version() == version:
        if rt.should_stop():
            raise transport.Stopped("stop requested")
        if time.monotonic() >= next_poll:
            if slots.lost_slots_waiting(rt.store):
                return
            if refused := subscriber.new_refusals():
                rt.emit(metrics.scalars(refused, role="generator", replica=rt.replica), flush=True)
            next_poll = time.monotonic() + LOST_SLOTS_POLL_S
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> None:
    parser = runtime.role_arguments("generator", __doc__.splitlines()[0], "python -m llamarl.app.roles.generator")
    parser.add_argument("--num-generators", type=int, required=True, help="generators in the app (the weight plane takes its roster from the trainer)")
    args = parser.parse_args(argv)
    health.enable_crash_reports(names.member("generator", args.replica))
    with health.reported(), runtime.join_role("generator", args) as rt:
        run(rt, config_timeout_s=args.config_timeout_s, device=args.device)


if __name__ == "__main__":
    main(sys.argv[1:])
