"""Sharded weight sync vs gather-then-broadcast vs raw broadcast, per trainer-rank count.

Run by ``benchmarks/weight_sync.py --trainer-ranks 1 2 4``. For each N, N trainer
processes hold a ~``--params`` fp32 Llama-like model as the trainer holds it: for N > 1
sharded by ``llamarl.app.rl.sharding.shard`` (real FSDP2 over a gloo group of the N ranks,
one unit per decoder layer), for N = 1 flattened (``flatten_parameters_``); and a second
copy as it was held before each rank's shards went into one flat buffer (``shard(flat=False)``:
each rank's chunks allocations of their own; N = 1: the tensors unflattened).
``--generators`` generator processes hold the full model, flattened as the generator does. Every trainer rank has a weight group of its own with every
generator (what ``llamarl.app.weights.epochs`` builds). The methods, timed round-robin (one of each
per round, so load from other processes lands on all alike), median of ``--repeats``
after a warm-up round, from the moment every process is ready until every generator
holds the bytes (and every trainer rank is done):

- ``sharded``: every trainer rank ``WeightSender(rank, ranks).send`` its own shard;
  each generator's ``WeightReceiver`` over the N groups lands all of them in staging;
  the shards lie in one flat buffer per dtype, so each run goes out as slices of it;
- ``sharded_packed``: the same from the copy whose shards are allocations of their own:
  every part below a bucket's size packed into buckets (``DEFAULT_ALONE_MB``);
- ``sharded_alone``: ``sharded_packed`` with the parts of 1 MB or more sent as they are
  (the sender's ``alone_mb`` at 1): no copy of most bytes, more broadcasts;
- ``gather``: the gather-then-broadcast path: every rank ``full_tensor()`` (the
  all-gather of an FSDP2 full state dict), rank 0 copies the result into its flat
  full-model buffer and sends it (the one-rank path, zero-copy) in its group;
- ``raw``: every trainer rank one bare broadcast of a flat buffer of its shard's byte
  count in its group, all at once: the same traffic with no layout, the floor for
  ``sharded`` (for N = 1, one broadcast of the whole model);
- ``p2p``: the other design for the same traffic: one group of all N + G processes in
  which every trainer rank sends its flat shard to each generator point to point (the
  bytes only, like ``raw``): what one group instead of a group per trainer rank costs.

With ``--digest``, three more, the weight digest's cost (``llamarl.app.weights.digest``) now and
in the two designs before it; the generators check every version of them (a refusal
stops the benchmark):

- ``sharded_digest``: ``sharded`` with the digest as made now: each trainer rank hashes
  its own shard on a thread while it sends it, publishes its signed record after; each
  generator hashes each rank's bytes as each broadcast lands (``DigestCheck``, overlapped
  with the receive), then checks them;
- ``sharded_digest_after``: the same, but each generator hashes each rank's runs in its
  staging after the whole version is in (``DigestCheck(overlap=False)``: the path before);
- ``gather_digest``: the path before the digest went per shard: the gather of ``gather``
  on every sync (the digest was of replica 0's whole copy), rank 0 hashes the whole
  model and publishes, then sends; each generator hashes and checks the whole after
  its receive.

The first ``sharded`` round is checked: the generators' weights, once swapped in, equal
the trainer's full weights bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import connect_store, host_store
from llamarl.app.rl import sharding
from llamarl.app.weights.digest import DigestCheck, ShardDigest
from llamarl.app.weights.group import init_weight_group
from llamarl.app.weights.layout import flatten_parameters_
from llamarl.app.weights.receiver import WeightReceiver
from llamarl.app.weights.sender import WeightSender
from llamarl.app.weights.subscriber import swap_staged
from benchmarks import spawn
from benchmarks.weight_sync import llama_like_params

METHODS = ("sharded", "sharded_packed", "sharded_alone", "gather", "raw", "p2p")
DIGEST_METHODS = ("sharded_digest", "sharded_digest_after", "gather_digest")
SECRET = bytes(range(32))
DIGEST_VERSIONS = 1000
"""Digest method ``k`` (of ``DIGEST_METHODS``) sends version ``DIGEST_VERSIONS * (k + 1) +
round``: they reuse the receivers of ``sharded`` and ``gather``, which hold that round's
version already."""


def _digest_version(method: str, rep: int) -> int:
    return DIGEST_VERSIONS * (DIGEST_METHODS.index(method) + 1) + rep
TIMEOUT_S = 900.0


class _Barrier:
    """Store counters that line every process up around each timed step; trainer rank 0 times."""

    def __init__(self, store, participants: int) -> None:
        self.store, self.others = store, participants - 1

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark: waited {TIMEOUT_S:g} s for {what}")
            time.sleep(0.0005)

    def arrive(self, key: str) -> None:
        self.store.add(key, 1)

    def wait_others(self, key: str) -> None:
        self._wait(lambda: int(self.store.add(key, 0)) >= self.others, f"everyone at {key!r}")

    def wait_key(self, key: str) -> None:
        self._wait(lambda: self.store.check([key]), f"{key!r}")


class _Layer(nn.Module):
    """A decoder layer's parameters: ``sharding.shard`` makes each an FSDP2 unit."""


class _Model(nn.Module):
    _no_split_modules = ["_Layer"]  # what ``sharding.decoder_layers`` reads


def _trainer_params(full: list[tuple[str, torch.Tensor]], ranks: int, flat: bool):
    """``full`` as the trainer holds it (``flat``) or held it before: with several ranks
    a module of the same parameter names sharded by ``sharding.shard`` (every rank calls
    it: a collective), with one the tensors themselves, ``flatten_parameters_`` or not."""
    if ranks == 1:
        params = [(n, t.clone()) for n, t in full]
        if flat:
            flatten_parameters_([t for _, t in params])
        return params
    model = _Model()
    for name, t in full:  # "model.layers.0.mlp.up_proj.weight": a module per dotted part
        *path, leaf = name.split(".")
        node = model
        for i, part in enumerate(path):
            if part not in node._modules:
                node.add_module(part, _Layer() if path[i - 1:i] == ["layers"] else nn.Module())
            node = node._modules[part]
        node.register_parameter(leaf, nn.Parameter(t))  # fully_shard copies its chunk out
    sharding.shard(model, flat=flat)
    return list(model.named_parameters())


def trainer_role(rank: int, ranks: int, generators: int, port: int, args, out) -> None:
    torch.set_num_threads(1)  # N + G processes on a few cores: no oversubscription
    store = connect_store(f"127.0.0.1:{port}", timeout_s=60)
    signed = SignedStore(store, bytes(range(32)), f"trainer/{rank}")  # the weight plane signs its keys
    barrier = _Barrier(store, ranks + generators)
    if ranks > 1:
        dist.init_process_group("gloo", store=dist.PrefixStore("bench/trainer", store), rank=rank,
                                world_size=ranks)
    group = init_weight_group(signed, 0, generators + 1, torch.device("cpu"), timeout_s=600,
                              prefix=f"bench/weights/{rank}")
    one_group = init_weight_group(signed, rank, ranks + generators, torch.device("cpu"), timeout_s=600,
                                  prefix="bench/one_group")
    torch.manual_seed(0)  # every rank the same full model: its chunks are consistent
    full = llama_like_params(args.params)
    params = _trainer_params(full, ranks, flat=True)
    packed_params = _trainer_params(full, ranks, flat=False)
    sharded = WeightSender(group, params, rank=rank, ranks=ranks)
    packed = WeightSender(group, packed_params, rank=rank, ranks=ranks)
    alone = WeightSender(group, packed_params, rank=rank, ranks=ranks, alone_mb=1.0)
    if rank == 0:
        flat_full = [(n, t.clone()) for n, t in full]
        flatten_parameters_([t for _, t in flat_full])
        gather_sender = WeightSender(group, flat_full)
    del full
    raw = torch.randn(sharded.layout.nbytes // 4)
    me = SignedStore(store, SECRET, f"trainer/{rank}")
    shard_digest = ShardDigest(me, params, rank=rank, ranks=ranks)
    full_digest = ShardDigest(me, flat_full, rank=0, ranks=1) if rank == 0 else None

    def gather(rep: int, digest: bool = False) -> None:
        gathered = [p.full_tensor() if ranks > 1 else p for _, p in params]
        if rank == 0:
            with torch.no_grad():
                for (_, dst), src in zip(flat_full, gathered):
                    dst.copy_(src)
            if digest:
                full_digest.now(rep)
            gather_sender.send(rep)

    def send_shard_digest(rep: int) -> None:
        pending = shard_digest.start(rep)
        sharded.send(rep)
        pending.wait()

    per_sender: list[float] = []

    def send_shard(rep: int) -> None:
        stats = sharded.send(rep)
        if rep >= 0:
            per_sender.append(stats.seconds)

    def send_p2p(rep: int) -> None:
        works = [one_group.backend.send([raw], ranks + g, rank) for g in range(generators)]
        for work in works:
            one_group.wait(work)

    methods = {"sharded": send_shard, "sharded_packed": packed.send, "sharded_alone": alone.send, "gather": gather,
               "raw": lambda rep: group.wait(group.broadcast(raw)), "p2p": send_p2p}
    if args.digest:
        methods.update(sharded_digest=lambda rep: send_shard_digest(_digest_version("sharded_digest", rep)),
                       sharded_digest_after=lambda rep: send_shard_digest(
                           _digest_version("sharded_digest_after", rep)),
                       gather_digest=lambda rep: gather(_digest_version("gather_digest", rep), digest=True))
    result: dict[str, list[float]] = {}
    for rep in range(-1, args.repeats):
        for name, fn in methods.items():
            key = f"bench/{ranks}/{name}/{rep}"
            if rank == 0:
                barrier.wait_others(key + "/ready")
                store.set(key + "/go", "1")
                t0 = time.perf_counter()
                fn(rep)
                barrier.wait_others(key + "/done")
                if rep >= 0:
                    result.setdefault(name, []).append(time.perf_counter() - t0)
            else:
                barrier.arrive(key + "/ready")
                barrier.wait_key(key + "/go")
                fn(rep)
                barrier.arrive(key + "/done")
    out.put((f"trainer/{rank}", {"result": result, "per_sender_s": per_sender, "bytes": sharded.layout.nbytes,
                                 "broadcasts": sharded.broadcasts, "zero_copy_buckets": sharded.zero_copy_buckets,
                                 "buckets": sharded.layout.n_buckets, "packed_broadcasts": packed.broadcasts,
                                 "alone_broadcasts": alone.broadcasts}))
    if ranks > 1:
        dist.destroy_process_group()


def generator_role(replica: int, ranks: int, generators: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    store = connect_store(f"127.0.0.1:{port}", timeout_s=60)
    signed = SignedStore(store, bytes(range(32)), f"generator/{replica}")  # the weight plane signs its keys
    barrier = _Barrier(store, ranks + generators)
    groups = [init_weight_group(signed, replica + 1, generators + 1, torch.device("cpu"), timeout_s=600,
                                prefix=f"bench/weights/{r}") for r in range(ranks)]
    one_group = init_weight_group(signed, ranks + replica, ranks + generators, torch.device("cpu"), timeout_s=600,
                                  prefix="bench/one_group")
    torch.manual_seed(100 + replica)
    params = llama_like_params(args.params)
    flatten_parameters_([p for _, p in params])
    sharded = WeightReceiver(groups, params)
    packed = WeightReceiver(groups, params)  # built in the trainer's order of its senders
    alone = WeightReceiver(groups, params)
    gather = WeightReceiver(groups[0], params)
    shard_bytes = [int(x) for x in store.get(f"bench/{ranks}/shard_bytes").decode().split()] \
        if ranks > 1 else [sharded.layout.nbytes]
    raw = torch.empty(sum(shard_bytes) // 4)
    raw_parts = list(raw.split([b // 4 for b in shard_bytes]))

    me = SignedStore(store, SECRET, f"generator/{replica}")
    # Hashing as each broadcast lands (now), and after the whole version is in (before).
    checks = {"streamed": DigestCheck(me, replica, wait_s=TIMEOUT_S),
              "after": DigestCheck(me, replica, wait_s=TIMEOUT_S, overlap=False)}

    # A method's receiver thread is started before its step is timed and stopped after,
    # as a generator's runs all along (one thread at a time: two would both answer group
    # 0's next sync): the timed window is from the announcement to the staged version.
    threads: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}

    def receive_with(receiver: WeightReceiver, method: str, check: str | None = None):
        def start() -> None:
            receiver.verify = None if check is None else checks[check]
            receiver.start_background()

        threads[method] = (start, receiver.stop_background)

        def receive(rep: int) -> None:
            version = rep if check is None else _digest_version(method, rep)
            refused = lambda: any(c.counts for c in checks.values())  # noqa: E731
            barrier._wait(lambda: receiver.latest_version() == version or refused(), f"version {version}")
            if refused():
                raise RuntimeError(f"benchmark: generator {replica} refused a version: "
                                   f"{ {k: c.refused for k, c in checks.items()} }")
        return receive

    def receive_raw(rep: int) -> None:
        works = [(g, g.broadcast(part)) for g, part in zip(groups, raw_parts)]
        for g, work in works:
            g.wait(work)

    def receive_p2p(rep: int) -> None:
        works = [one_group.backend.recv([part], r, r) for r, part in enumerate(raw_parts)]
        for work in works:
            one_group.wait(work)

    methods = {"sharded": receive_with(sharded, "sharded"), "sharded_packed": receive_with(packed, "sharded_packed"),
               "sharded_alone": receive_with(alone, "sharded_alone"), "gather": receive_with(gather, "gather"),
               "raw": receive_raw, "p2p": receive_p2p}
    if args.digest:
        methods.update(sharded_digest=receive_with(sharded, "sharded_digest", "streamed"),
                       sharded_digest_after=receive_with(sharded, "sharded_digest_after", "after"),
                       gather_digest=receive_with(gather, "gather_digest", "after"))
    checked = False
    for rep in range(-1, args.repeats):
        for name, fn in methods.items():
            key = f"bench/{ranks}/{name}/{rep}"
            start, stop = threads.get(name, (lambda: None, lambda: None))
            start()
            barrier.arrive(key + "/ready")
            fn(rep)
            barrier.arrive(key + "/done")
            stop()
            if name == "sharded" and not checked:  # outside the timed window
                torch.manual_seed(0)
                expected = torch.cat([t.reshape(-1) for _, t in llama_like_params(args.params)])
                if swap_staged(sharded) != rep or not torch.equal(
                        torch.cat([p.detach().reshape(-1) for _, p in params]), expected):
                    raise RuntimeError(f"benchmark: generator {replica} staged other weights than the trainer's")
                checked = True
                del expected
    out.put((f"generator/{replica}", {"checked": checked}))


def _publish_shard_bytes(store, ranks: int, args) -> None:
    """Each rank's shard byte count, for the generators' raw buffers (from the same rule)."""
    from llamarl.app.weights.shards import chunk_rows

    torch.manual_seed(0)
    shapes = [tuple(t.shape) for _, t in llama_like_params(args.params)]
    sizes = []
    for rank in range(ranks):
        n = 0
        for shape in shapes:
            start, stop = chunk_rows(shape[0], ranks, rank)
            row = 1
            for d in shape[1:]:
                row *= d
            n += (stop - start) * row * 4
        sizes.append(n)
    store.set(f"bench/{ranks}/shard_bytes", " ".join(map(str, sizes)))


def run(ranks: int, args) -> dict:
    """One N: its processes, their timings; the per-method medians and paired ratios."""
    store = host_store(0, None, timeout_s=600, bind="127.0.0.1")
    _publish_shard_bytes(store, ranks, args)
    roles = [(trainer_role, (r, ranks, args.generators, store.port, args)) for r in range(ranks)]
    roles += [(generator_role, (g, ranks, args.generators, store.port, args)) for g in range(args.generators)]
    reports = spawn.run_roles(roles, timeout_s=TIMEOUT_S * 2)
    times = reports["trainer/0"]["result"]
    med = {m: statistics.median(times[m]) for m in METHODS}
    # Each round runs every method back to back: the ratio inside a round cancels most of
    # the load that other processes put on a shared host.
    paired = {m: statistics.median(t / r for t, r in zip(times[m], times["raw"])) for m in METHODS}
    paired_vs_gather = statistics.median(s / g for s, g in zip(times["sharded"], times["gather"]))
    paired_vs_packed = statistics.median(s / p for s, p in zip(times["sharded"], times["sharded_packed"]))
    digest = {}
    if args.digest:
        def paired_to(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b]))

        digest = {"sharded_digest_s": statistics.median(times["sharded_digest"]),
                  "sharded_digest_after_s": statistics.median(times["sharded_digest_after"]),
                  "gather_digest_s": statistics.median(times["gather_digest"]),
                  "paired_sharded_digest_vs_after": paired_to("sharded_digest", "sharded_digest_after"),
                  "paired_sharded_digest_vs_gather_digest": paired_to("sharded_digest", "gather_digest"),
                  "paired_sharded_digest_vs_sharded": paired_to("sharded_digest", "sharded"),
                  "paired_sharded_digest_after_vs_sharded": paired_to("sharded_digest_after", "sharded"),
                  "paired_gather_digest_vs_gather": paired_to("gather_digest", "gather")}
    return {
        **digest,
        "sharded_s": med["sharded"], "gather_s": med["gather"], "raw_s": med["raw"], "p2p_s": med["p2p"],
        "sharded_vs_gather": med["sharded"] / med["gather"], "sharded_vs_raw": med["sharded"] / med["raw"],
        "paired_sharded_vs_gather": paired_vs_gather, "paired_sharded_vs_raw": paired["sharded"],
        "paired_gather_vs_raw": paired["gather"], "paired_p2p_vs_raw": paired["p2p"],
        "sharded_packed_s": med["sharded_packed"], "paired_sharded_packed_vs_raw": paired["sharded_packed"],
        "paired_sharded_vs_packed": paired_vs_packed,
        "packed_broadcasts_per_sync": {r: reports[f"trainer/{r}"].get("packed_broadcasts") for r in range(ranks)},
        "zero_copy_buckets": {r: [reports[f"trainer/{r}"].get("zero_copy_buckets"), reports[f"trainer/{r}"].get("buckets")]
                              for r in range(ranks)},
        "sharded_alone_s": med["sharded_alone"], "paired_sharded_alone_vs_raw": paired["sharded_alone"],
        "alone_broadcasts_per_sync": {r: reports[f"trainer/{r}"].get("alone_broadcasts") for r in range(ranks)},
        "per_sender_s": {r: statistics.median(reports[f"trainer/{r}"]["per_sender_s"]) for r in range(ranks)},
        "shard_bytes": {r: reports[f"trainer/{r}"]["bytes"] for r in range(ranks)},
        "broadcasts_per_sync": {r: reports[f"trainer/{r}"].get("broadcasts") for r in range(ranks)},
        "checked_bit_for_bit": all(reports[f"generator/{g}"]["checked"] for g in range(args.generators)),
        "all_seconds": times,
    }


def main(args: argparse.Namespace) -> dict:
    by_ranks = {}
    for ranks in args.trainer_ranks:
        load = os.getloadavg()[0]
        by_ranks[str(ranks)] = {**run(ranks, args), "load_avg_1min_before": load}
        r = by_ranks[str(ranks)]
        print(f"  {ranks} trainer rank(s): sharded {r['sharded_s']:.3f} s, packed {r['sharded_packed_s']:.3f} s, "
              f"1 MB parts alone {r['sharded_alone_s']:.3f} s, "
              f"gather {r['gather_s']:.3f} s, "
              f"raw {r['raw_s']:.3f} s, p2p {r['p2p_s']:.3f} s (load {load:.1f})", flush=True)
        if args.digest:
            print(f"    with the digest: per shard, hashed as it lands (now) {r['sharded_digest_s']:.3f} s, "
                  f"hashed after the receive {r['sharded_digest_after_s']:.3f} s (paired now/after "
                  f"{r['paired_sharded_digest_vs_after']:.2f}), gathered {r['gather_digest_s']:.3f} s "
                  f"(paired now/gathered {r['paired_sharded_digest_vs_gather_digest']:.2f})", flush=True)
    return by_ranks
