"""The cost models the simulator runs on and the loop they make, one dataclass each.

Each model says how long one piece of llamarl's loop takes as a function of what it works
on; ``llamarl.app.sim.calibrate`` fits them from a run's metrics database or builds them
from a spec file, ``llamarl.app.sim.engine`` replays the loop with them. Pure Python (no
torch): the dashboard imports this package.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field


def _check(name: str, value: float, *, low: float = 0.0) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")


def cpu_share(cores: int, load: float, running: float) -> float:
    """The share of a core each of ``running`` phases of one thread gets on ``cores`` cores
    that ``load`` other threads use too (1 with ``cores`` 0: a device each)."""
    return 1.0 if not cores or running + load <= cores else cores / (running + load)


@dataclass(kw_only=True)
class Lengths:
    """Completion lengths in tokens: log-normal with mean ``mean`` before the cap and shape
    ``sigma`` (the long tail), cut at ``cap`` (``max_new_tokens``)."""

    mean: float
    """Mean length of the uncapped distribution, in tokens."""
    sigma: float = 0.5
    """Log-normal shape: 0 makes every completion ``mean`` long; 1 is a long tail."""
    cap: int = 48
    """The most tokens a completion may have (``--max-new-tokens``)."""

    def __post_init__(self) -> None:
        _check("Lengths.mean", self.mean, low=1.0)
        _check("Lengths.sigma", self.sigma)
        _check("Lengths.cap", self.cap, low=1)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return [max(1, min(self.cap, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]

    def capped_mean(self, draws: int = 4000) -> float:
        """The mean length after the cap, by sampling (what a run's ``response_len`` shows)."""
        rng = random.Random(1)
        return sum(self.sample(rng, draws)) / draws

    @classmethod
    def with_capped_mean(cls, target: float, *, sigma: float, cap: int) -> "Lengths":
        """The distribution whose capped mean is ``target`` (bisection on the uncapped mean)."""
        target = min(max(target, 1.0), cap)
        lo, hi = 1.0, 50.0 * cap
        for _ in range(40):
            mid = (lo + hi) / 2
            if cls(mean=mid, sigma=sigma, cap=cap).capped_mean() < target:
                lo = mid
            else:
                hi = mid
        return cls(mean=(lo + hi) / 2, sigma=sigma, cap=cap)


@dataclass(kw_only=True)
class CostModel:
    """What the four cost models below share: each field is a finite number >= 0 (a cost in
    seconds or bytes, a slope, a count of rows), checked here once for all of them."""

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            _check(f"{type(self).__name__}.{k}", v)


@dataclass(kw_only=True)
class GenCost(CostModel):
    """One generator instance's batch: ``batch_s + row_s * rows + step_s * longest +
    token_s * tokens``. Rows that finish leave the batch (llamarl's sampler compacts it),
    so the per-step cost is paid as long as the longest row runs and the per-token cost
    once per token. A batch
    of more rows than fit at once (``max_rows``, the KV-cache room) runs in waves, each
    paying its own longest row: the long tail is paid once per wave."""

    batch_s: float = 0.0
    """Per batch: prefill, setup, sampling bookkeeping."""
    row_s: float = 0.0
    """Per row, whatever its length (its prompt's prefill, its sampling bookkeeping)."""
    step_s: float = 0.0
    """Per decode step, whatever the rows (launch overhead, reading the weights)."""
    token_s: float = 0.0
    """Per generated token (the compute of one row in one step)."""
    overhead_s: float = 0.0
    """Per batch outside the timed ``generate`` interval: swap, reserve, queue push, metrics."""
    max_rows: int = 0
    """Rows decoded at once at most (0: no limit)."""

    def seconds(self, lengths: list[int]) -> float:
        wave = self.max_rows or max(1, len(lengths))
        longest = sum(max(lengths[i:i + wave]) for i in range(0, len(lengths), wave))
        return self.batch_s + self.row_s * len(lengths) + self.step_s * longest + self.token_s * sum(lengths)


@dataclass(kw_only=True)
class RewardCost(CostModel):
    """One scoring call of a reward executor (or of the trainer's inline scorer)."""

    batch_s: float = 0.0
    """Per call."""
    rollout_s: float = 0.0
    """Per rollout scored."""
    wait_s: float = 0.0
    """Per rollout, waiting rather than computing (a remote judge's latency): on a shared
    CPU host it takes no core and no other phase slows it."""

    def seconds(self, rollouts: int) -> float:
        """The computing part of a call of ``rollouts``; ``wait_s`` comes on top."""
        return self.batch_s + self.rollout_s * rollouts


@dataclass(kw_only=True)
class TrainCost(CostModel):
    """One optimizer step of the trainer (all its ranks together): ``step_s + token_s *
    tokens``, plus the per-step work outside the timed intervals."""

    step_s: float = 0.0
    """Per step, whatever the tokens."""
    token_s: float = 0.0
    """Per trained token (prompt excluded)."""
    overhead_s: float = 0.0
    """Per step outside train and sync: recording the step, draining metrics, health."""
    eval_s: float = 0.0
    """One held-out evaluation (every ``eval_every`` steps and at the last)."""

    def seconds(self, tokens: int) -> float:
        return self.step_s + self.token_s * tokens


@dataclass(kw_only=True)
class SyncCost(CostModel):
    """One weight sync, trainer side (it waits for it): ``fixed_s + bytes / senders *
    byte_s * (1 + receiver_slope * (receivers - 1))``: every trainer rank sends its own
    shard at once, and a broadcast to more receivers costs more per byte."""

    fixed_s: float = 0.0
    """Per sync: headers, digest, the slowest receiver's handshake."""
    byte_s: float = 0.0
    """Seconds per byte one sender sends to one receiver."""
    bytes: float = 0.0
    """The policy's size in bytes on the wire."""
    receiver_slope: float = 0.0
    """Extra cost per byte for each receiver past the first (0: a perfect broadcast)."""

    def seconds(self, *, senders: int, receivers: int) -> float:
        spread = 1.0 + self.receiver_slope * max(0, receivers - 1)
        return self.fixed_s + self.bytes / max(1, senders) * self.byte_s * spread


@dataclass(kw_only=True)
class Loop:
    """One configuration of llamarl's loop with its cost models: what the simulator runs."""

    steps: int = 30
    """RL steps to simulate."""
    prompts_per_step: int = 16
    """Groups in a training batch (B)."""
    group_size: int = 8
    """Completions per prompt (G)."""
    max_staleness: int = 1
    """The bound (K); 0 is the synchronous baseline."""
    generators: int = 1
    """Generator instances."""
    gen_batch_prompts: int = 8
    """Prompts a generator reserves and samples per batch."""
    reward_executors: int = 0
    """Reward executors; 0 scores inline in the trainer's pipeline thread."""
    trainer_ranks: int = 1
    """Trainer ranks: each sends its own shard (the sync's senders)."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: none); the last step evaluates too."""
    cores: int = 0
    """CPU cores the executors share, one host (0: each has its own device, as on a GPU
    cluster, and a phase takes its cost whatever runs beside it). With cores, the
    generators' batches, the reward executors' and the trainer's passes are CPU work: the
    ones running at once share the cores, each at most one (a thread per process), so a
    cost is its time with a core to itself."""
    host_load: float = 0.0
    """Runnable threads of other programs on those cores, on average: they take their
    share too (what a shared machine's load adds)."""
    lengths: Lengths = field(default_factory=lambda: Lengths(mean=24.0))
    gen: GenCost = field(default_factory=GenCost)
    reward: RewardCost = field(default_factory=RewardCost)
    train: TrainCost = field(default_factory=TrainCost)
    sync: SyncCost = field(default_factory=SyncCost)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "generators", "gen_batch_prompts", "trainer_ranks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Loop.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("max_staleness", "reward_executors", "eval_every", "cores"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"Loop.{name} must be an int >= 0, got {getattr(self, name)!r}")
        _check("Loop.host_load", self.host_load)

    def cpu_share(self, running: int) -> float:
        """The share of a core each of ``running`` CPU phases gets (1 without ``cores``)."""
        return cpu_share(self.cores, self.host_load, running)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Loop":
        parts = {"lengths": Lengths, "gen": GenCost, "reward": RewardCost, "train": TrainCost, "sync": SyncCost}
        return cls(**{k: parts[k](**v) if k in parts else v for k, v in d.items()})
