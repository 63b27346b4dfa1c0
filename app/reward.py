"""Reward executor: scores rollout groups remotely, in batches.

    python -m app.reward --store-addr HOST:PORT --replica I

Pops group messages from the ``rollouts`` queue, scores all of their completions in
one batched call of the configured reward components (the trainer's ``--rewards``),
attaches the results and pushes the groups to the ``scored`` queue that the trainer's
pipeline reads. Model-based rewards load once, at start.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from app import metrics, runtime, transport
from app.generator import read_config
from app.rewards import Sample, build_reward

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-addr", required=True, help="host:port of the control store (trainer replica 0)")
    parser.add_argument("--replica", type=int, required=True, help="this reward executor's index, 0-based")
    parser.add_argument("--connect-timeout-s", type=float, default=300.0, help="wait for the control store")
    parser.add_argument("--config-timeout-s", type=float, default=900.0,
                        help="wait for the trainer's config (it may be warm-starting the policy)")
    args = parser.parse_args(argv)
    runtime.setup_logging("reward", args.replica)
    store = transport.connect_store(args.store_addr, args.connect_timeout_s)
    with runtime.Runtime.join("reward", args.replica, store) as rt:
        run(rt, config_timeout_s=args.config_timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
