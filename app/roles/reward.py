"""Reward executor: scores rollout groups remotely, in batches.

    python -m llamarl.app.roles.reward --store-addr HOST:PORT --app-id APP --replica I [--device auto|cpu|cuda]

Pops group messages from the ``rollouts`` queue, scores all of their completions in
one batched call of the configured reward components (the trainer's ``--rewards``),
attaches the results and pushes the groups to the ``scored`` queue that the trainer's
pipeline reads. Model-based rewards load once, at start, on this executor's device
unless the reward spec names one (``device=``).
"""

from __future__ import annotations

if __name__ == "__main__":
    # First, before torch is imported (seconds): from here on the trainer sees this
    # reward executor die even before it reaches the store (llamarl.app.control.replica_lock).
    from llamarl.app.control import replica_lock

    replica_lock.hold()

import sys
import time

import torch

from llamarl.app import devices
from llamarl.app.control import health
from llamarl.app.control import incarnations
from llamarl.app.control import slots
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl import step as rl
from llamarl.app.control import runtime
from llamarl.app.rl.contract import Rejections, to_message
from llamarl.app.rewards import build_reward

MAX_GROUPS_PER_BATCH = 16


def run(rt: runtime.Runtime, *, config_timeout_s: float, device: devices.DeviceChoice = "auto") -> None:
    where = devices.choose_device(device)
    cfg, _, _ = runtime.read_config(rt, config_timeout_s)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s, device=str(where))
    reward.load()
    inbox, outbox = rt.queue(names.ROLLOUTS), rt.queue(names.SCORED)
    rejections = Rejections(f"reward/{rt.replica}")
    # Replays are refused here already (scoring them would be wasted), and versions the
    # trainer has not published; the trainer checks both again.
    admit = incarnations.admission(rt.signed, runtime.run_attempt(rt), published_version=rt.control.version)
    timeline = metrics.Timeline("reward", rt.replica)
    reported: dict[str, float] = {}
    held = slots.HeldSlots(rt.signed)
    try:
        while True:
            with timeline.idle("wait_rollouts"):
                msgs = inbox.pop_many(MAX_GROUPS_PER_BATCH, timeout_s=1.0, should_stop=rt.should_stop,
                                      on_reject=rejections)
            # The trainer checks token ids against its vocabulary again; here what matters
            # is what scoring reads.
            groups = rejections.decode(msgs, admit, group_size=cfg.group_size)
            held.take([g.slot for g in groups])  # lost with this executor: regenerated
            if not groups:
                # Only bad messages: their counts still reach the metrics, once per change.
                if (counts := {**rejections.metrics(), **rt.security_metrics()}) != reported:
                    reported = counts
                    rt.emit(metrics.scalars(counts, role="reward", replica=rt.replica), flush=True)
                continue
            t0 = time.time()
            with timeline.busy("score"):
                results = rl.score_groups(groups, reward)
            dt = time.time() - t0
            with timeline.idle("queue_full"):
                for group in groups:
                    outbox.push(to_message(group), timeout_s=600.0, should_stop=rt.should_stop)
                    held.passed(group.slot)
            values = {names.REWARD_SAMPLES_PER_S: len(results) / max(dt, 1e-9),
                      names.IDLE_FRACTION: timeline.idle_fraction(),
                      **(reported := {**rejections.metrics(), **rt.security_metrics()})}
            rt.emit(metrics.scalars(values, role="reward", replica=rt.replica) + timeline.drain(),
                    flush=True)
    finally:
        reward.close()


def main(argv: list[str] | None = None) -> None:
    args = runtime.role_arguments("reward executor", __doc__.splitlines()[0], "python -m llamarl.app.roles.reward").parse_args(argv)
    health.enable_crash_reports(names.member("reward", args.replica))
    with health.reported(), runtime.join_role("reward", args) as rt:
        run(rt, config_timeout_s=args.config_timeout_s, device=args.device)


if __name__ == "__main__":
    main(sys.argv[1:])
