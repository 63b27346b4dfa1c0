"""What the bad-frame and weight-digest defences cost, side by side with the path they guard.

Messages, per rollout group (in this process): a group of ``--group-size`` completions of
``--tokens`` tokens, as a generator sends it. The path before this change: ``encode``
(which signs: HMAC-SHA256), ``decode`` (which checks the tag first) and the contract check
(``from_message``). Added now: ``Admission`` per group (the seen-id set and the version
check). The HMAC alone over the same frame is timed too, to show what signing costs.

Weights, per sync (a trainer and one generator process, gloo on loopback, ~``--params``
fp32 parameters shaped like a small Llama): a plain sync (``WeightSender.send`` until the
generator's background receiver has the version staged) against a sync with the digest
(the trainer hashes its flat buffers and publishes the signed record, then sends; the
generator hashes what it received and checks it before staging), round-robin, median of
``--repeats`` rounds after a warm-up. The trainer's hashing and the generator's check are
also timed on their own.

    python benchmarks/security.py --json benchmarks/results/security.json [--params 100e6]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

from app import weight_digest
from app.contract import GroupId, Rejections, Rollout, RolloutGroup, from_message, to_message
from app.frames import decode, encode
from app.seen_groups import Admission
from app.signed import SignedStore
from app.transport import connect_store, host_store
from app.weight_layout import DEFAULT_BUCKET_MB, Layout
from app.weight_sync import WeightReceiver, WeightSender, flatten_parameters_, init_weight_group
from weight_sync import _Steps, llama_like_params

SECRET = bytes(range(32))


# --------------------------------------------------------------------------- messages


def _group(seq: int, group_size: int, tokens: int) -> RolloutGroup:
    g = torch.Generator().manual_seed(seq)
    gid = GroupId(0, seq)
    prompt = torch.randint(0, 32000, (128,), generator=g).tolist()
    return RolloutGroup(group_id=gid, version=3, slot=seq, rollouts=[
        Rollout(prompt_ids=prompt, completion_ids=torch.randint(0, 32000, (tokens,), generator=g).tolist(),
                behaviour_logprobs=(-torch.rand(tokens, generator=g)).tolist(), version=3, group_id=gid,
                prompt="p" * 400, completion="c" * 4 * tokens, task={"answer": 42.0})
        for _ in range(group_size)])


def _per_call_us(fn, items: list, repeats: int) -> float:
    """Median over ``repeats`` passes of the mean microseconds per item."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - t0) / len(items) * 1e6)
    return statistics.median(times)


def bench_messages(args: argparse.Namespace) -> dict:
    n = args.messages
    msgs = [to_message(_group(s, args.group_size, args.tokens)) for s in range(n)]
    frames = [encode(m, SECRET) for m in msgs]
    decoded = [decode(f, SECRET) for f in frames]
    passes = []  # each admission pass sees new ids: what a run does
    for p in range(args.repeats):
        groups = [from_message(m) for m in decoded]
        for g in groups:
            g.group_id = GroupId(0, p * n + g.group_id.seq)
        passes.append(groups)
    admit = Admission(current_version=lambda: 3)
    rejections = Rejections("bench")

    def admit_pass() -> float:
        groups = passes.pop()
        t0 = time.perf_counter()
        for g in groups:
            assert admit(g) is None
            rejections.accepted()
        return (time.perf_counter() - t0) / len(groups) * 1e6

    us = {
        "encode_signed": _per_call_us(lambda m: encode(m, SECRET), msgs, args.repeats),
        "hmac_only": _per_call_us(lambda f: hmac.new(SECRET, f, hashlib.sha256).digest(), frames, args.repeats),
        "decode_checked": _per_call_us(lambda f: decode(f, SECRET), frames, args.repeats),
        "contract_check": _per_call_us(lambda m: from_message(m), decoded, args.repeats),
        "admission_dedupe": statistics.median(admit_pass() for _ in range(args.repeats)),
    }
    before = us["encode_signed"] + us["decode_checked"] + us["contract_check"]
    return {"microseconds_per_group": us, "frame_bytes": len(frames[0]), "group_size": args.group_size,
            "tokens": args.tokens, "before_us": before, "after_us": before + us["admission_dedupe"],
            "dedupe_overhead": us["admission_dedupe"] / before,
            "seen_ids_after_run": admit.seen.remembered()}


# --------------------------------------------------------------------------- weights


_wait = _Steps.wait_until  # weight_sync.py's poll with a deadline


def weight_role(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store(f"127.0.0.1:{port}", timeout_s=60)
    signed = SignedStore(store, SECRET, f"member/{rank}")  # the weight plane signs its keys
    group = init_weight_group(signed, rank, 2, torch.device("cpu"), timeout_s=600)
    torch.manual_seed(rank)
    params = llama_like_params(args.params)
    flatten_parameters_([p for _, p in params])
    rounds = args.repeats + 1  # the first is a warm-up
    times: dict[str, list[float]] = {}
    if rank == 0:
        sender = WeightSender(group, params)
        layout = Layout(params, int(DEFAULT_BUCKET_MB * 2**20))
        version = 0
        for r in range(rounds):
            for method in ("plain", "digest"):  # round-robin: host load lands on both alike
                version += 1  # odd: plain, even: with the digest (the generator checks those)
                t0 = time.perf_counter()
                if method == "digest":
                    t1 = time.perf_counter()
                    hexdigest = weight_digest.digest(weight_digest.sent_runs(params, layout))
                    weight_digest.publish(store, SECRET, version, hexdigest)
                    if r:
                        times.setdefault("trainer_digest", []).append(time.perf_counter() - t1)
                sender.send(version)
                _wait(lambda: store.check([f"bench/staged/{version}"]), f"version {version} staged")
                if r:
                    times.setdefault(method, []).append(time.perf_counter() - t0)
        out.put((rank, {"times": times, "params": sum(p.numel() for _, p in params),
                        "bytes": layout.nbytes}))
        return
    check = weight_digest.DigestCheck(store, SECRET, 0)

    def verify(version: int, staging: list[torch.Tensor]) -> bool:
        if version % 2:
            return True
        t0 = time.perf_counter()
        ok = check(version, staging)
        if version > 2:
            times.setdefault("generator_check", []).append(time.perf_counter() - t0)
        return ok

    receiver = WeightReceiver(group, params, verify=verify)
    receiver.start_background()
    for version in range(1, 2 * rounds + 1):
        _wait(lambda: receiver.latest_version() == version, f"version {version}")
        store.set(f"bench/staged/{version}", "1")
    receiver.stop_background()
    out.put((rank, {"times": times, "refused": dict(check.counts)}))


def bench_weights(args: argparse.Namespace) -> dict:
    store = host_store(0, None, timeout_s=600, bind="127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=weight_role, args=(r, store.port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    trainer, generator = reports[0], reports[1]
    if generator["refused"]:
        raise RuntimeError(f"benchmark: the generator refused versions: {generator['refused']}")
    t = {**trainer["times"], **generator["times"]}
    med = {k: statistics.median(v) for k, v in t.items()}
    paired = statistics.median(d / p for d, p in zip(t["digest"], t["plain"]))
    return {"seconds": med, "all_seconds": t, "params": trainer["params"], "bytes": trainer["bytes"],
            "paired_ratio_digest_vs_plain": paired, "trainer_digest_share_of_sync": med["trainer_digest"] / med["plain"],
            "digest_threads": min(8, os.cpu_count() or 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--params", type=float, default=100e6, help="model size in parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--messages", type=int, default=200, help="groups per timed pass")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="completion tokens per rollout")
    args = ap.parse_args()

    msgs = bench_messages(args)
    weights = bench_weights(args)
    result = {"messages": msgs, "weights": weights, "torch": torch.__version__, "cpus": os.cpu_count()}

    us = msgs["microseconds_per_group"]
    print(f"\nmessages: one group of {args.group_size} x {args.tokens} tokens, "
          f"{msgs['frame_bytes'] / 1024:.0f} KiB frame, median of {args.repeats} passes of {args.messages}")
    for name, value in us.items():
        print(f"  {name:<18}{value:>10.1f} us")
    print(f"  before {msgs['before_us']:.1f} us/group, after {msgs['after_us']:.1f} us/group "
          f"(dedupe +{100 * msgs['dedupe_overhead']:.2f} %)")
    s = weights["seconds"]
    print(f"\nweights: {weights['params'] / 1e6:.1f} M params, {weights['bytes'] / 2**20:.0f} MiB fp32, "
          f"trainer -> 1 generator, gloo loopback, median of {args.repeats}")
    print(f"  plain sync             {s['plain']:.3f} s")
    print(f"  sync with digest       {s['digest']:.3f} s  (paired ratio {weights['paired_ratio_digest_vs_plain']:.2f})")
    print(f"  trainer hash + publish {s['trainer_digest']:.3f} s  "
          f"({100 * weights['trainer_digest_share_of_sync']:.0f} % of a plain sync)")
    print(f"  generator check        {s['generator_check']:.3f} s")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
