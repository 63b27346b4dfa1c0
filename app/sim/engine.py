"""A discrete-event replay of llamarl's loop: generators, reward executors, the trainer and
the weight sync, with the staleness bound and the slot budget as the app applies them.

The rules are the app's (``llamarl.app.control.slots``, ``llamarl.app.roles.generator``,
``llamarl.app.roles.trainer``, ``llamarl.pipelines.rollouts``):

- a generator with weights of version ``v`` reserves up to ``gen_batch_prompts`` slots
  from one counter shared by all generators, never past ``(v + 1 + K) * B + dropped``
  (``SlotBudget.reserve``); at the bound it waits for newer weights (a place a dropped
  group gave back is seen with the next weights, as in the app); it swaps in the newest
  weights it has received between batches, never during one;
- a reward executor takes up to 16 groups at once from the rollouts queue, scores them and
  passes them on; with none, the trainer's pipeline thread scores inline, beside training;
- the trainer takes groups in arrival order; a group whose lag (trainer version minus its
  version) exceeds K is dropped and its place given back; B groups make a batch; it
  trains, the version goes up, every trainer rank sends its shard to every generator (the
  trainer waits for the send), the controller's per-step work runs, and the held-out
  evaluation when it is due;
- with ``cores`` (one shared CPU host), every phase (generation, scoring, training,
  evaluation, the weight sync and each executor's untimed work between its phases) is
  CPU work: the phases running at once (and ``host_load`` other threads) share the cores,
  each at most one; a phase's cost is its time with a core to itself, and its wall time
  stretches while the cores are oversubscribed;
- a step's time is the time between the ends of two training passes (``train/step_s``),
  and idle fractions count the timed intervals after the first training pass began, as the
  app's timeline records them (``idle / (idle + busy)``).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from llamarl.app.sim.costs import Loop

REWARD_BATCH_GROUPS = 16
"""Groups a reward executor scores per call at most (``llamarl.app.roles.reward``)."""


@dataclass
class Group:
    version: int
    tokens: int
    rollouts: int


@dataclass
class Interval:
    role: str
    replica: int
    kind: str  # "busy" or "idle"
    what: str
    t0: float
    t1: float


@dataclass
class Report:
    """What a simulation (or a measured run, ``calibrate.measured``) comes to."""

    step_s: list[float]
    """Each step's time, step 1 first."""
    idle: dict[str, float]
    """Idle fraction per role (``generator``, ``reward``, ``trainer``), replicas together."""
    idle_per_executor: dict[str, float] = field(default_factory=dict)
    """Idle fraction per ``role/replica``."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Trained groups by their lag."""
    dropped: int = 0
    """Groups dropped as too stale."""
    samples_per_s: float = 0.0
    """Trained rollouts per second over the steps after the first."""
    tokens_per_s: float = 0.0
    """Trained completion tokens per second over the steps after the first."""

    @property
    def median_step_s(self) -> float:
        """The median step time, the first step (start-up) left out when there are more."""
        return statistics.median(self.step_s[1:] or self.step_s)

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    def to_dict(self) -> dict:
        return {"median_step_s": self.median_step_s, "step_s": self.step_s, "idle": self.idle,
                "idle_per_executor": self.idle_per_executor,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                "mean_staleness": self.mean_staleness, "dropped_stale": self.dropped,
                "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s}


class _Sim:
    def __init__(self, loop: Loop, seed: int) -> None:
        self.loop, self.rng = loop, random.Random(seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.intervals: list[Interval] = []
        # the slot budget
        self.reserved = 0
        self.dropped = 0
        # generators: the weights each has received, the version it samples with
        self.received: list[int | None] = [None] * loop.generators
        self.gen_version: list[int | None] = [None] * loop.generators
        self.at_bound: dict[int, float] = {}  # generator -> since when it waits for weights
        # queues
        self.rollouts: deque[Group] = deque()
        self.scored: deque[Group] = deque()
        scorers = loop.reward_executors or 1  # 0: the trainer's inline scoring thread
        self.scorer_idle_since: dict[int, float] = {j: 0.0 for j in range(scorers)}
        # trainer
        self.version = 0
        self.batch: list[Group] = []
        self.trainer_waiting_since: float | None = None
        self.train_ends: list[float] = []
        self.first_train = None
        self.staleness: Counter[int] = Counter()
        self.trained_tokens: list[int] = []
        self.trained_rollouts: list[int] = []
        self.done = False
        # the shared CPU (``Loop.cores``): job id -> [work left, on_done, role, replica, what, t0]
        self.cpu_jobs: dict[int, list] = {}
        self.cpu_since = 0.0  # when the work left was last brought up to date
        self.cpu_epoch = 0  # a scheduled completion of an older epoch is stale

    # --- the event queue -------------------------------------------------------------------
    def after(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn))

    def record(self, role: str, replica: int, kind: str, what: str, t0: float, t1: float) -> None:
        self.intervals.append(Interval(role, replica, kind, what, t0, t1))

    def work(self, seconds: float, on_done: Callable[[], None], role: str, replica: int, what: str,
             record: bool = True) -> None:
        """A busy phase of ``seconds`` of work (with a core to itself), then ``on_done``;
        recorded as a busy interval unless ``record`` is False (inline scoring, untimed)."""
        if not self.loop.cores:
            if record:
                self.record(role, replica, "busy", what, self.now, self.now + seconds)
            self.after(seconds, on_done)
            return
        self._cpu_advance()
        self.cpu_jobs[next(self._seq)] = [seconds, on_done, role if record else "", replica, what, self.now]
        self._cpu_schedule()

    def _cpu_advance(self) -> None:
        share = self.loop.cpu_share(len(self.cpu_jobs))
        for job in self.cpu_jobs.values():
            job[0] -= share * (self.now - self.cpu_since)
        self.cpu_since = self.now

    def _cpu_schedule(self) -> None:
        self.cpu_epoch += 1
        if self.cpu_jobs:
            epoch, share = self.cpu_epoch, self.loop.cpu_share(len(self.cpu_jobs))
            first = min(job[0] for job in self.cpu_jobs.values())
            self.after(max(0.0, first) / share, lambda: self._cpu_tick(epoch))

    def _cpu_tick(self, epoch: int) -> None:
        if epoch != self.cpu_epoch:
            return
        self._cpu_advance()
        done = [k for k, job in self.cpu_jobs.items() if job[0] <= 1e-12]
        finished = [self.cpu_jobs.pop(k) for k in done]
        self._cpu_schedule()
        for _, on_done, role, replica, what, t0 in finished:
            if role:
                self.record(role, replica, "busy", what, t0, self.now)
            on_done()

    def run(self) -> None:
        self.at_bound = {i: 0.0 for i in range(self.loop.generators)}  # waiting for their first weights
        self.publish(first=True)
        while self._heap and not self.done:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()

    # --- generators ------------------------------------------------------------------------
    def weights_arrive(self, version: int) -> None:
        for i in range(self.loop.generators):
            self.received[i] = version
            if i in self.at_bound:
                since = self.at_bound.pop(i)
                self.record("generator", i, "idle", "wait_weights" if self.gen_version[i] is None
                            else "staleness_bound", since, self.now)
                self.generator_ready(i)

    def generator_ready(self, i: int) -> None:
        loop = self.loop
        self.gen_version[i] = self.received[i]
        v = self.gen_version[i]
        if v is None:
            self.at_bound[i] = self.now
            return
        cap = (v + 1 + loop.max_staleness) * loop.prompts_per_step + self.dropped
        take = min(loop.gen_batch_prompts, cap - self.reserved)
        if take <= 0:
            self.at_bound[i] = self.now
            return
        self.reserved += take
        lengths = [loop.lengths.sample(self.rng, loop.group_size) for _ in range(take)]
        dt = loop.gen.seconds([n for g in lengths for n in g])

        def done() -> None:
            for g in lengths:
                self.rollouts.append(Group(v, sum(g), len(g)))
            self.after(0.0, self.wake_scorers)
            self.work(loop.gen.overhead_s, lambda: self.generator_ready(i), "generator", i, "overhead", record=False)
        self.work(dt, done, "generator", i, "generate")

    # --- scoring: reward executors, or the trainer's pipeline thread ------------------------
    def wake_scorers(self) -> None:
        for j in sorted(self.scorer_idle_since):
            if not self.rollouts:
                return
            since = self.scorer_idle_since.pop(j)
            if self.loop.reward_executors:
                self.record("reward", j, "idle", "wait_rollouts", since, self.now)
            self.score(j)

    def score(self, j: int) -> None:
        take = [self.rollouts.popleft() for _ in range(min(REWARD_BATCH_GROUPS, len(self.rollouts)))]
        dt = self.loop.reward.seconds(sum(g.rollouts for g in take))

        def done() -> None:
            self.scored.extend(take)
            self.after(0.0, self.trainer_take)
            if self.rollouts:
                self.score(j)
            else:
                self.scorer_idle_since[j] = self.now
        waited, t0 = self.loop.reward.wait_s * sum(g.rollouts for g in take), self.now

        def scored() -> None:  # the call's wait (no core) after its computing, one busy interval
            if self.loop.reward_executors:
                self.record("reward", j, "busy", "score", t0, self.now)
            done()
        self.work(dt, lambda: self.after(waited, scored), "reward", j, "score", record=False)

    # --- the trainer -----------------------------------------------------------------------
    def trainer_take(self) -> None:
        if self.trainer_waiting_since is None:
            return  # training or syncing: it takes groups when it asks for its next batch
        loop = self.loop
        while self.scored and len(self.batch) < loop.prompts_per_step:
            g = self.scored.popleft()
            lag = self.version - g.version
            if lag > loop.max_staleness:
                self.dropped += 1  # its place is given back at once (Settlement.on_drop)
                continue
            self.batch.append(g)
        if len(self.batch) < loop.prompts_per_step:
            return
        self.record("trainer", 0, "idle", "wait_rollouts", self.trainer_waiting_since, self.now)
        self.trainer_waiting_since = None
        batch, self.batch = self.batch, []
        for g in batch:
            self.staleness[self.version - g.version] += 1
        tokens = sum(g.tokens for g in batch)
        self.trained_tokens.append(tokens)
        self.trained_rollouts.append(sum(g.rollouts for g in batch))
        dt = loop.train.seconds(tokens)
        if self.first_train is None:
            self.first_train = self.now
        self.work(dt, self.trained, "trainer", 0, "train")

    def trained(self) -> None:
        self.train_ends.append(self.now)
        self.version += 1
        self.publish()

    def publish(self, first: bool = False) -> None:
        loop = self.loop
        dt = loop.sync.seconds(senders=loop.trainer_ranks, receivers=loop.generators)
        version = self.version

        def sent() -> None:
            self.weights_arrive(version)
            if first:
                self.ask_for_batch()
            else:
                self.after_step()
        self.work(dt, sent, "trainer", 0, "weight_sync")

    def after_step(self) -> None:
        loop, step = self.loop, len(self.train_ends)
        if step >= loop.steps:
            self.done = True
            return
        if loop.eval_every and step % loop.eval_every == 0:
            self.work(loop.train.eval_s, self._overhead, "trainer", 0, "eval")
        else:
            self._overhead()

    def _overhead(self) -> None:
        self.work(self.loop.train.overhead_s, self.ask_for_batch, "trainer", 0, "overhead", record=False)

    def ask_for_batch(self) -> None:
        self.trainer_waiting_since = self.now
        self.trainer_take()

    # --- the report ------------------------------------------------------------------------
    def report(self) -> Report:
        ends = self.train_ends
        start = self.first_train or 0.0
        steps = [ends[0] - start] + [b - a for a, b in zip(ends, ends[1:])] if ends else []
        idle: dict[str, list[float]] = {}
        per: dict[str, list[float]] = {}
        for iv in self.intervals:
            if iv.t0 < start or iv.t1 <= iv.t0:
                continue
            for key, table in ((iv.role, idle), (f"{iv.role}/{iv.replica}", per)):
                acc = table.setdefault(key, [0.0, 0.0])
                acc[iv.kind == "idle"] += iv.t1 - iv.t0
        frac = {k: i / (b + i) if b + i > 0 else 0.0 for k, (b, i) in idle.items()}
        span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
        return Report(step_s=steps, idle=frac,
                      idle_per_executor={k: i / (b + i) if b + i > 0 else 0.0 for k, (b, i) in per.items()},
                      staleness=dict(self.staleness), dropped=self.dropped,
                      samples_per_s=sum(self.trained_rollouts[1:]) / span if span else 0.0,
                      tokens_per_s=sum(self.trained_tokens[1:]) / span if span else 0.0)


def simulate(loop: Loop, *, seed: int = 0) -> Report:
    """Replays ``loop`` for ``loop.steps`` steps (or until it can go no further)."""
    sim = _Sim(loop, seed)
    sim.run()
    return sim.report()


def what_if(loop: Loop, *, seed: int = 0) -> list[tuple[str, Report]]:
    """``loop`` and its neighbours: one more generator, and staleness bounds 0 to 3 (what the
    CLI prints and the dashboard's "What if" tab shows beside the measured run)."""
    cases = [("as run", loop), (f"{loop.generators + 1} generators", replace(loop, generators=loop.generators + 1))]
    cases += [(f"max_staleness {k}", replace(loop, max_staleness=k)) for k in range(4) if k != loop.max_staleness]
    return [(label, simulate(case, seed=seed)) for label, case in cases]
