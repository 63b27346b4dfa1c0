"""Reward executor: scores rollout groups remotely, in batches.

    python -m app.reward --store-addr HOST:PORT --replica I

Pops group messages from the ``rollouts`` queue, scores all of their completions in
one batched call of the configured reward components (the trainer's ``--rewards``),
attaches the results and pushes the groups to the ``scored`` queue that the trainer's
pipeline reads. Model-based rewards load once, at start.
"""

from __future__ import annotations

import sys
import time

import torch

from app import metrics, runtime
from app.generator import read_config
from app.rewards import Sample, build_reward, exit_without_teardown_if_calls_hang

MAX_GROUPS_PER_BATCH = 16


def run(rt: runtime.Runtime, *, config_timeout_s: float) -> None:
    cfg, _, _ = read_config(rt.store, rt, config_timeout_s)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    reward = build_reward(cfg.rewards, timeout_s=cfg.reward_timeout_s)
    reward.load()
    inbox, outbox = rt.queue(runtime.ROLLOUTS), rt.queue(runtime.SCORED)
    timeline = metrics.Timeline("reward", rt.replica)
    try:
        while True:
            with timeline.idle("wait_rollouts"):
                msgs = inbox.pop_many(MAX_GROUPS_PER_BATCH, timeout_s=1.0, should_stop=rt.should_stop)
            if not msgs:
                continue
            t0 = time.time()
            with timeline.busy("score"):
                samples = [Sample(prompt=m["meta"].get("prompt", ""), completion=text, meta=m["meta"])
                           for m in msgs for text in m["texts"]]
                results = reward.score(samples)
            dt = time.time() - t0
            with timeline.idle("queue_full"):
                i = 0
                for m in msgs:
                    n = len(m["texts"])
                    m["results"] = [r.to_dict() for r in results[i:i + n]]
                    i += n
                    outbox.push(m, timeout_s=600.0, should_stop=rt.should_stop)
            rt.emit(metrics.scalars({"reward/samples_per_s": len(samples) / max(dt, 1e-9),
                                     "idle_fraction": timeline.idle_fraction()},
                                    role="reward", replica=rt.replica) + timeline.drain(), flush=True)
    finally:
        reward.close()


def main(argv: list[str] | None = None) -> None:
    args = runtime.role_arguments("reward executor", __doc__.splitlines()[0]).parse_args(argv)
    with runtime.join_role("reward", args) as rt:
        run(rt, config_timeout_s=args.config_timeout_s)
    exit_without_teardown_if_calls_hang()


if __name__ == "__main__":
    main(sys.argv[1:])
