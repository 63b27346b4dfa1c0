"""What the bad-frame and weight-digest defences cost, side by side with the path they guard.

Messages, per rollout group (in this process): a group of ``--group-size`` completions of
``--tokens`` tokens, as a generator sends it. The path before this change: ``encode``
(which signs: HMAC-SHA256), ``decode`` (which checks the tag first) and the contract check
(``from_message``). Added now: ``Admission`` per group (the seen-id set and the version
check). The HMAC alone over the same frame is timed too, to show what signing costs.

Weights, per sync (a trainer and one generator process, gloo on loopback, ~``--params``
fp32 parameters shaped like a small Llama), four ways round-robin (``METHODS``), median
of ``--repeats`` rounds after a warm-up: a plain sync; the digest before the send (the
trainer hashes and publishes its signed record, then sends: the path before the digest
was overlapped); the digest beside the send (hashed on a thread while the weights are on
the wire, published after the send: what every trainer rank does), the generator
hashing after its receive (the path before) or as each broadcast lands (now). Each is
timed as the trainer pays it (until its send and digest are done) and until the
generator has the version staged (its check included: it hashes what it received, then
reads the record). The trainer's hashing, and what is left of the generator's check once
the last broadcast landed (its hashing, then with the wait for the record), are also
timed on their own.

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
import sys
import time
from pathlib import Path

import torch

if not __package__:  # `python benchmarks/security.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.app.weights import digest as weight_digest  # noqa: E402
from llamarl.app.rl.contract import GroupId, Rejections, Rollout, RolloutGroup, from_message, to_message  # noqa: E402
from llamarl.app.control.frames import decode, encode  # noqa: E402
from llamarl.app.control.seen_groups import Admission  # noqa: E402
from llamarl.app.control.signed import SignedStore  # noqa: E402
from llamarl.app.control.transport import connect_store, host_store  # noqa: E402
from llamarl.app.weights.group import init_weight_group  # noqa: E402
from llamarl.app.weights.layout import flatten_parameters_  # noqa: E402
from llamarl.app.weights.receiver import WeightReceiver  # noqa: E402
from llamarl.app.weights.sender import WeightSender  # noqa: E402
from benchmarks import spawn  # noqa: E402
from benchmarks.weight_sync import _Steps, llama_like_params  # noqa: E402

SECRET = bytes(range(32))


# --------------------------------------------------------------------------- messages


def _group(seq: int, group_size: int, tokens: int) -> RolloutGroup:
    g = torch.Generator().manual_seed(seq)
    gid = GroupId(0, seq)
    prompt = torch.randint(0, 32000, (128,), generator=g)
    return RolloutGroup(group_id=gid, version=3, slot=seq, rollouts=[
        Rollout(prompt_ids=prompt, completion_ids=torch.randint(0, 32000, (tokens,), generator=g),
                behaviour_logprobs=-torch.rand(tokens, generator=g), version=3, group_id=gid,
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


METHODS = ("plain", "digest_serial", "digest_overlap", "digest_streamed")
"""Round-robin, one version each: no digest; hash then publish then send (the path before:
what trainer replica 0 did); hash on a thread while the weights are on the wire, publish
after the send (``ShardDigest.start``: what every trainer rank does), the generator
hashing after its receive (before) or as each broadcast lands (``DigestCheck``: now)."""
OVERLAPPED = ("digest_overlap", "digest_streamed")  # the trainer hashes beside its send


class _Verify:
    """The generator's ``verify``: a plain version taken unchecked, the others checked as
    their method says; the time the check takes after the receive is recorded."""

    def __init__(self, signed: SignedStore, timed) -> None:
        self.timed = timed
        self.checks = {"after": weight_digest.DigestCheck(signed, 0, wait_s=600.0, overlap=False),
                       "streamed": weight_digest.DigestCheck(signed, 0, wait_s=600.0)}

    def start(self, version: int, dtypes: list) -> "_Timed":
        method = METHODS[(version - 1) % len(METHODS)]
        mode = "streamed" if method == "digest_streamed" else "after"
        arriving = None if method == "plain" else self.checks[mode].start(version, dtypes)
        return _Timed(arriving, lambda what, s: self.timed(f"generator_{what}_{mode}", s, version > len(METHODS)))


class _Timed:
    def __init__(self, arriving, record) -> None:
        self.arriving, self.record = arriving, record

    def feed(self, sender: int, run: int, pieces: list) -> None:
        if self.arriving is not None:
            self.arriving.feed(sender, run, pieces)

    def taken(self) -> bool:
        """``Arriving.taken``, its hashing and its wait for the record timed apart."""
        if self.arriving is None:
            return True
        t0 = time.perf_counter()
        digests = self.arriving.hexdigests()
        t1 = time.perf_counter()
        ok = self.arriving.check.judge(self.arriving.version, digests)
        t2 = time.perf_counter()
        self.record("hash_left", t1 - t0)
        self.record("check", t2 - t0)
        return ok


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

    def timed(name: str, seconds: float, r: int) -> None:
        if r:
            times.setdefault(name, []).append(seconds)

    if rank == 0:
        sender = WeightSender(group, params)
        shard = weight_digest.ShardDigest(SignedStore(store, SECRET, "trainer/0"), params, rank=0, ranks=1)
        version = 0
        for r in range(rounds):
            for method in METHODS:  # round-robin: host load lands on all alike
                version += 1  # the generator checks the versions of the digest methods
                t0 = time.perf_counter()
                if method == "digest_serial":
                    timed("trainer_digest", shard.now(version), r)
                pending = shard.start(version) if method in OVERLAPPED else None
                sender.send(version)
                if method == "digest_overlap":
                    t1 = time.perf_counter()
                    timed("trainer_digest_overlapped", pending.wait(), r)
                    timed("trainer_digest_wait", time.perf_counter() - t1, r)
                elif pending is not None:
                    pending.wait()
                timed(f"trainer_{method}", time.perf_counter() - t0, r)  # what a trainer step pays
                _wait(lambda: store.check([f"bench/staged/{version}"]), f"version {version} staged")
                timed(method, time.perf_counter() - t0, r)  # until the generator has it staged
        out.put((rank, {"times": times, "params": sum(p.numel() for _, p in params),
                        "bytes": sum(p.numel() * p.element_size() for _, p in params)}))
        return
    verify = _Verify(SignedStore(store, SECRET, "generator/0"), timed)
    receiver = WeightReceiver(group, params, verify=verify)
    receiver.start_background()
    for version in range(1, len(METHODS) * rounds + 1):
        _wait(lambda: receiver.latest_version() == version, f"version {version}")
        store.set(f"bench/staged/{version}", "1")
    receiver.stop_background()
    out.put((rank, {"times": times, "refused": {k: dict(c.counts) for k, c in verify.checks.items() if c.counts}}))


def bench_weights(args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    store = host_store(0, None, timeout_s=600, bind="127.0.0.1")
    reports = spawn.run_roles([(weight_role, (r, store.port, args)) for r in range(2)], timeout_s=1800)
    trainer, generator = reports[0], reports[1]
    if generator["refused"]:
        raise RuntimeError(f"benchmark: the generator refused versions: {generator['refused']}")
    t = {**trainer["times"], **generator["times"]}
    med = {k: statistics.median(v) for k, v in t.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(t[a], t[b]))

    return {"seconds": med, "all_seconds": t, "params": trainer["params"], "bytes": trainer["bytes"],
            "paired_ratio_serial_vs_plain": paired("digest_serial", "plain"),
            "paired_ratio_overlap_vs_plain": paired("digest_overlap", "plain"),
            "paired_ratio_overlap_vs_serial": paired("digest_overlap", "digest_serial"),
            "paired_ratio_streamed_vs_plain": paired("digest_streamed", "plain"),
            "paired_ratio_streamed_vs_overlap": paired("digest_streamed", "digest_overlap"),
            "trainer_paired_ratio_serial_vs_plain": paired("trainer_digest_serial", "trainer_plain"),
            "trainer_paired_ratio_overlap_vs_plain": paired("trainer_digest_overlap", "trainer_plain"),
            "trainer_paired_ratio_overlap_vs_serial": paired("trainer_digest_overlap", "trainer_digest_serial"),
            "trainer_digest_share_of_sync": med["trainer_digest"] / med["trainer_plain"],
            "digest_threads": min(8, os.cpu_count() or 1), "load_avg_1min_before": load}


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
    s, w = weights["seconds"], weights
    print(f"\nweights: {w['params'] / 1e6:.1f} M params, {w['bytes'] / 2**20:.0f} MiB fp32, "
          f"trainer -> 1 generator, gloo loopback, median of {args.repeats}")
    print(f"  {'':<16}{'trainer pays':>14}{'until staged':>14}")
    for m in METHODS:
        print(f"  {m:<16}{s[f'trainer_{m}']:>12.3f} s{s[m]:>12.3f} s")
    print(f"  paired ratios, trainer pays: serial/plain {w['trainer_paired_ratio_serial_vs_plain']:.2f}, "
          f"overlap/plain {w['trainer_paired_ratio_overlap_vs_plain']:.2f}, "
          f"overlap/serial {w['trainer_paired_ratio_overlap_vs_serial']:.2f}")
    print(f"  paired ratios, until staged: serial/plain {w['paired_ratio_serial_vs_plain']:.2f}, "
          f"overlap/plain {w['paired_ratio_overlap_vs_plain']:.2f}, "
          f"overlap/serial {w['paired_ratio_overlap_vs_serial']:.2f}, "
          f"streamed/plain {w['paired_ratio_streamed_vs_plain']:.2f}, "
          f"streamed/overlap {w['paired_ratio_streamed_vs_overlap']:.2f}")
    print(f"  trainer hash + publish {s['trainer_digest']:.3f} s alone, {s['trainer_digest_overlapped']:.3f} s "
          f"beside the send ({s['trainer_digest_wait']:.3f} s waited after it)")
    print(f"  generator, once the last broadcast landed, hashing after the receive (serial, overlap): "
          f"{s['generator_hash_left_after']:.3f} s hash, {s['generator_check_after']:.3f} s with the record")
    print(f"  generator, once the last broadcast landed, hashing as it lands (streamed): "
          f"{s['generator_hash_left_streamed']:.3f} s hash, {s['generator_check_streamed']:.3f} s with the record")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
