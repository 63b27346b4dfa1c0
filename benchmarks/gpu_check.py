"""GPU check: the CUDA paths of llamarl, exercised on a CUDA machine in a few minutes.

    python benchmarks/gpu_check.py [--json PATH] [--skip CHECK ...] [--only CHECK ...]
    python benchmarks/gpu_check.py --cpu-dry-run     # the same steps on the CPU and gloo

Run from the repository root after the README's setup (with a CUDA build of torch). Each
check runs on its own and is reported as ok, skipped (with the reason) or failed (with
the error); the exit code is 1 when one failed, 2 when this machine has no CUDA device.
Checks run in ``CHECKS``' order; the report is written after each one (``finished``
false until the last), so a run killed at a time limit keeps what it finished.

- ``environment``: torch and CUDA versions, the GPUs, bf16 support, NCCL and NVML;
- ``generator``: the policy on ``cuda:0`` samples groups (tokens/s, finite log-probs);
- ``static_decoder``: both static decoders (``llamarl.app.sampling.static_decode``: captured CUDA
  graphs, and ``compiled``, torch.compile's reduce-overhead) against the eager loop on
  the policy: the same greedy tokens, log-probs within 1e-5, each side's tokens/s, the
  capture's and the compilations' seconds, and no compiled step run without its CUDA
  graphs (the dry run: the same steps on the CPU, without capture; compiled by inductor);
- ``trainer``: one AIPO step on ``cuda:0`` in bf16 autocast (where the GPU runs it; the
  dry run too) and the same step in fp32 from the same weights: losses side by side
  (5% apart fails), weights stay fp32;
- ``weight_plane_shared``: a trainer process and a generator process on the same GPU
  (the one-GPU workstation): the plane picks gloo with host staging; the trainer trains
  a step, syncs, and the generator's weights equal the trainer's bit for bit, then it
  samples with them;
- ``weight_plane_nccl``: the same with the generator on ``cuda:1``: NCCL (skipped, and
  said so, on a machine with one GPU);
- ``fsdp2_step``: one training step of the trainer's FSDP2 path (``llamarl.app.rl.sharding``:
  ``fully_shard`` per decoder layer, then the root) over ``min(2, GPUs)`` ranks with
  uneven shares of the batch, against one process's unsharded step on the whole batch
  (losses, and weights after an SGD step, compared);
- ``app_run``: the TorchX app on ``local_cwd`` for a few steps with ``--trainer_gpu 1
  --generator_gpu 1``: steps done, weight syncs and GPU metrics in ``metrics.db``, and
  the weight plane's backend from the trainer's log (needs torchx and llamarl installed:
  see below);
- ``gpu_tests``: the tests marked ``gpu`` (``pytest -m gpu``, a process per file holding
  them, so that a device-side assert fails one file only; the captured decoder's issue
  18 tests among them);
- ``sampler_benchmark``: issue 18's table, ``benchmarks/sampler.py`` with ``SAMPLER_BENCH_ARGS``
  (captured and compiled samplers, eager, ``generate`` and ``generate`` with a static
  cache on 374M bf16 at 64 and 256 rows; captured, eager and ``generate`` on 60M fp32 at
  64), its JSON beside this report as ``sampler_gpu.json`` (to commit as
  ``benchmarks/results/sampler_gpu.json``), within ``SAMPLER_BENCH_TIMEOUT_S`` (what it
  measured before a timeout is kept); the compiling sides' ``cudagraph_skips`` must be 0
  (else their figures are not of CUDA graphs: the check fails, the figures kept);
- ``check_every_benchmark``: ``static_decode.CHECK_EVERY`` at 1, 4, 8, 16 on the captured
  sampler (``CHECK_EVERY_ARGS``), ``sampler_check_every_gpu.json`` beside the report,
  within ``CHECK_EVERY_TIMEOUT_S``.

The two benchmarks' dry run runs the same script and sides on the CPU at 8 rows of the
tiny policy, without the compiling sides (``DRY_RUN_LEFT_OUT``), and keeps no JSON.

The JSON (``--json``; default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu_check.json``, ``gpu_check_cpu_dry_run.json`` for a dry run)
holds every check's status, seconds and figures.

On this workplace's lent GPU machine (``/work/.library/device/``: 15 minutes of device
time per session, the machine's start of a minute or two included, at most 600 s per
call, at most 8 files back from ``$OUT``; its image has torch 2.11 and transformers
5.17, not torchx), issue 18 in one call, through the ``device`` tool's ``run`` with
``timeout_s`` 590 (the checks' sum: ~10 s tiny policy, ~60 s static_decoder with two
compilations, gpu_tests up to ``GPU_TEST_TIMEOUT_S`` (expected ~1-2 minutes), the table
up to 300 s, the CHECK_EVERY run up to 150 s (expected ~1 minute); a kill at the limit
keeps the report of the checks done and the table's finished cases)::

    export PYTHONUNBUFFERED=1; nvidia-smi -L; python3 benchmarks/gpu_check.py --only environment \
        static_decoder gpu_tests sampler_benchmark check_every_benchmark 2>&1 | tee $OUT/gpu_check.log

It brings back ``gpu_check.json``, ``sampler_gpu.json``, ``sampler_check_every_gpu.json``
and the log. Then, if at least 5 minutes of device time are left (``status``), on the
same warm machine, the rest but the app (``timeout_s`` what is left less a minute)::

    export PYTHONUNBUFFERED=1; python3 benchmarks/gpu_check.py --json $OUT/gpu_check_rest.json \
        --only generator trainer weight_plane_shared weight_plane_nccl fsdp2_step 2>&1 | tee $OUT/rest.log

``app_run`` needs torchx 0.7.0 and llamarl's entry points on that machine (carried as
wheels, README's Notes of the device tool): left for a session with time to spare.
Commit ``sampler_gpu.json`` as ``benchmarks/results/sampler_gpu.json`` and the table in
the README; ``give_back`` at the end.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import multiprocessing as mp
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python benchmarks/gpu_check.py`: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from llamarl.app import devices
from llamarl.app.rl import step as rl
from llamarl.app.rl import sharding
from llamarl.app.tasks import arithmetic as tasks# noqa: E402
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup  # noqa: E402
from llamarl.app.model.policy import encode_prompts, load_policy  # noqa: E402
from llamarl.app.sampling import SamplingParams  # noqa: E402
from llamarl.app.control.signed import SignedStore  # noqa: E402
from llamarl.app.control.transport import connect_store, host_store  # noqa: E402
from llamarl.app.weights.group import init_weight_group  # noqa: E402
from llamarl.app.weights.layout import flatten_parameters_  # noqa: E402
from llamarl.app.weights.receiver import WeightReceiver  # noqa: E402
from llamarl.app.weights.sender import WeightSender  # noqa: E402
from llamarl.app.weights.subscriber import swap_staged  # noqa: E402

CHECKS = ("environment", "generator", "static_decoder", "trainer", "weight_plane_shared", "weight_plane_nccl",
          "fsdp2_step", "app_run", "gpu_tests", "sampler_benchmark", "check_every_benchmark")
"""In the order they run: the benchmarks last, the longest and the least needed to know
the code works."""
GPU_TEST_TIMEOUT_S = 300.0
SAMPLER_BENCH_TIMEOUT_S = 300.0
SAMPLER_BENCH_ARGS = ["--device", "cuda", "--sampler", "captured", "compiled", "eager", "generate", "generate_static",
                      "--case", "374m:64:bf16", "374m:256:bf16", "60m:64:fp32:captured+eager+generate",
                      "--group-size", "4", "--prompt-tokens", "64", "--max-new-tokens", "128", "--repeats", "2",
                      "--threads", "0"]
"""Issue 18's table within its 5 minutes (``SAMPLER_BENCH_TIMEOUT_S``), compile warm-ups
included: the issue's targets (374M bf16, 64 and 256 rows) first, with every side,
``compiled`` beside ``captured`` (each side's compilation or capture in its
``warmup_s``); 60M fp32 last, without the two compiled sides (the issue's table has no
``generate_static`` there, and the compile-or-capture question is the targets'): the
compilations are what would push the run past 5 minutes (~30 s per batch shape for
``generate_static`` on an H200, per the issue; ``compiled`` compiles its first bucket
only, the rows of random-init models rarely ending). 2 timed repeats after 2 warm-up
rounds. A case the timeout cuts off is missing from the JSON, whose cases so far stay."""
CHECK_EVERY_TIMEOUT_S = 150.0
CHECK_EVERY_ARGS = ["--device", "cuda", "--sampler", "captured", "--check-every", "1", "4", "8", "16",
                    "--case", "374m:64:bf16", "--group-size", "4", "--prompt-tokens", "64", "--max-new-tokens", "128",
                    "--repeats", "3", "--threads", "0"]
"""``static_decode.CHECK_EVERY`` measured again where the host reads it spaces out stall
the launch queue: the captured sampler at k = 1, 4, 8 and 16 on the 374M bf16 Llama at
64 rows (its rows rarely end: what k costs here is the reads alone)."""
DRY_RUN_BENCH_ARGS = ["--device", "cpu", "--case", "default:8:fp32", "--group-size", "4", "--max-new-tokens", "8",
                      "--repeats", "1", "--threads", "1"]
"""The dry run's stand-in for both benchmarks: the same script and sides on the CPU, on
the check's tiny policy, 8 rows (the script is checked, nothing is measured), less
``DRY_RUN_LEFT_OUT``."""
DRY_RUN_LEFT_OUT = ("compiled", "generate_static")
"""Sides the dry run leaves out: their compilations would cost it a minute and check no
plumbing of the script (the static_decoder check's dry run compiles)."""
ROLE_TIMEOUT_S = 240.0
APP_TIMEOUT_S = 300.0
APP_STEPS = 3
SMALL_APP = ["--eval-every", str(APP_STEPS), "--eval-size", "20", "--prompts-per-step", "4", "--group-size", "4",
             "--gen-batch-prompts", "2", "--max-new-tokens", "24"]
PROMPTS, GROUP = 4, 4


class Skipped(Exception):
    """A check that cannot run on this machine; the message says why."""


@dataclass
class Target:
    dry_run: bool
    gpus: int
    policy: Path
    work: Path
    reports: Path
    """Where the report goes: the benchmarks' JSON files go beside it."""

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu") if self.dry_run else torch.device("cuda", index)


# --------------------------------------------------------------------------- shared steps


def _sampled_groups(model, tokenizer, device: torch.device, seed: int = 0) -> list[RolloutGroup]:
    problems = tasks.make_split("eval", PROMPTS, seed=seed)
    return rl.generate_groups(model, tokenizer, problems, group_size=GROUP,
                              params=SamplingParams(max_new_tokens=24, temperature=1.0), version=0,
                              rng=devices.seeded_generator(device, seed))


def _with_advantages(groups: list[RolloutGroup]) -> list[Rollout]:
    """Alternating +-1 advantages: every rollout takes part in the pass (a random or
    barely trained policy's rewards are mostly equal, and equal rewards skip it)."""
    rollouts = [r for g in groups for r in g.rollouts]
    for i, r in enumerate(rollouts):
        r.advantage = 1.0 if i % 2 else -1.0
    return rollouts


def _train_once(model, rollouts: list[Rollout], dtype: torch.dtype, pad_id: int,
                ranks: sharding.Ranks | None = None, *, sgd: bool = False) -> dict[str, float]:
    """One step; ``sgd``: plain SGD at lr 1, so the update is the (clipped) gradient
    itself and two steps' weights differ as much as their gradients (AdamW's update is
    about lr in size whatever the gradient)."""
    device = next(model.parameters()).device
    optimizer = (torch.optim.SGD(model.parameters(), lr=1.0) if sgd
                 else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))
    with devices.autocast(device, dtype):
        stats = rl.train_step(model, optimizer, rollouts, rl.StepConfig(micro_batch=4), pad_id=pad_id, ranks=ranks)
    devices.synchronize(device)
    return stats


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to(devices.HOST).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_ranks(fn: Callable, world: int, *args) -> list[Any]:
    """``fn(store, rank, world, *args)`` in ``world`` spawned processes (CUDA cannot be
    forked) around a store on loopback; their results by rank, or RuntimeError with the
    first failure's traceback."""
    store = host_store(0, None, timeout_s=ROLE_TIMEOUT_S, bind="127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn, rank, world, store.port, out, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + ROLE_TIMEOUT_S
    try:
        while len(results) < world:
            rank, ok, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _rank_entry(fn: Callable, rank: int, world: int, port: int, out, *args) -> None:
    try:
        store = connect_store(f"127.0.0.1:{port}", timeout_s=60)
        out.put((rank, True, fn(store, rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the check
        out.put((rank, False, traceback.format_exc()))


# --------------------------------------------------------------------------- checks


def check_environment(t: Target) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "nccl_available": dist.is_nccl_available(), "dry_run": t.dry_run}
    if t.dry_run:
        return out
    gpus = []
    for i in range(torch.cuda.device_count()):
        d = torch.device("cuda", i)
        props = torch.cuda.get_device_properties(d)
        gpus.append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "memory_gb": round(props.total_memory / 2**30, 1), "bf16": devices.bf16_capable(d)})
    out["gpus"] = gpus
    out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    try:
        out["utilization_readable"] = isinstance(torch.cuda.utilization(0), int)
    except Exception as e:  # noqa: BLE001 - NVML missing is a finding, not a failure
        out["utilization_readable"] = f"no: {type(e).__name__}: {e}"
    return out


def check_generator(t: Target) -> dict[str, Any]:
    device = devices.choose_device("cpu" if t.dry_run else "cuda")
    model, tokenizer = load_policy(t.policy, device=device)
    _sampled_groups(model, tokenizer, device)  # warm-up: allocator, kernels
    t0 = time.perf_counter()
    groups = _sampled_groups(model, tokenizer, device, seed=1)
    devices.synchronize(device)
    seconds = time.perf_counter() - t0
    rollouts = [r for g in groups for r in g.rollouts]
    logprobs = torch.cat([r.behaviour_logprobs for r in rollouts])
    if not bool(((logprobs <= 0) & (logprobs == logprobs)).all()):
        raise AssertionError("a behaviour log-prob is NaN or positive")
    tokens = sum(len(r.completion_ids) for r in rollouts)
    return {"device": devices.describe(device), "sequences": len(rollouts), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "device_metrics": devices.device_metrics(device)}


def check_static_decoder(t: Target) -> dict[str, Any]:
    from llamarl.app.sampling import sample, static_decode

    device = devices.choose_device("cpu" if t.dry_run else "cuda")
    model, tokenizer = load_policy(t.policy, device=device)
    problems = tasks.make_split("eval", PROMPTS, seed=0)
    prompts = [p for p in encode_prompts(tokenizer, [tasks.format_prompt(p.question) for p in problems])
               for _ in range(GROUP)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    ids = dict(eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    out, tokens_per_s = {}, {}
    for decoder in ("eager", "static", "compiled") * 2:  # the second round is timed
        t0 = time.perf_counter()
        out[decoder] = sample(model, prompts, greedy, decoder=decoder, **ids)
        devices.synchronize(device)
        tokens_per_s[decoder] = round(int(out[decoder].lengths_B.sum()) / (time.perf_counter() - t0), 1)
    diffs = {}
    for decoder in ("static", "compiled"):  # both against the eager loop, both reported before either fails
        diffs[decoder] = float((out[decoder].logprobs_BT - out["eager"].logprobs_BT).abs().max())
    captured, compiled = static_decode.decoder_for(model), static_decode.decoder_for(model, compiled=True)
    report = {"device": devices.describe(device), "captured": captured.capture, "graphs": len(captured.graphs),
              "capture_s": round(captured.capture_s, 3), "tokens_per_s": tokens_per_s["static"],
              "eager_tokens_per_s": tokens_per_s["eager"], "max_logprob_diff": diffs["static"],
              "compiled_steps": len(compiled.steps), "compile_s": round(compiled.capture_s, 3),
              "compiled_tokens_per_s": tokens_per_s["compiled"], "compiled_max_logprob_diff": diffs["compiled"],
              "compiled_cudagraph_skips": compiled.cudagraph_skips}
    for decoder, name in (("static", "static (captured)"), ("compiled", "compiled")):
        if not torch.equal(out[decoder].tokens_BT, out["eager"].tokens_BT):
            raise AssertionError(f"the {name} decoder's greedy tokens differ from the eager loop's; {report}")
        if diffs[decoder] > 1e-5:
            raise AssertionError(f"the {name} decoder's log-probs differ from the eager loop's by {diffs[decoder]:g}")
    if compiled.cudagraph_skips:
        raise AssertionError(f"inductor ran {compiled.cudagraph_skips} compiled decode steps without CUDA graphs "
                             "(the log says why): the compiled decoder's measurement would not be of graphs")
    return report


def check_trainer(t: Target) -> dict[str, Any]:
    device = devices.choose_device("cpu" if t.dry_run else "cuda")
    # The dry run takes the bf16 autocast path a GPU takes (the CPU runs it, slowly).
    dtype = devices.train_dtype("bf16" if t.dry_run else "auto", device)
    model, tokenizer = load_policy(t.policy, device=device)
    rollouts = _with_advantages(_sampled_groups(model, tokenizer, device))
    reference = copy.deepcopy(model)
    t0 = time.perf_counter()
    stats = _train_once(model, rollouts, dtype, tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    fp32 = _train_once(reference, rollouts, torch.float32, tokenizer.pad_token_id)
    if any(p.dtype != torch.float32 or not torch.isfinite(p).all() for p in model.parameters()):
        raise AssertionError("after the step a weight is not fp32 or not finite")
    # bf16 rounding moves the loss by parts in ten thousand on the CPU (tests/test_devices.py):
    # 5% apart means something else differs between the two passes.
    rel = abs(stats["loss"] - fp32["loss"]) / max(abs(fp32["loss"]), 1e-3)
    if rel > 0.05:
        raise AssertionError(f"the {dtype} step's loss {stats['loss']} is {rel:.1%} from the fp32 step's {fp32['loss']}")
    return {"device": devices.describe(device), "precision": str(dtype).removeprefix("torch."),
            "loss": stats["loss"], "loss_fp32": fp32["loss"], "loss_rel_diff": rel, "grad_norm": stats["grad_norm"],
            "step_s": round(seconds, 3), "rollouts": len(rollouts), "device_metrics": devices.device_metrics(device)}


def _weight_plane_role(store, rank: int, world: int, policy: str, device_names: list[str]) -> dict[str, Any]:
    """Rank 0 the trainer (one step, then the sync), rank 1 a generator (receives, swaps,
    samples), each on ``device_names[rank]``."""
    device = torch.device(device_names[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, tokenizer = load_policy(policy, device=device)
    flatten_parameters_(model)
    signed = SignedStore(store, bytes(range(32)), f"member/{rank}")  # the weight plane signs its keys
    group = init_weight_group(signed, rank, world, device, timeout_s=120)
    path = {"backend": group.path.backend, "staged": group.path.staged, "reason": group.path.reason}
    if rank == 0:
        rollouts = _with_advantages(_sampled_groups(model, tokenizer, device))
        _train_once(model, rollouts, devices.train_dtype("auto", device), tokenizer.pad_token_id)
        sender = WeightSender(group, list(model.named_parameters()))
        stats = sender.send(1)
        return {**path, "device": devices.describe(device), "bytes": stats.bytes, "seconds": round(stats.seconds, 4),
                "digest": _digest(model)}
    receiver = WeightReceiver(group, list(model.named_parameters()))
    receiver.start_background()
    deadline = time.monotonic() + 120
    while receiver.latest_version() != 1:
        if time.monotonic() > deadline:
            raise TimeoutError("version 1 did not arrive within 120 s")
        time.sleep(0.005)
    receiver.stop_background()
    t0 = time.perf_counter()
    swap_staged(receiver)
    devices.synchronize(device)
    swap_s = time.perf_counter() - t0
    groups = _sampled_groups(model, tokenizer, device, seed=2)  # with the new weights
    (stats,) = receiver.pop_stats()
    return {**path, "device": devices.describe(device), "seconds": round(stats.seconds, 4),
            "swap_s": round(swap_s, 4), "digest": _digest(model),
            "sampled_tokens": sum(len(r.completion_ids) for g in groups for r in g.rollouts)}


def check_weight_plane_shared(t: Target) -> dict[str, Any]:
    devices_ = [str(t.device(0)), str(t.device(0))]
    return _compare_sync(_run_ranks(_weight_plane_role, 2, str(t.policy), devices_),
                         expect=("gloo", not t.dry_run))


def check_weight_plane_nccl(t: Target) -> dict[str, Any]:
    if t.dry_run:
        raise Skipped("CPU dry run: NCCL needs GPUs")
    if t.gpus < 2:
        raise Skipped(f"needs 2 GPUs (a process on each), this machine has {t.gpus}")
    devices_ = [str(t.device(0)), str(t.device(1))]
    return _compare_sync(_run_ranks(_weight_plane_role, 2, str(t.policy), devices_), expect=("nccl", False))


def _compare_sync(results: list[dict[str, Any]], *, expect: tuple[str, bool]) -> dict[str, Any]:
    trainer, generator = results
    if (trainer["backend"], trainer["staged"]) != expect:
        raise AssertionError(f"the weight plane chose {trainer['backend']} (staged={trainer['staged']}), "
                             f"expected {expect[0]} (staged={expect[1]}): {trainer['reason']}")
    if trainer["digest"] != generator["digest"]:
        raise AssertionError("after the sync the generator's weights differ from the trainer's")
    return {"backend": trainer["backend"], "staged": trainer["staged"], "reason": trainer["reason"],
            "trainer": trainer["device"], "generator": generator["device"], "bytes": trainer["bytes"],
            "send_s": trainer["seconds"], "receive_s": generator["seconds"], "swap_s": generator["swap_s"],
            "bit_identical": True, "sampled_tokens_after_sync": generator["sampled_tokens"]}


def _fsdp_rollouts(vocab: int, pad_id: int, n: int = 13) -> list[Rollout]:
    """Made-up rollouts of ragged lengths, the same in every process (a CPU generator)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist()
        completion = torch.randint(3, vocab, (2 + i % 5,), generator=g).tolist()
        out.append(Rollout(prompt_ids=prompt, completion_ids=completion,
                              behaviour_logprobs=(-torch.rand(len(completion), generator=g) - 2).tolist(),
                              version=0, group_id=GroupId(0, i // 4), advantage=1.0 if i % 2 else -1.0))
    return [r for r in out if pad_id not in r.prompt_ids]


def _fsdp_role(store, rank: int, world: int, policy: str, dry_run: bool) -> dict[str, Any]:
    """The trainer's FSDP2 step (``llamarl.app.rl.sharding``, ``rl.train_step(ranks=...)``): rank r
    trains on rollouts r, r + world, ... (uneven shares); the reference is one process
    on all of them, unsharded."""
    device = devices.choose_device("cpu" if dry_run else "cuda", rank=rank)
    dist.init_process_group("gloo" if dry_run else devices.trainer_backend(), store=dist.PrefixStore("fsdp", store),
                            rank=rank, world_size=world)
    try:
        model, tokenizer = load_policy(policy, device=device)
        plain = copy.deepcopy(model)
        rollouts = _fsdp_rollouts(model.config.vocab_size, tokenizer.pad_token_id)
        sharding.shard(model)
        t0 = time.perf_counter()
        sharded = _train_once(model, rollouts[rank::world], torch.float32, tokenizer.pad_token_id,
                              ranks=sharding.Ranks(device), sgd=True)
        step_s = time.perf_counter() - t0
        reference = _train_once(plain, rollouts, torch.float32, tokenizer.pad_token_id, sgd=True)
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        diff = max(float((full[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
        return {"loss": sharded["loss"], "loss_unsharded": reference["loss"], "max_weight_diff": diff,
                "step_s": round(step_s, 3), "device": devices.describe(device)}
    finally:
        dist.destroy_process_group()


def check_fsdp2_step(t: Target) -> dict[str, Any]:
    world = 2 if t.dry_run else min(2, t.gpus)
    results = _run_ranks(_fsdp_role, world, str(t.policy), t.dry_run)
    first = results[0]
    if abs(first["loss"] - first["loss_unsharded"]) > 1e-4 * max(1.0, abs(first["loss_unsharded"])):
        raise AssertionError(f"FSDP2 loss {first['loss']} differs from the unsharded {first['loss_unsharded']}")
    if max(r["max_weight_diff"] for r in results) > 1e-5:
        raise AssertionError(f"FSDP2 weights differ from the unsharded step's by {first['max_weight_diff']:g}")
    return {"ranks": world, **first}


def check_app_run(t: Target) -> dict[str, Any]:
    from torchx.runner import get_runner
    from torchx.specs import AppState, parse_app_handle

    from benchmarks import apps

    runs, logs = t.work / "runs", t.work / "torchx-logs"
    gpu = "0" if t.dry_run else "1"
    # One thread a process on the CPU: two processes of two threads on two cores spin in
    # each other's OpenMP barriers, 10x slower (``--threads``: threads x processes <= cores).
    threads = "1" if t.dry_run else "2"
    options = ["--policy", str(t.policy), "--runs_dir", str(runs), "--steps", str(APP_STEPS), "--num_generators", "1",
               "--trainer_gpu", gpu, "--generator_gpu", gpu, "--threads", threads]
    # The dry run takes bf16 too (auto is fp32 on the CPU): the flag reaches the trainer.
    flags = [*SMALL_APP, *(["--train-precision", "bf16"] if t.dry_run else [])]
    t0 = time.monotonic()
    with get_runner() as runner:
        handle = apps.start(runner, options, flags, log_dir=logs, cfg={"auto_set_cuda_visible_devices": True})
        try:
            status = apps.wait(runner, handle, APP_TIMEOUT_S)
        finally:
            runner.cancel(handle)
    app_id = parse_app_handle(handle).app_id
    trainer_log = "".join(p.read_text(errors="replace") for p in logs.glob(f"*/{app_id}/trainer/0/combined.log"))
    if status.state != AppState.SUCCEEDED:
        raise AssertionError(f"the app ended {status.state.name}; the trainer's log ends:\n{trainer_log[-3000:]}")
    db = sqlite3.connect(runs / app_id / "metrics.db")
    try:
        steps = db.execute("SELECT MAX(step) FROM scalars WHERE name = 'train/step_s'").fetchone()[0]
        syncs = db.execute("SELECT COUNT(*) FROM weight_sync WHERE receiver NOT LIKE 'trainer%'").fetchone()[0]
        gpu_metrics = dict(db.execute("SELECT role, COUNT(*) FROM scalars WHERE name LIKE 'device/%' "
                                      "GROUP BY role").fetchall())
        idle = dict(db.execute("SELECT role, SUM(CASE WHEN kind = 'idle' THEN t1 - t0 ELSE 0 END) / SUM(t1 - t0) "
                               "FROM intervals GROUP BY role").fetchall())
    finally:
        db.close()
    plane = _logged(trainer_log, "weight plane epoch 1: ")
    placed = _logged(trainer_log, "trainer rank 0 on ")
    if steps != APP_STEPS or syncs < APP_STEPS:
        raise AssertionError(f"{steps} steps and {syncs} generator syncs recorded, expected {APP_STEPS} and more")
    if placed is None or ("bf16" not in placed and (t.dry_run or devices.bf16_capable(t.device(0)))):
        raise AssertionError(f"the trainer did not say it trains in bf16: {placed!r}")
    if not t.dry_run and set(gpu_metrics) != {"trainer", "generator"}:
        raise AssertionError(f"GPU metrics recorded by {sorted(gpu_metrics)}, expected trainer and generator")
    return {"app_id": app_id, "seconds": round(time.monotonic() - t0, 1), "steps": steps,
            "generator_syncs": syncs, "gpu_metric_rows": gpu_metrics,
            "idle_fraction": {k: round(v, 3) for k, v in idle.items()},
            "weight_plane": plane, "trainer": placed}


def check_gpu_tests(t: Target) -> dict[str, Any]:
    """The tests marked ``gpu`` (the quantized generators' bf16 and fp8 kernels, the
    devices' CUDA paths, the weight digest of CUDA weights, the captured and compiled
    decoders), which plain pytest skips without a GPU: run here, on the GPU, one pytest
    process per file, all within ``GPU_TEST_TIMEOUT_S``: a device-side assert ends a
    process's use of the GPU, and would fail every test after it in the same process."""
    if t.dry_run:
        raise Skipped("the gpu-marked tests need CUDA; a dry run leaves them out")
    # Only the files that hold such tests: collecting the others would import what the
    # GPU check needs not (torchx, selenium, ...), which a bare GPU machine may lack.
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in f.read_text())
    deadline = time.monotonic() + GPU_TEST_TIMEOUT_S
    summaries, failed = {}, {}
    for file in files:
        try:
            # `-o addopts=-ra`: one process, without pyproject's xdist workers (`-n auto`),
            # which a GPU machine's image may not have installed and one GPU would not share.
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-m", "gpu",
                                   "-p", "no:cacheprovider", file],
                                  cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            summaries[file] = "timed out"
            failed[file] = f"timed out (GPU_TEST_TIMEOUT_S {GPU_TEST_TIMEOUT_S:g} s in all):\n{str(e.stdout)[-2000:]}"
            continue
        summaries[file] = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode != 0:
            failed[file] = proc.stdout[-4000:]
    if failed:
        raise AssertionError(f"pytest -m gpu: {summaries}\n" + "\n".join(f"{f}:\n{out}" for f, out in failed.items()))
    return {"pytest": summaries, "files": files}


def _sampler_script(t: Target, args: list[str], name: str, timeout_s: float) -> dict[str, Any]:
    """``benchmarks/sampler.py args``, its JSON ``name`` beside this report, within
    ``timeout_s`` (what it measured before a timeout is kept); the dry run runs
    ``DRY_RUN_BENCH_ARGS`` with ``args``' sides instead, on the tiny policy."""
    out = (t.work if t.dry_run else t.reports) / name  # a dry run's figures are not worth keeping
    if t.dry_run:
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--sampler", nargs="+")
        parser.add_argument("--check-every", nargs="+", default=None)
        sides, _ = parser.parse_known_args(args)
        args = ["--sampler", *[s for s in sides.sampler if s not in DRY_RUN_LEFT_OUT],
                *(["--check-every", *sides.check_every] if sides.check_every else []),
                *DRY_RUN_BENCH_ARGS, "--policy", str(t.policy)]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        # PYTHONPATH: the script imports `app`, which a machine without llamarl installed
        # (a lent GPU machine) finds only in this checkout.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampler.py"), *args, "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=True)
        finished = True
    except subprocess.TimeoutExpired:
        finished = False  # the JSON holds the cases measured so far
    except subprocess.CalledProcessError as e:
        raise AssertionError(f"benchmarks/sampler.py failed:\n{e.stderr[-3000:]}") from e
    runs = json.loads(out.read_text())["runs"] if out.exists() else []

    def label(r: dict) -> str:
        return " ".join(str(x) for x in (r["config"], r["precision"], r["rows"], r["sampler"],
                                         r.get("check_every", ""))).strip()

    ran = [r for r in runs if "error" not in r]
    report = {"json": str(out), "finished": finished, "tokens_per_s": {label(r): round(r["tokens_per_s"]) for r in ran},
              "warmup_s": {label(r): round(r["warmup_s"], 1) for r in ran},
              "cudagraph_skips": {label(r): r["cudagraph_skips"] for r in ran if "cudagraph_skips" in r}}
    failed = {label(r): r["error"][:300] for r in runs if "error" in r}
    if failed:  # the others' figures are in the JSON and in this message
        raise AssertionError(f"sides failed: {failed}; measured: {report}")
    if skipped := {k: n for k, n in report["cudagraph_skips"].items() if n}:
        raise AssertionError(f"compiled sides ran without their CUDA graphs (their figures are not of graphs; "
                             f"the script's output says why): {skipped}; measured: {report}")
    return report


def check_sampler_benchmark(t: Target) -> dict[str, Any]:
    """``benchmarks/sampler.py`` with ``SAMPLER_BENCH_ARGS``: issue 18's table on this GPU
    (``sampler_gpu.json``, to commit as ``benchmarks/results/sampler_gpu.json``)."""
    return _sampler_script(t, SAMPLER_BENCH_ARGS, "sampler_gpu.json", SAMPLER_BENCH_TIMEOUT_S)


def check_check_every_benchmark(t: Target) -> dict[str, Any]:
    """``benchmarks/sampler.py`` with ``CHECK_EVERY_ARGS``: the host-read interval on this
    GPU (``sampler_check_every_gpu.json``)."""
    return _sampler_script(t, CHECK_EVERY_ARGS, "sampler_check_every_gpu.json", CHECK_EVERY_TIMEOUT_S)


def _logged(log_text: str, prefix: str) -> str | None:
    """The rest of the first log line that holds ``prefix``."""
    return next((line.split(prefix, 1)[1] for line in log_text.splitlines() if prefix in line), None)


CHECK_FUNCTIONS: dict[str, Callable[[Target], dict[str, Any]]] = {
    "environment": check_environment, "generator": check_generator, "static_decoder": check_static_decoder,
    "trainer": check_trainer, "sampler_benchmark": check_sampler_benchmark,
    "check_every_benchmark": check_check_every_benchmark,
    "weight_plane_shared": check_weight_plane_shared, "weight_plane_nccl": check_weight_plane_nccl,
    "fsdp2_step": check_fsdp2_step, "app_run": check_app_run, "gpu_tests": check_gpu_tests}


# --------------------------------------------------------------------------- main


def _tiny_policy(work: Path) -> Path:
    """A policy directory made here in seconds (a few warm-start steps): the checks test
    plumbing and numerics, not learning."""
    from llamarl.app.rl.warmstart import WarmStartConfig, warm_start

    out = work / "policy"
    warm_start(WarmStartConfig(out=str(out), steps=4, batch_size=8, train_size=64, eval_size=2), log=lambda _: None)
    return out


def default_json(dry_run: bool) -> Path:
    name = "gpu_check_cpu_dry_run.json" if dry_run else "gpu_check.json"
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / name


def run_checks(names: list[str], target: Target,
               after_each: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Each check in turn; ``after_each(report so far)`` after each (the report is
    written then: a run its caller kills keeps the checks it finished)."""
    report: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.monotonic()
        try:
            entry = {"status": "ok", **CHECK_FUNCTIONS[name](target)}
        except Skipped as e:
            entry = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        entry["seconds"] = round(time.monotonic() - t0, 1)
        report[name] = entry
        print(f"  {name:<20} {entry['status']:<8} {entry['seconds']:6.1f} s  {_headline(entry)}", flush=True)
        if after_each is not None:
            after_each(report)
    return report


def _headline(entry: dict[str, Any]) -> str:
    if entry["status"] != "ok":
        return (entry.get("reason") or entry.get("error", "")).splitlines()[0][:160]
    keys = ("gpus", "device", "tokens_per_s", "eager_tokens_per_s", "capture_s", "compiled_tokens_per_s", "compile_s",
            "precision", "loss", "loss_fp32", "backend", "staged", "send_s",
            "ranks", "loss_unsharded", "max_weight_diff", "steps", "weight_plane", "pytest")
    return ", ".join(f"{k}={entry[k]}" for k in keys if k in entry)[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same steps on the CPU with gloo (checks the script itself, no GPU needed)")
    parser.add_argument("--skip", nargs="*", default=[], choices=CHECKS, help="checks to leave out")
    parser.add_argument("--only", nargs="*", default=None, choices=CHECKS,
                        help="run these checks only (in CHECKS' order; --skip still applies)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the report (see the docstring)")
    parser.add_argument("--policy", type=Path, default=None,
                        help="a tiny policy directory to check with (default: one made here, a few warm-start steps)")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}): nothing to check. Run it on a GPU machine, or with "
              "--cpu-dry-run to exercise the same steps on the CPU.", file=sys.stderr)
        return 2
    names = [n for n in CHECKS if n not in args.skip and (args.only is None or n in args.only)]
    path = args.json or default_json(args.cpu_dry_run)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    summary: dict[str, Any] = {}

    def write(report: dict[str, dict[str, Any]]) -> None:
        failed = [n for n, e in report.items() if e["status"] == "failed"]
        summary.update(started_at=started, seconds=round(time.time() - started, 1), dry_run=args.cpu_dry_run,
                       ok=not failed, failed=failed, finished=len(report) == len(names), checks=report)
        path.write_text(json.dumps(summary, indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="llamarl-gpu-check-") as tmp:
        work = Path(tmp)
        if args.policy is None:
            print(f"gpu_check ({'CPU dry run' if args.cpu_dry_run else 'CUDA'}): making a tiny policy ...", flush=True)
        target = Target(dry_run=args.cpu_dry_run, gpus=0 if args.cpu_dry_run else torch.cuda.device_count(),
                        policy=args.policy.resolve() if args.policy else _tiny_policy(work), work=work,
                        reports=path.parent)
        report = run_checks(names, target, after_each=write)
    write(report)
    failed = summary["failed"]
    print(f"gpu_check: {len(names) - len(failed)}/{len(names)} checks ok or skipped in {summary['seconds']:.0f} s"
          f"{'; FAILED: ' + ', '.join(failed) if failed else ''}; report {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
