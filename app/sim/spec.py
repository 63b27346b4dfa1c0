"""A cluster on paper: the simulator's loop built from a spec file instead of a run.

What cannot be measured on this machine (a 405B policy on 1024 GPUs) is stated instead:
model size, GPU count and kind, how fast one GPU decodes and trains, how fast a trainer
rank sends its shard, and the run's shape. A spec is a JSON object of ``Spec``'s fields
(``examples/sim/*.json``); ``Spec.loop`` turns it into the ``Loop`` the engine runs::

    python -m llamarl.app.sim --spec examples/sim/llama-70b-async.json
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from llamarl.app.sim.costs import GenCost, Lengths, Loop, RewardCost, SyncCost, TrainCost


@dataclass(kw_only=True)
class Spec:
    """One cluster, one policy, one run shape."""

    name: str = ""
    """A label for the tables."""
    model_params_b: float = 8.0
    """Policy parameters, in billions."""
    gpus: int = 256
    """GPUs in the job."""
    gpu: str = "H100-80GB"
    """GPU kind (a label: the rates below are what it stands for)."""
    colocated: bool = False
    """Generation and training take turns on the same GPUs (a synchronous co-located system):
    every GPU trains, and every GPU decodes in ``gpus_per_generator``-GPU instances."""
    trainer_gpus: int = 128
    """GPUs of the trainer (ignored when colocated: all of them); each sends its own shard."""
    gpus_per_generator: int = 8
    """GPUs of one generator instance (its model-parallel size)."""
    decode_step_s: float = 0.02
    """One decode step of a generator instance, whatever its rows: reading its share of the
    weights once (memory-bound decoding)."""
    gen_tokens_per_s_per_gpu: float = 2000.0
    """Decode throughput per GPU once the batch is large (the per-token compute)."""
    max_rows: int = 0
    """Rows one generator instance holds at once (its KV-cache room); 0: no limit."""
    train_tokens_per_s_per_gpu: float = 1000.0
    """Trained tokens per second per trainer GPU (forward and backward)."""
    train_step_s: float = 0.0
    """Per optimizer step, whatever the tokens."""
    sync_bytes_per_s: float = 1e9
    """What one trainer rank sends per second to the generators (per-byte sync cost)."""
    sync_fixed_s: float = 0.0
    """Per weight sync, whatever its size (co-located: the offload and reshard of a step)."""
    bytes_per_param: float = 2.0
    """Bytes per parameter on the weight plane (bf16: 2)."""
    prompts_per_step: int = 256
    """Prompts per training batch (B)."""
    group_size: int = 4
    """Completions per prompt (G)."""
    gen_batch_prompts: int = 0
    """Prompts a generator instance takes per batch; 0: an equal share of a step's prompts."""
    mean_len: float = 1024.0
    """Mean completion length before the cap, tokens."""
    len_sigma: float = 0.8
    """Log-normal shape of the completion lengths (the long tail)."""
    max_new_tokens: int = 4096
    """The cap on completion length."""
    max_staleness: int = 1
    """The staleness bound (0: synchronous)."""
    reward_executors: int = 0
    """Reward executors (0: scored inline by the trainer's pipeline)."""
    reward_s_per_rollout: float = 0.0
    """Seconds to score one rollout."""
    steps: int = 20
    """Steps to simulate."""
    cores_per_host: int = 0
    """CPU cores that every executor shares, all on one host (``Loop.cores``): a CPU-only
    setup like this repository's tests; 0 on GPU clusters, where each executor has its
    own devices and a phase's cost does not depend on what runs beside it."""
    host_load: float = 0.0
    """Other programs' runnable threads on that host (``Loop.host_load``)."""

    def __post_init__(self) -> None:
        if self.model_params_b <= 0 or self.gpus < 1 or self.gpus_per_generator < 1:
            raise ValueError(f"spec {self.name!r}: model_params_b, gpus and gpus_per_generator must be positive")
        if not self.colocated and not 1 <= self.trainer_gpus < self.gpus:
            raise ValueError(f"spec {self.name!r}: trainer_gpus must leave GPUs for generators "
                             f"({self.trainer_gpus} of {self.gpus})")
        if self.cores_per_host < 0 or self.host_load < 0:
            raise ValueError(f"spec {self.name!r}: cores_per_host and host_load must be >= 0")
        for name in ("decode_step_s", "gen_tokens_per_s_per_gpu", "train_tokens_per_s_per_gpu", "sync_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"spec {self.name!r}: {name} must be > 0")

    @property
    def generators(self) -> int:
        spare = self.gpus if self.colocated else self.gpus - self.trainer_gpus
        if spare < self.gpus_per_generator:
            raise ValueError(f"spec {self.name!r}: {spare} GPUs cannot hold a {self.gpus_per_generator}-GPU generator")
        return spare // self.gpus_per_generator

    @property
    def senders(self) -> int:
        return self.gpus if self.colocated else self.trainer_gpus

    def loop(self) -> Loop:
        per_gen = self.gen_batch_prompts or max(1, math.ceil(self.prompts_per_step / self.generators))
        return Loop(
            steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.group_size,
            max_staleness=self.max_staleness, generators=self.generators, gen_batch_prompts=per_gen,
            reward_executors=self.reward_executors, trainer_ranks=self.senders,
            cores=self.cores_per_host, host_load=self.host_load,
            lengths=Lengths(mean=self.mean_len, sigma=self.len_sigma, cap=self.max_new_tokens),
            gen=GenCost(step_s=self.decode_step_s,
                        token_s=1.0 / (self.gen_tokens_per_s_per_gpu * self.gpus_per_generator),
                        max_rows=self.max_rows),
            reward=RewardCost(rollout_s=self.reward_s_per_rollout),
            train=TrainCost(step_s=self.train_step_s,
                            token_s=1.0 / (self.train_tokens_per_s_per_gpu * self.senders)),
            sync=SyncCost(fixed_s=self.sync_fixed_s, byte_s=1.0 / self.sync_bytes_per_s,
                          bytes=self.model_params_b * 1e9 * self.bytes_per_param))


def load(path: str | Path) -> Spec:
    """The spec in the JSON file ``path``; an unknown key is an error that names it."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a spec is a JSON object of Spec's fields")
    known = {f.name for f in fields(Spec)}
    unknown = sorted(set(raw) - known - {"comment"})
    if unknown:
        raise ValueError(f"{path}: unknown spec field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return Spec(**{k: v for k, v in raw.items() if k != "comment"})
