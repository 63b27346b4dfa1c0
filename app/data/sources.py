"""Where a run's prompts and policy come from: the built-in task or a dataset file, the
prompt format, the order prompts are used in, and the check that every role reads the
same ones.

    sources = read(cfg)                          # files read and validated (DataError)
    data = prepare(sources, cfg, tokenizer)      # prompts formatted, too long ones left out
    data.order.problem(slot), data.held_out, data.format_prompt(question)

Every role calls these with the trainer's published config, so every role reads the same
problems in the same order; trainer replica 0 publishes a fingerprint of what it read
(``publish``) and each generator compares its own (``check_published``) before it
samples, so a role that sees another file at the same path fails at start-up, naming
both.

Decisions:

- Order: slot n (0-based; the generators' staleness slots) is problem ``order.index(n)``.
  A dataset is used epoch after epoch, each epoch a permutation seeded by the run's seed
  and the epoch number, made when first needed (so ``--steps 100000`` precomputes
  nothing). The built-in task is a lazy stream, unshuffled: slot n is problem n,
  made from the seed and n alone when a generator asks for it (``tasks.TrainProblems``),
  so a run of any ``--steps`` starts at once. ``ProblemOrder.state_dict`` is the
  position a resumed run restores.
- Held-out problems: ``--eval-dataset``, or the rows of ``--dataset`` whose prompt hashes
  below ``--eval-fraction`` (a duplicated prompt lands on one side only). Of those, the
  ``--eval-size`` first in hash order are evaluated: the same problems whatever the seed,
  so runs with different seeds are compared on the same questions.
- Prompts: ``--prompt-template`` with ``{question}`` replaced (plain replacement, so the
  template may hold other braces, e.g. ``\\boxed{}``), or the tokenizer's chat template
  (``--chat-template``, an optional system message). A prompt longer than
  ``--max-prompt-tokens`` is left out, counted and logged, never truncated: a truncated
  question has another answer.
- Fingerprint: SHA-256 of every kept prompt (of the built-in stream: its seed, its
  levels and its first ``BUILTIN_MEASURED`` prompts) as the policy will see it, its reference and
  answer format, training then held-out, in file order. It covers what the generators
  must agree on (the rows, the field mapping, the template, the tokenizer's length
  filter), not incidental bytes (compression, column order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from llamarl.app import names
from llamarl.app.control import runtime
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.control import transport
from llamarl.app.config import GeneratorConfig, TrainerConfig, parse_levels
from llamarl.app.data.datafile import FieldMap, read_problems
from llamarl.app import errors
from llamarl.app.errors import DataError
from llamarl.app.model import gguf_policy, hub
from llamarl.app.model.policy import check_causal_lm, context_length, encode_prompts
from llamarl.app.tasks import samples
from llamarl.app.tasks.arithmetic import Problem
from llamarl.app.rl.warmstart import ensure_warmstart
from llamarl.app.envs.spec import build_env
from llamarl.app.envs.tool_warmstart import ensure_tool_warmstart, has_calculator

BUILTIN = "the built-in task"
TOKENIZE_CHUNK = 1024  # prompts tokenized at once when measuring lengths


TINY = ("tiny", "warmstart")
"""``--policy`` names of the embedded 0.9M policy (``warmstart``: its name before the
default job trained a pretrained model; configs saved then still say it)."""


def resolve_policy(spec: str, *, env: str = "", log: Callable[[str], None] = print) -> Path:
    """``tiny`` (the embedded policy, warm-started once and cached; for an ``env`` with the
    calculator tool, its tool warm start: ``llamarl.app.envs.tool_warmstart``), a GGUF file
    (``gguf:<path>`` or a named one such as ``smollm2-135m-instruct``, converted once into
    ``checkpoints/<name>/``), a directory, or a model hub id (its cached snapshot)."""
    if spec in TINY:
        if env and has_calculator(build_env(env)):
            return ensure_tool_warmstart(log=log)
        return ensure_warmstart(log=log)
    if gguf_policy.is_gguf_policy(spec):
        return gguf_policy.ensure_converted(spec, log=log)
    if hub.is_hub_id(spec):
        return hub.download(spec, log=log)
    check_causal_lm(spec)
    return Path(spec)


def fit_prompt_budget(cfg: TrainerConfig, gen: GeneratorConfig, policy: str | Path, *,
                      log: Callable[[str], None] = print) -> TrainerConfig:
    """``cfg`` with ``--max-prompt-tokens`` capped by the policy's context less
    ``--max-new-tokens``: a prompt that fits the flag but not the model would be trained on
    past the positions the model knows. Said once when it caps; the prompts left out are
    counted by ``prepare`` like any too long. Trainer replica 0 publishes the capped config,
    so every role measures prompts against the same limit."""
    context = context_length(policy)
    if context is None:
        return cfg
    room = context - gen.max_new_tokens
    if room < 1:
        raise errors.ConfigError(f"--max-new-tokens {gen.max_new_tokens} leaves no room for a prompt in the "
                                 f"policy's context of {context} tokens ({policy})")
    if cfg.max_prompt_tokens <= room:
        return cfg
    log(f"--max-prompt-tokens {cfg.max_prompt_tokens} capped to {room}: the policy's context is {context} "
        f"tokens, less --max-new-tokens {gen.max_new_tokens}; longer prompts are skipped and counted")
    return dataclasses.replace(cfg, max_prompt_tokens=room)


def absolute_paths(cfg: TrainerConfig) -> TrainerConfig:
    """``cfg`` with its dataset paths absolute: what trainer replica 0 publishes, so that
    a role started in another directory reads the same file."""
    def absolute(p: str) -> str:
        # A named dataset stays a name: every role finds it in its own installation.
        return str(Path(p).resolve()) if p and p not in samples.NAMED else p
    return dataclasses.replace(cfg, dataset=absolute(cfg.dataset), eval_dataset=absolute(cfg.eval_dataset))


# --------------------------------------------------------------------------- reading

@dataclass
class Sources:
    """The run's problems as read, before prompts are formatted and measured."""

    train: Sequence[Problem]
    """A dataset's rows, or the built-in task's lazy stream (``tasks.TrainProblems``)."""
    held_out: list[Problem]
    train_from: str
    eval_from: str
    skipped_rows: int = 0


def held_out(question: str, fraction: float) -> bool:
    """Whether ``question`` belongs to the held-out ``fraction`` (a stable hash)."""
    return _unit_hash(question) < fraction


def _unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2 ** 64


BUILTIN_MEASURED = 1024
"""How many of the built-in task's training prompts are formatted, measured and
fingerprinted at start-up (the first ones): the stream is lazy (``tasks.TrainProblems``),
so ``--steps`` in the billions costs nothing up front. Its stories are of a few fixed
shapes, so the first thousand show the longest a prompt gets."""


def named_dataset(cfg: TrainerConfig) -> TrainerConfig:
    """``cfg`` with a named ``--dataset`` (``app/tasks/samples.py``) replaced by its files:
    its training file, and its held-out file as ``--eval-dataset`` unless the run chose
    its own held-out problems."""
    sample = samples.NAMED.get(cfg.dataset)
    if sample is None:
        return cfg
    own_eval = cfg.eval_dataset or cfg.eval_fraction > 0
    return dataclasses.replace(cfg, dataset=str(sample.train),
                               eval_dataset=cfg.eval_dataset if own_eval else str(sample.held_out))


def read(cfg: TrainerConfig, *, log: Callable[[str], None] = print) -> Sources:
    """The run's training and held-out problems; ``DataError`` names a bad file or row."""
    cfg = named_dataset(cfg)
    if not cfg.dataset:
        levels = parse_levels(cfg.levels)
        return Sources(
            train=tasks.TrainProblems(size=cfg.steps * cfg.prompts_per_step, seed=cfg.seed + 1,
                                      levels=tuple(levels)),
            held_out=tasks.make_split("eval", cfg.eval_size, seed=cfg.seed, levels=levels),
            train_from=BUILTIN, eval_from=f"{BUILTIN} (its eval split)")
    fields = FieldMap(cfg.prompt_field, cfg.answer_field, cfg.answer_format)
    t0 = time.time()
    train = read_problems(cfg.dataset, fields, on_bad_row=cfg.on_bad_row)
    skipped = list(train.skipped)
    problems, held, eval_from = train.problems, [], "none"
    if cfg.eval_dataset:
        evals = read_problems(cfg.eval_dataset, fields, on_bad_row=cfg.on_bad_row)
        skipped += evals.skipped
        held, eval_from = evals.problems, cfg.eval_dataset
    elif cfg.eval_fraction > 0:
        held = [p for p in problems if held_out(p.question, cfg.eval_fraction)]
        problems = [p for p in problems if not held_out(p.question, cfg.eval_fraction)]
        eval_from = f"{cfg.eval_fraction:g} of {cfg.dataset} (by a hash of the prompt)"
        if not held or not problems:
            raise DataError(f"{cfg.dataset}: --eval-fraction {cfg.eval_fraction:g} leaves "
                            f"{len(problems)} training and {len(held)} held-out problems of "
                            f"{len(train.problems)}; both must be non-empty")
    else:
        log("no held-out evaluation: give --eval-dataset or --eval-fraction to have one")
    if skipped:
        log(f"skipped {len(skipped)} bad rows (--on-bad-row skip): " + "; ".join(skipped[:3])
            + (" ..." if len(skipped) > 3 else ""))
    log(f"read {len(train.problems)} problems from {cfg.dataset}"
        f"{f' and {len(held)} from {cfg.eval_dataset}' if cfg.eval_dataset else ''} in {time.time() - t0:.1f} s")
    held = sorted(held, key=lambda p: _unit_hash(p.question))[: cfg.eval_size]
    return Sources(train=problems, held_out=held, train_from=cfg.dataset, eval_from=eval_from,
                   skipped_rows=len(skipped))


# --------------------------------------------------------------------------- prompts

@dataclass(frozen=True)
class PromptFormat:
    """How a question becomes the policy's prompt."""

    template: str = tasks.PROMPT_TEMPLATE
    chat: bool = False
    system_prompt: str = ""

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> "PromptFormat":
        return cls(template=cfg.prompt_template, chat=cfg.chat_template, system_prompt=cfg.system_prompt)

    def bind(self, tokenizer: Any) -> Callable[[str], str]:
        """question -> prompt text for ``tokenizer``'s policy."""
        if not self.chat:
            template = self.template
            return lambda question: template.replace("{question}", question)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat-template: the policy's tokenizer has no chat template; use "
                             "--prompt-template for a base model")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

        def render(question: str) -> str:
            return tokenizer.apply_chat_template(system + [{"role": "user", "content": question}],
                                                 tokenize=False, add_generation_prompt=True)
        return render


# --------------------------------------------------------------------------- order

class ProblemOrder:
    """Slot n (0-based) -> a training problem: epoch ``n // len``, position ``n % len``
    of that epoch's permutation (seeded by ``seed`` and the epoch; the identity when
    ``shuffle`` is off). ``take`` hands out slots from ``position`` on."""

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool) -> None:
        if not problems:
            raise ValueError("ProblemOrder needs at least one problem")
        self.problems, self.seed, self.shuffle = problems, seed, shuffle
        self.position = 0
        self._perms: OrderedDict[int, array] = OrderedDict()  # the last two epochs used

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def epoch(self) -> int:
        """The epoch of the next slot ``take`` hands out."""
        return self.position // len(self.problems)

    def index(self, slot: int) -> int:
        if slot < 0:
            raise ValueError(f"slots are >= 0, got {slot}")
        epoch, i = divmod(slot, len(self.problems))
        return self._permutation(epoch)[i] if self.shuffle else i

    def problem(self, slot: int) -> Problem:
        return self.problems[self.index(slot)]

    def take(self, k: int) -> list[Problem]:
        out = [self.problem(s) for s in range(self.position, self.position + k)]
        self.position += k
        return out

    def _permutation(self, epoch: int) -> array:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = array("q", range(len(self.problems)))
            random.Random(f"{self.seed}/order/{epoch}").shuffle(perm)
            self._perms[epoch] = perm
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "size": len(self.problems),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the order itself must be the same one."""
        mine = self.state_dict()
        # Unshuffled (the built-in task), slot n is problem n whatever the size: a resume
        # with more --steps draws more problems after the same ones.
        for key in ("seed", "size", "shuffle") if self.shuffle else ("seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise ValueError(f"saved data order has {key}={state.get(key)!r}, this run's has "
                                 f"{mine[key]!r}: not the same order")
        if not isinstance(state.get("position"), int) or state["position"] < 0:
            raise ValueError(f"saved data order position must be an int >= 0, got {state.get('position')!r}")
        self.position = state["position"]


# --------------------------------------------------------------------------- the run's data

@dataclass
class RunData:
    """The run's prompts, ready to sample from and evaluate on."""

    order: ProblemOrder
    held_out: list[Problem]
    format_prompt: Callable[[str], str]
    fingerprint: str
    train_from: str
    eval_from: str
    counts: dict[str, float]
    """Metric name (``names.DATA_*``) -> value, logged once by trainer replica 0."""

    def published(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "train": self.train_from, "eval": self.eval_from,
                "train_problems": len(self.order), "eval_problems": len(self.held_out)}


def _fit(problems: list[Problem], fmt: Callable[[str], str], tokenizer: Any, max_tokens: int,
         digest: "hashlib._Hash") -> tuple[list[Problem], list[int]]:
    """The problems whose prompt fits ``max_tokens``, and the lengths of the others;
    every kept prompt goes into ``digest``."""
    kept, too_long = [], []
    for i in range(0, len(problems), TOKENIZE_CHUNK):
        chunk = problems[i: i + TOKENIZE_CHUNK]
        texts = [fmt(p.question) for p in chunk]
        for p, text, ids in zip(chunk, texts, encode_prompts(tokenizer, texts)):
            if len(ids) > max_tokens:
                too_long.append(len(ids))
                continue
            kept.append(p)
            digest.update(json.dumps([text, p.answer, p.answer_format]).encode("utf-8", "surrogatepass") + b"\n")
    return kept, too_long


def _measure_builtin(stream: tasks.TrainProblems, fmt: Callable[[str], str], tokenizer: Any, max_tokens: int,
                     digest: "hashlib._Hash") -> tuple[tasks.TrainProblems, list[int]]:
    """The built-in stream as it is, once its first ``BUILTIN_MEASURED`` prompts (past
    its length too: the fingerprint does not depend on ``--steps``, which a resume may
    raise) are measured and fingerprinted with its definition (the rest follow from the
    seed and levels). A prompt too long is refused, not left out: leaving one out would need
    every prompt of the stream measured to know which slot is which problem."""
    digest.update(json.dumps(["built-in", stream.seed, list(stream.levels)]).encode() + b"\n")
    head = list(dataclasses.replace(stream, size=BUILTIN_MEASURED))  # whatever --steps: one stream
    _, too_long = _fit(head, fmt, tokenizer, max_tokens, digest)
    if too_long:
        raise DataError(f"{BUILTIN}: --max-prompt-tokens {max_tokens} is below its prompts' length "
                        f"({max(too_long)} tokens for {len(too_long)} of its first {len(head)}); "
                        "raise it")
    return stream, []


def prepare(sources: Sources, cfg: TrainerConfig, tokenizer: Any, *,
            log: Callable[[str], None] = print) -> RunData:
    """Format every prompt for ``tokenizer``'s policy and leave out the ones longer than
    ``cfg.max_prompt_tokens``; ``DataError`` if no training prompt is left."""
    fmt = PromptFormat.from_config(cfg).bind(tokenizer)
    digest = hashlib.sha256()
    if isinstance(sources.train, tasks.TrainProblems):
        train, long_train = _measure_builtin(sources.train, fmt, tokenizer, cfg.max_prompt_tokens, digest)
    else:
        train, long_train = _fit(sources.train, fmt, tokenizer, cfg.max_prompt_tokens, digest)
    digest.update(b"held out\n")
    held, long_eval = _fit(sources.held_out, fmt, tokenizer, cfg.max_prompt_tokens, digest)
    too_long = long_train + long_eval
    if too_long:
        log(f"skipped {len(too_long)} prompts longer than --max-prompt-tokens {cfg.max_prompt_tokens} "
            f"({len(long_train)} training, {len(long_eval)} held-out; the longest has {max(too_long)} tokens)")
    if not train:
        raise DataError(f"{sources.train_from}: every training prompt is longer than --max-prompt-tokens "
                        f"{cfg.max_prompt_tokens} (the shortest has {min(long_train)} tokens)")
    data = RunData(
        order=ProblemOrder(train, seed=cfg.seed, shuffle=bool(cfg.dataset)), held_out=held,
        format_prompt=fmt, fingerprint=digest.hexdigest(), train_from=sources.train_from,
        eval_from=sources.eval_from,
        counts={names.DATA_TRAIN_PROBLEMS: len(train), names.DATA_EVAL_PROBLEMS: len(held),
                names.DATA_SKIPPED_BAD_ROWS: sources.skipped_rows,
                names.DATA_SKIPPED_LONG_PROMPTS: len(too_long)})
    log(f"prompts: {len(train)} training from {sources.train_from}, {len(held)} held-out from "
        f"{sources.eval_from}; fingerprint {data.fingerprint[:16]}")
    return data


def load(cfg: TrainerConfig, tokenizer: Any, *, log: Callable[[str], None] = print) -> RunData:
    return prepare(read(cfg, log=log), cfg, tokenizer, log=log)


# --------------------------------------------------------------------------- every role, the same

class DataMismatch(RuntimeError):
    """A role read other prompts than trainer replica 0."""


def publish(signed: Any, data: RunData) -> None:
    """Trainer replica 0, before it publishes the config (a signed record: ``llamarl.app.control.signed``)."""
    signed.put(names.DATA_KEY, data.published(), keep=True)


def check_published(rt: runtime.Runtime, data: RunData, timeout_s: float) -> None:
    """Compare this role's prompts with the trainer's; ``DataMismatch`` names both."""
    theirs = rt.wait_key(names.DATA_KEY, timeout_s, "dataset fingerprint")
    mine, me = data.published(), names.member(rt.role, rt.replica)
    if theirs["fingerprint"] != mine["fingerprint"]:
        def describe(d: dict[str, Any]) -> str:
            return (f"fingerprint {d['fingerprint'][:16]}: {d['train']} ({d['train_problems']} training "
                    f"problems), held out: {d['eval']} ({d['eval_problems']})")
        raise DataMismatch(
            f"{me} read other prompts than the trainer; every role must read the same dataset at the "
            f"same path (SLURM: a shared file system; Kubernetes: the image or a shared volume) with "
            f"the same policy tokenizer. trainer/0: {describe(theirs)}; {me}: {describe(mine)}")
    rt.signed.put(names.data_checked_key(me), data.fingerprint)


def wait_for_checks(rt: runtime.Runtime, members: list[str], timeout_s: float,
                    health: Callable[[], None] | None = None) -> None:
    """Trainer replica 0: wait until every one of ``members`` has checked its prompts
    against the published ones (a generator that found a mismatch stops the run, and
    this raises ``Stopped`` with its reason); ``health()`` is called about every
    ``transport.HEALTH_CHECK_S``, so a member that dies before its check is named."""
    deadline = time.monotonic() + timeout_s
    missing = list(members)
    next_check = time.monotonic()
    while missing:
        if health is not None and time.monotonic() >= next_check:
            health()
            next_check = time.monotonic() + transport.HEALTH_CHECK_S
        gone = rt.control.gone()  # lost while it started, the run going on without it (llamarl.app.control.membership)
        missing = [m for m in missing if m not in gone
                   and rt.signed.record(names.data_checked_key(m), writers=(m,)) is None]
        if not missing:
            return
        if rt.should_stop():
            raise transport.Stopped(rt.control.stop_reason() or "stopped while waiting for dataset checks")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no dataset check from {', '.join(missing)} after {timeout_s:g} s")
        time.sleep(0.05)
