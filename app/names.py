"""Every name two processes must agree on: control-store keys, queue names, metric names.

One module, imported by every executor and by the dashboard, so a key or a metric is
spelled once, and the ports the app derives or a launcher picks. Pure: no torch, no
process groups (the dashboard imports it).

Store keys all live under ``llamarl/``; the weight plane's rendezvous lives in its own
``PrefixStore`` (``WEIGHT_PLANE_PREFIX``) of the same store.
"""

from __future__ import annotations

import os
import random
import socket
import time
import zlib

from llamarl.app.errors import ConfigError

# --------------------------------------------------------------------------- store keys

_ROOT = "llamarl/"

VERSION_KEY = _ROOT + "version"
"""The trainer's policy version (the number of optimizer steps published)."""
STOP_KEY = _ROOT + "stop"
"""Set once, to the reason, when the run must end."""
MEMBERS_KEY = _ROOT + "members"
"""Append-only ``role/replica;`` list of registered members."""
FAILED_KEY = _ROOT + "failed"
"""Append-only ``role/replica;`` list of members that reported a failure."""
CONFIG_KEY = _ROOT + "config"
"""The run's configs (JSON), published by trainer replica 0."""
POLICY_KEY = _ROOT + "policy_path"
"""The policy directory every role loads its architecture and tokenizer from."""
RESERVED_KEY = _ROOT + "groups_reserved"
"""Staleness-slot counter: group slots generators have reserved (``count token``)."""
SLOTS_DONE_KEY = _ROOT + "slots_done"
"""The slot ledger the run starts from (JSON, ``llamarl.app.control.slots.SlotLedger``): empty for
a fresh run; after a resume, generators fill the slots it lacks first."""
RESUME_KEY = _ROOT + "resume"
"""Where trainer replica 0 resumes from (JSON ``{"step", "train_state"}``), for the other
trainer ranks, which load the same training state."""
DATA_KEY = _ROOT + "data"
"""The run's prompts as trainer replica 0 read them (paths, counts, fingerprint; JSON)."""

APP_ID_KEY = _ROOT + "app_id"
"""The TorchX app id of the app whose trainer hosts this store, set before anything else:
every role checks it before registering, so two apps never mix."""

GONE_KEY = _ROOT + "gone_list"
"""Append-only ``role/replica;`` list of executors the controller took out of the run
(``llamarl.app.control.membership``): their silence is a tolerated loss, not a failure."""
STALENESS_BOUND_KEY = _ROOT + "staleness_bound"
"""``--max-staleness auto``: the bound in force (JSON ``{"bound", "version"}``), signed by the
controller, which changes it only between steps (``llamarl.app.rl.staleness``); generators
read it at every reservation (``llamarl.app.control.slots.SlotBudget``)."""
LOST_SLOTS = "lost_slots"
"""Queue of the slot ids (plain decimal) lost with an executor; generators regenerate them first."""


def held_key(member_id: str) -> str:
    """The slots an executor holds now (JSON list: reserved or popped, not yet passed on)."""
    return f"{_ROOT}held/{member_id}"


WEIGHT_PLANE_PREFIX = "weights"
"""The weight plane's process group rendezvouses under this ``PrefixStore`` prefix."""


STORE_PORT_BASE, STORE_PORT_SPAN = 29600, 2000


def store_port(port: int, app_id: str) -> int:
    """The control store's port: ``port`` when set, else (``port == 0``) one derived from
    the app id, so that two apps started with default settings on one machine use
    different ports, and every role of one app computes the same one."""
    if port:
        return port
    if not app_id:
        # Mostly met by a role started by hand, outside the app.
        raise ConfigError("store port 0 (derive it from the app id) needs --app-id: the roles are started "
                          "together by `torchx run` (the llamarl.llamarl component gives them both); "
                          "one process alone: `python -m llamarl.app.roles.local`")
    return STORE_PORT_BASE + zlib.crc32(app_id.encode()) % STORE_PORT_SPAN


RENDEZVOUS_PORT_BASE = STORE_PORT_BASE + STORE_PORT_SPAN
"""Derived rendezvous ports lie above every derived store port: no app's rendezvous
port is another app's store port."""


def rendezvous_port(port: int, app_id: str) -> int:
    """The port of a multi-node trainer's torchrun rendezvous, on trainer replica 0's
    host: the store's port + 1 when ``port`` is set (map both, e.g. on Kubernetes), else
    derived from the app id like the store's, in a range of its own."""
    if port:
        return port + 1
    return RENDEZVOUS_PORT_BASE + store_port(0, app_id) - STORE_PORT_BASE


FREE_PORTS = range(20000, STORE_PORT_BASE)
"""Where a launcher on this machine (the dashboard's screenshot, the benchmarks, the tests)
picks ports to give: below Linux's ephemeral range (32768 and up, where any process's
outgoing connection may take a port at any moment; a multi-node trainer's rendezvous
listens at the store port + 1, which a port the kernel picked for us does not keep free)
and below every port derived from an app id."""


def free_port(span: int = 2) -> int:
    """A port p of ``FREE_PORTS`` with p .. p + span - 1 free now (by default the store's
    and the rendezvous's); random, so that launchers side by side rarely collide."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        port = rng.randrange(FREE_PORTS.start, FREE_PORTS.stop - span)
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("", p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {span} free ports in a row in {FREE_PORTS}")


def member(role: str, replica: int) -> str:
    """``role/replica``, the id of one process of the app in every key below."""
    if "/" in role or ";" in role or not role:
        raise ValueError(f"role names may not be empty or contain '/' or ';': {role!r}")
    return f"{role}/{int(replica)}"


def heartbeat_key(member_id: str) -> str:
    return f"{_ROOT}heartbeat/{member_id}"


def failure_key(member_id: str) -> str:
    return f"{_ROOT}failure/{member_id}"


def gone_key(member_id: str) -> str:
    """The controller's signed record that ``member_id`` was taken out of the run."""
    return f"{_ROOT}gone/{member_id}"


def dropped_key(member_id: str) -> str:
    """Groups trainer rank ``member_id`` dropped (stale or duplicate): their slots may be
    filled again. One signed counter per rank; generators add them up."""
    return f"{_ROOT}groups_dropped/{member_id}"


def exited_key(member_id: str) -> str:
    """Set by a member when it leaves: trainer replica 0 keeps the store up until then."""
    return f"{_ROOT}exited/{member_id}"


def incarnation_key(member_id: str, incarnation: int) -> str:
    """Generator ``member_id``'s signed record that its process ``incarnation`` belongs to
    this run attempt (``llamarl.app.control.incarnations``): the readers take groups from those only."""
    return f"{_ROOT}incarnation/{member_id}/{int(incarnation)}"


def data_checked_key(member_id: str) -> str:
    """Set by a generator once it has read the same prompts as the trainer."""
    return f"{_ROOT}data_checked/{member_id}"


def queue_key(name: str) -> str:
    return f"{_ROOT}queue/{name}"


def weight_layout_key(handshake: int, rank: int) -> str:
    """Inside the weight plane's prefix: each rank's layout document for a handshake."""
    return f"layout/{handshake}/{rank}"


def weight_rank_present_key(rank: int) -> str:
    """Inside the weight plane's prefix: set by each rank as it joins the weight group."""
    return f"present/{rank}"


def weight_epoch_prefix(epoch: int, sender: int = 0) -> str:
    """The weight group of membership epoch ``epoch`` whose sender is trainer rank
    ``sender`` (one group per trainer rank) rendezvouses under this prefix."""
    return f"{WEIGHT_PLANE_PREFIX}/{int(epoch)}/{int(sender)}"


WEIGHT_EPOCH_KEY = "epoch"
"""Inside the weight plane's prefix: the newest membership epoch (its number)."""


def weight_roster_key(epoch: int) -> str:
    """Inside the weight plane's prefix: epoch ``epoch``'s members, JSON
    ``{"generators": [replicas, in rank order], "senders": trainer ranks}``."""
    return f"roster/{int(epoch)}"


def weight_trainer_device_key(rank: int) -> str:
    """Inside the weight plane's prefix: where trainer rank ``rank``'s weights are
    (``devices.device_key``); the trainer ranks join them into one (``devices.joint_key``)."""
    return f"trainer_devices/{int(rank)}"


def weight_attempt_key(attempt: int) -> str:
    """Inside the weight plane's prefix: the epoch trainer rank 0 sends sync attempt
    ``attempt`` (1-based, counting resends) in; the other trainer ranks follow it."""
    return f"attempts/{int(attempt)}"


def weight_attempt_result_key(attempt: int, rank: int) -> str:
    """Inside the weight plane's prefix: trainer rank ``rank``'s outcome of an attempt
    (``ok``, or ``failed: <why>``, or ``layout: <why>``)."""
    return f"attempts/{int(attempt)}/rank/{int(rank)}"


def weight_attempt_verdict_key(attempt: int) -> str:
    """Inside the weight plane's prefix: trainer rank 0's verdict on an attempt for all
    ranks: ``done``, ``retry`` (the next attempt resends, in a new epoch) or ``failed: <why>``."""
    return f"attempts/{int(attempt)}/verdict"


def weight_joins_key(replica: int) -> str:
    """Inside the weight plane's prefix: generator ``replica``'s newest request to join,
    ``"<token> <newest epoch it was in>"``."""
    return f"joins/{int(replica)}"


def weight_digest_key(version: int, rank: int) -> str:
    """Trainer rank ``rank``'s signed digest of its shard of weight version ``version``
    (``llamarl.app.weights.digest``)."""
    return f"{_ROOT}weight_digest/{int(version)}/{int(rank)}"


def weight_sync_announce_key(sync: int) -> str:
    """Inside the weight plane's prefix: set by the sender before sync ``sync`` (1-based)
    starts, so receivers wait on a key rather than inside a collective."""
    return f"syncs/{sync}"


# --------------------------------------------------------------------------- queues

ROLLOUTS = "rollouts"
"""Rollout groups from generators, unscored."""
SCORED = "scored"
"""Rollout groups with a reward executor's results attached."""
METRICS = "metrics"
"""Batches of metric events for trainer replica 0, the metrics database's only writer."""

# --------------------------------------------------------------------------- metrics

# Generators.
GEN_TOKENS_PER_S = "gen/tokens_per_s"
GEN_SEQS_PER_S = "gen/seqs_per_s"
GEN_CPU_S = "gen/cpu_s"
"""CPU seconds a generator's sampling thread spent on its last batch: on a CPU host the
batch's cost with a core to itself; its wall time over this is the share of a core it had
(``llamarl.app.sim.calibrate`` fits the simulator's costs from it)."""
GEN_VERSION = "gen/version"
ENV_PREFIX = "env/"
"""A generator's episode counts (``llamarl.app.envs.episodes.EpisodeStats``): episodes,
turns, tool calls, ``tool_errors/<reason>``, ``episode_end/<reason>``, environment time."""
ENV_EPISODE_TOKENS_PREFIX = ENV_PREFIX + "episode_tokens/"
"""``env/episode_tokens/<b>``: a generator's episodes so far whose tokens after the prompt
(the policy's and the environment's) are at most ``b`` and more than ``b / 2``."""
ENV_EPISODE_VERSIONS_PREFIX = ENV_PREFIX + "episode_versions/"
"""``env/episode_versions/<n>``: a generator's episodes so far whose turns were sampled with
``n`` different weight versions."""
WEIGHTS_QUANTIZE_S = "weights/quantize_s"
"""Seconds a generator spent quantizing one weight version to ``--gen-precision``
(``step`` is the version), recorded with its weight syncs; none at fp32."""

# Trainer: throughput and step time.
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
TRAIN_SAMPLES_PER_S = "train/samples_per_s"
TRAIN_CPU_S = "train/cpu_s"
"""CPU seconds the trainer's main thread spent in the step's training pass (as
``GEN_CPU_S``)."""
TRAIN_STEP_S = "train/step_s"
TRAIN_STEPS_PER_MIN = "train/steps_per_min"
TRAIN_VERSION = "train/version"
TRAIN_SKIPPED_STEPS = "train/skipped_steps"
"""Steps whose batch had no usable reward (every rollout quarantined): no update."""

# Learning (``train_step``'s own names, stored as they come).
LOSS = "loss"
KL = "kl"
RESPONSE_LEN = "response_len"
GRAD_NORM = "grad_norm"
FRAC_SKIPPED = "frac_skipped"
FRAC_ZERO_VAR = "frac_zero_var"
"""Share of the step's groups whose rewards are all equal: zero advantage, nothing learned from them."""
FRAC_NO_ANSWER = "frac_no_answer"
"""Share of the step's completions with no final answer a verifier can read (no ``####``,
no ``\\boxed{}``): a step where it is 1 learns nothing, usually because of the prompt."""
FRAC_CUT_OFF = "frac_cut_off"
"""Share of the step's completions cut off at ``--max-new-tokens`` (no EOS)."""

# AIPO importance ratios.
AIPO_RATIO_MEAN = "aipo/ratio_mean"
AIPO_RATIO_MAX = "aipo/ratio_max"
AIPO_FRAC_TRUNCATED = "aipo/frac_truncated"
AIPO_STATS = {"ratio_mean": AIPO_RATIO_MEAN, "ratio_max": AIPO_RATIO_MAX,
              "frac_truncated": AIPO_FRAC_TRUNCATED}
"""``train_step``'s ratio statistics -> their stored names."""
AIPO_ESS = "aipo/ess"
"""Effective sample size of the step's truncated importance weights min(pi/mu, rho_max),
as a share of its tokens, at the lag where it is lowest (1: on-policy; lower: a few
tokens carry the gradient)."""
AIPO_KL_BEHAVIOUR = "aipo/kl_behaviour"
"""KL(mu || pi) per token (k3) at the lag where it is highest: how far the policy moved
from the one that sampled the step's oldest tokens."""

# Train/inference mismatch (``llamarl.app.rl.mismatch``), split by lag.
MISMATCH_PREFIX = "mismatch/"
MISMATCH_STATS = ("ratio_mean", "ratio_max", "frac_truncated", "kl", "ess")


def mismatch_metric(lag: int, stat: str) -> str:
    """pi/mu statistic ``stat`` (one of ``MISMATCH_STATS``) over the step's tokens from
    rollouts ``lag`` versions behind; at lag 0 only the generator's precision differs."""
    return f"{MISMATCH_PREFIX}lag{int(lag)}/{stat}"


# Staleness.
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
DROPPED_STALE = "dropped_stale"
STALENESS_BOUND = "staleness/bound"
"""The staleness bound in force for the step (fixed, or set by ``--max-staleness auto``)."""
STALENESS_BLOCKED = "staleness/blocked"
"""``--max-staleness auto``: the share of the generators' time since the last step that
they waited on the staleness bound (their ``staleness_bound`` idle intervals)."""

# The run's prompts (trainer replica 0, once, at step 0).
DATA_TRAIN_PROBLEMS = "data/train_problems"
DATA_EVAL_PROBLEMS = "data/eval_problems"
DATA_SKIPPED_BAD_ROWS = "data/skipped_bad_rows"
"""Dataset rows left out under ``--on-bad-row skip`` (no question, no reference...)."""
DATA_SKIPPED_LONG_PROMPTS = "data/skipped_long_prompts"
"""Prompts left out for being longer than ``--max-prompt-tokens`` (never truncated)."""
DATA_SLOT = "data/slot"
"""At each checkpoint: the slot ledger's frontier, the prompt order's position (every
slot below it was trained or dropped)."""

# Checkpoints (trainer replica 0, at each save).
CHECKPOINT_SAVE_S = "checkpoint/save_s"
"""Seconds one checkpoint took to write, rename and prune."""
CHECKPOINT_STEP = "checkpoint/step"
"""The step of the checkpoint just saved."""

# Faults (trainer replica 0, every step).
FAULTS_LOST_GROUPS = "faults/lost_groups"
"""Groups lost with a dead executor and returned for regeneration (cumulative)."""
FAULTS_OVERDUE_GROUPS = "faults/overdue_groups"
"""Groups never delivered within ``--slot-deadline-s`` (a message lost on the way) and
returned for regeneration (cumulative; ``llamarl.app.control.overdue``)."""
FAULTS_DUPLICATE_GROUPS = "faults/duplicate_groups"
"""Groups that arrived for a slot already consumed (a lost executor's group that got out
after all, and its regenerated twin): dropped, never trained twice."""
WEIGHT_REGROUPS = "weights/regroups"
"""Weight groups built after the first: one per change of the generators (cumulative)."""
MEMBERS_PREFIX = "members/"


def members_metric(role: str) -> str:
    """Executors of ``role`` alive now (generators, reward executors)."""
    return MEMBERS_PREFIX + role


# Every executor.
IDLE_FRACTION = "idle_fraction"

# Every executor on a GPU (``llamarl.app.devices.device_metrics``; none on the CPU).
DEVICE_PREFIX = "device/"
DEVICE_UTILIZATION = DEVICE_PREFIX + "utilization"
"""Percent of the last NVML sample period with a kernel running on the role's GPU (the
whole device's: every process on it counts)."""
DEVICE_MAX_MEMORY_GB = DEVICE_PREFIX + "max_memory_gb"
"""Peak GPU memory this process allocated so far, GiB (``torch.cuda.max_memory_allocated``)."""
DEVICE_MEMORY_GB = DEVICE_PREFIX + "memory_gb"
"""GPU memory this process holds allocated now, GiB."""

# Reward executors.
REWARD_SAMPLES_PER_S = "reward/samples_per_s"

EVAL_PREFIX = "eval/"
EVAL_ACCURACY = EVAL_PREFIX + "accuracy"
QUEUE_PREFIX = "queue/"
REWARD_PREFIX = "reward/"
REWARD_TOTAL = REWARD_PREFIX + "total"
QUARANTINED_PREFIX = "quarantined/"
QUARANTINED_TOTAL = QUARANTINED_PREFIX + "total"
SECURITY_PREFIX = "security/"
"""Every counter of something refused for security (the dashboard's Security tab)."""
REJECTED_PREFIX = SECURITY_PREFIX + "rejected_frames/"
"""Messages dropped on receipt, counted by reason (see ``llamarl.app.rl.contract``)."""
# Reasons a signed message is dropped for breaking its format (a rollout group's:
# ``llamarl.app.rl.contract``; a metrics batch's: ``llamarl.app.metrics.events.checked_events``).
MISSING_FIELD, WRONG_TYPE, WRONG_LENGTH, BAD_VALUE = (
    "missing_field", "wrong_type", "wrong_length", "bad_value")


def eval_metric(name: str) -> str:
    return EVAL_PREFIX + name


def queue_metric(queue: str) -> str:
    return QUEUE_PREFIX + queue


def reward_metric(component: str) -> str:
    return REWARD_PREFIX + component


def quarantined_metric(reason: str) -> str:
    return QUARANTINED_PREFIX + reason


def rejected_metric(reason: str) -> str:
    return REJECTED_PREFIX + reason


WEIGHT_DIGEST_PREFIX = SECURITY_PREFIX + "weight_digest/"
"""Weight versions a generator refused, by reason (``llamarl.app.weights.digest``)."""
WEIGHT_DIGEST_S = "weights/digest_s"
"""Seconds a trainer rank spent hashing its shard of one weight version (``replica`` is
the rank; on a thread, while the shard is on the wire)."""
WEIGHT_DIGEST_WAIT_S = "weights/digest_wait_s"
"""Seconds a trainer rank waited for that hash after its send was done: what the digest
added to the sync."""


def weight_digest_metric(reason: str) -> str:
    return WEIGHT_DIGEST_PREFIX + reason


REJECTED_WRITES_PREFIX = "security/rejected_writes/"
"""Control-store writes ignored on reading (not signed with the app's secret, meant for
another key, by a writer that may not write there, or a replay), by key kind
(``llamarl.app.control.signed.key_kind``)."""


def rejected_write_metric(kind: str) -> str:
    return REJECTED_WRITES_PREFIX + kind
