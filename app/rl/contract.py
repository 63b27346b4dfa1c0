"""The rollout contract: the data that flows between executors, and its one wire format.

A generator samples G completions of one prompt with the weights of one policy version:
a ``RolloutGroup`` of G ``Rollout``s. The group travels as ONE message (so it never
straddles two training batches), from the generator to the trainer's pipeline, through a
reward executor when the app has one (which attaches the reward results). Every executor
builds and reads that message here, with ``to_message`` and ``from_message``:

    {"kind": "rollout_group", "generator": int, "seq": int, "version": int,
     "sent_at": float, "prompt": str, "prompt_ids": int64[P], "task": {...JSON...},
     "completions": [str] * G, "completion_ids": [int64[T_i]] * G,
     "logprobs": [float32[T_i]] * G, "results": [RewardResult dict] * G  (scored only),
     "slot": int  (optional),
     "policy_mask": [bool[T_i]] * G  (optional: absent, every completion token is the policy's),
     "segment_versions": [int64[S_i]] * G  (optional: absent, every policy segment is of "version"),
     "tasks": [{...JSON...}] * G  (optional, when the tasks differ, as episodes' rewards do)}

Token ids and log-probs travel as raw tensor bytes (``llamarl.app.control.transport``'s frames),
exact, and stay tensors: a ``Rollout`` holds 1-D CPU tensors from the sampler to the
trainer's pass (``from_message`` hands back the tensors it decoded).

Episodes: ``policy_mask`` says which completion tokens the policy produced (the others
are an environment's: no loss, their log-probs ignored); each run of policy tokens is a
*policy segment* sampled at one version, ``segment_versions`` (<= the group's
``version``, the newest); staleness counts the oldest (``Rollout.oldest_version``).

``from_message`` trusts nothing: a message with a missing field, a wrong type, log-probs
whose length differs from the tokens, a token id outside the vocabulary or a log-prob that
is not a finite number <= 0 raises ``MalformedMessage`` naming the field. Receivers drop
such a message and count it by reason (``Rejections``); it is never fatal and never
trained on.

Group ids are integers: the generator replica that sampled the group and that
generator's own sequence number, so a group is unique across the run.

Pure: no process groups, no store.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from llamarl.app import names
from llamarl.app.names import BAD_VALUE, MISSING_FIELD, WRONG_LENGTH, WRONG_TYPE
from llamarl.app.rewards import RewardResult, Sample

log = logging.getLogger("llamarl")

KIND = "rollout_group"

# Why a message was dropped on receipt (counted under ``names.REJECTED_PREFIX``): the
# reasons of ``llamarl.app.names``, imported above.

# A log-prob a hair above 0 is rounding (log_softmax of a near-certain token), not an error.
_LOGPROB_SLACK = 1e-4


class GroupId(NamedTuple):
    """Which generator replica sampled the group, and its sequence number there."""

    generator: int
    seq: int


def _segment_starts(policy_mask_T: torch.Tensor) -> torch.Tensor:
    starts_T = policy_mask_T.clone()
    starts_T[1:] &= ~policy_mask_T[:-1]
    return starts_T


def policy_segments(policy_mask_T: torch.Tensor) -> int:
    """How many policy segments (maximal runs of True) ``policy_mask_T`` has."""
    return int(_segment_starts(policy_mask_T).sum())


def _as_vector(value: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``value`` (a tensor or a list) as a 1-D CPU tensor of ``dtype``; no copy when it is one."""
    t = torch.as_tensor(value, dtype=dtype, device="cpu")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


@dataclass(kw_only=True, eq=False)
class Rollout:
    """One sampled completion and everything the trainer needs to learn from it. Token
    data are 1-D CPU tensors (given as lists, converted once)."""

    prompt_ids: torch.Tensor
    """int64[P]."""
    completion_ids: torch.Tensor
    """int64[T]: the policy's tokens (and, in an episode, the environment's)."""
    behaviour_logprobs: torch.Tensor
    """float32[T]: log mu(y_t) recorded by the generator, one per completion token
    (ignored where ``policy_mask`` is False)."""
    version: int
    """Policy version of the group: the newest weights that sampled any of it."""
    policy_mask: torch.Tensor | None = None
    """bool[T]: which completion tokens the policy produced; None: all of them."""
    segment_versions: torch.Tensor | None = None
    """int64[S]: the version of each policy segment, in order; None: ``version`` each."""
    group_id: GroupId = GroupId(0, 0)
    """The prompt's group: the G rollouts of one prompt share it."""
    prompt: str = ""
    completion: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    """The task's JSON-able metadata (reference ``answer``, ``solution``, ``level``...):
    what reward functions get as ``meta``."""
    result: RewardResult | None = None
    """The reward components' scores, once scored."""
    advantage: float | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _as_vector(self.prompt_ids, torch.int64, "prompt_ids")
        self.completion_ids = _as_vector(self.completion_ids, torch.int64, "completion_ids")
        self.behaviour_logprobs = _as_vector(self.behaviour_logprobs, torch.float32, "behaviour_logprobs")
        T = len(self.completion_ids)
        mask = torch.ones(T, dtype=torch.bool) if self.policy_mask is None else self.policy_mask
        self.policy_mask = _as_vector(mask, torch.bool, "policy_mask")
        S = policy_segments(self.policy_mask)
        versions = torch.full((S,), self.version) if self.segment_versions is None else self.segment_versions
        self.segment_versions = _as_vector(versions, torch.int64, "segment_versions")
        if (len(self.policy_mask), S) != (T, len(self.segment_versions)):
            raise ValueError(f"{len(self.policy_mask)} policy_mask flags for {T} completion tokens, "
                             f"{len(self.segment_versions)} segment_versions for {S} policy segments")

    @property
    def oldest_version(self) -> int:
        """The version of its oldest policy segment: what its staleness counts."""
        return int(self.segment_versions.min()) if len(self.segment_versions) else self.version

    @property
    def policy_tokens(self) -> int:
        """Completion tokens the policy produced: those that carry loss."""
        return int(self.policy_mask.sum())

    def token_versions(self) -> torch.Tensor:
        """int64[T]: each completion token's policy version (an environment token gets
        its preceding segment's, or the first's; it carries no loss)."""
        if not len(self.segment_versions):
            return torch.full_like(self.completion_ids, self.version)
        return self.segment_versions[(_segment_starts(self.policy_mask).cumsum(0) - 1).clamp(min=0)]

    @property
    def reward(self) -> float | None:
        """The weighted total; None before scoring and for a quarantined rollout."""
        return None if self.result is None else self.result.total

    def sample(self) -> Sample:
        """What reward components score."""
        return Sample(prompt=self.prompt, completion=self.completion, meta=self.task)


@dataclass(kw_only=True, eq=False)
class RolloutGroup:
    """The G rollouts of one prompt, sampled with one policy version."""

    group_id: GroupId
    version: int
    rollouts: list[Rollout]
    sent_at: float = 0.0
    """Unix time the generator sent it (0 until sent)."""
    slot: int | None = None
    """The staleness slot it fills (its prompt is ``order.problem(slot)``): what the
    trainer's slot ledger records, so a resume regenerates exactly the missing groups."""

    def __post_init__(self) -> None:
        if not self.rollouts:
            raise ValueError("a rollout group needs at least one rollout")
        prompt = self.rollouts[0].prompt_ids
        for r in self.rollouts:
            if (r.group_id, r.version) != (self.group_id, self.version) or not torch.equal(r.prompt_ids, prompt):
                raise ValueError(f"group {self.group_id}: every rollout must share the group's id, "
                                 "version and prompt")

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any of its rollouts was sampled with: its staleness."""
        return min(r.oldest_version for r in self.rollouts)

    @property
    def scored(self) -> bool:
        return all(r.result is not None for r in self.rollouts)

    def attach(self, results: list[RewardResult]) -> None:
        """Set each rollout's reward results (from an inline scorer or a reward executor)."""
        if len(results) != len(self.rollouts):
            raise ValueError(f"group {self.group_id}: {len(results)} reward results for "
                             f"{len(self.rollouts)} rollouts")
        for r, res in zip(self.rollouts, results):
            r.result = res


def to_message(group: RolloutGroup) -> dict[str, Any]:
    """The group as a message for ``llamarl.app.control.transport``'s frames (see the module docstring)."""
    first = group.rollouts[0]
    msg: dict[str, Any] = {
        "kind": KIND, "generator": group.group_id.generator, "seq": group.group_id.seq,
        "version": group.version, "sent_at": group.sent_at, "prompt": first.prompt,
        "prompt_ids": first.prompt_ids, "task": first.task,
        "completions": [r.completion for r in group.rollouts],
        "completion_ids": [r.completion_ids for r in group.rollouts],
        "logprobs": [r.behaviour_logprobs for r in group.rollouts],
    }
    if not all(bool(r.policy_mask.all()) for r in group.rollouts):
        msg["policy_mask"] = [r.policy_mask for r in group.rollouts]
    if not all(bool(r.segment_versions.eq(group.version).all()) for r in group.rollouts):
        msg["segment_versions"] = [r.segment_versions for r in group.rollouts]
    if any(r.task != first.task for r in group.rollouts[1:]):
        msg["tasks"] = [r.task for r in group.rollouts]
    if group.slot is not None:
        msg["slot"] = group.slot
    if group.scored:
        msg["results"] = [r.result.to_dict() for r in group.rollouts]  # type: ignore[union-attr]
    return msg


class MalformedMessage(ValueError):
    """A received message breaks the contract; ``reason`` is one of the module's reasons."""

    def __init__(self, reason: str, field_name: str, detail: str) -> None:
        super().__init__(f"malformed rollout message: {reason} in field {field_name!r}: {detail}")
        self.reason, self.field, self.detail = reason, field_name, detail


def _get(msg: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in msg:
        raise MalformedMessage(MISSING_FIELD, name, "absent")
    value = msg[name]
    # bool is an int to Python, never to this format.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise MalformedMessage(WRONG_TYPE, name, f"expected {_type_names(kind)}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _vector(value: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != 1:
        got = (f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise MalformedMessage(WRONG_TYPE, name, f"expected a 1-D {dtype} tensor, got {got}")
    return value


def _list_of(msg: dict, name: str, n: int | None) -> list:
    value = _get(msg, name, list)
    if n is not None and len(value) != n:
        raise MalformedMessage(WRONG_LENGTH, name, f"{len(value)} entries, expected {n}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int | None, *, min_len: int) -> torch.Tensor:
    ids = _vector(value, name, torch.int64)
    if len(ids) < min_len:
        raise MalformedMessage(WRONG_LENGTH, name, f"{len(ids)} tokens, at least {min_len} needed")
    if len(ids) and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise MalformedMessage(BAD_VALUE, name, f"token id outside [0, {vocab_size or 'inf'})")
    return ids


def _segments(mask: Any, versions: Any, i: int, T: int, version: int) -> tuple[Any, Any]:
    """Rollout ``i``'s ``policy_mask`` (bool[T], a policy token at least) and
    ``segment_versions`` (one per policy segment, in [0, version]), each None if absent."""
    if mask is not None:
        mask = _vector(mask, f"policy_mask[{i}]", torch.bool)
        if len(mask) != T:
            raise MalformedMessage(WRONG_LENGTH, f"policy_mask[{i}]", f"{len(mask)} flags for {T} tokens")
        if not bool(mask.any()):
            raise MalformedMessage(BAD_VALUE, f"policy_mask[{i}]", "a completion needs a policy token")
    if versions is not None:
        versions = _vector(versions, f"segment_versions[{i}]", torch.int64)
        S = policy_segments(mask) if mask is not None else 1
        if len(versions) != S:
            raise MalformedMessage(WRONG_LENGTH, f"segment_versions[{i}]", f"{len(versions)} for {S} segments")
        if int(versions.min()) < 0 or int(versions.max()) > version:
            raise MalformedMessage(BAD_VALUE, f"segment_versions[{i}]", f"versions must be in [0, {version}]")
    return mask, versions


def _result(d: Any, name: str) -> RewardResult:
    if not isinstance(d, dict):
        raise MalformedMessage(WRONG_TYPE, name, f"expected an object, got {type(d).__name__}")
    try:
        total = _get(d, "total", (int, float, type(None)))
        components = _get(d, "components", dict)
        quarantined = _get(d, "quarantined", (str, type(None)))
        failures = _get(d, "failures", dict)
    except MalformedMessage as e:
        raise MalformedMessage(e.reason, f"{name}.{e.field}", e.detail) from None
    numbers_ok = all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(v) for k, v in components.items())
    if not numbers_ok or (total is not None and not math.isfinite(total)):
        raise MalformedMessage(BAD_VALUE, name, "scores must be finite numbers")
    if (total is None) != (quarantined is not None):
        raise MalformedMessage(BAD_VALUE, name, "a result has a total exactly when it is not quarantined")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in failures.items()):
        raise MalformedMessage(WRONG_TYPE, name, "failures must map component names to reasons")
    return RewardResult(total=None if total is None else float(total),
                        components={k: float(v) for k, v in components.items()},
                        quarantined=quarantined, failures=dict(failures))


def from_message(msg: dict[str, Any], *, vocab_size: int | None = None,
                 group_size: int | None = None) -> RolloutGroup:
    """The group in ``msg``, checked field by field; ``MalformedMessage`` if it breaks the
    contract. ``vocab_size`` and ``group_size``, when given, bound token ids and the
    number of completions."""
    if msg.get("kind") != KIND:
        raise MalformedMessage(BAD_VALUE if "kind" in msg else MISSING_FIELD, "kind",
                               f"expected {KIND!r}, got {msg.get('kind')!r}")
    generator, seq, version = (_get(msg, k, int) for k in ("generator", "seq", "version"))
    if min(generator, seq, version) < 0:
        raise MalformedMessage(BAD_VALUE, "generator/seq/version", "must be >= 0")
    sent_at = float(_get(msg, "sent_at", (int, float)))
    slot = _get(msg, "slot", int) if "slot" in msg else None
    if slot is not None and slot < 0:
        raise MalformedMessage(BAD_VALUE, "slot", "must be >= 0")
    prompt = _get(msg, "prompt", str)
    prompt_ids = _token_ids(_get(msg, "prompt_ids", torch.Tensor), "prompt_ids", vocab_size, min_len=1)
    task = _get(msg, "task", dict)
    texts = _list_of(msg, "completions", group_size)
    if not texts:
        raise MalformedMessage(WRONG_LENGTH, "completions", "a group needs at least one completion")
    G = len(texts)
    ids = _list_of(msg, "completion_ids", G)
    logprobs = _list_of(msg, "logprobs", G)
    results, masks, versions = (_list_of(msg, k, G) if k in msg else [None] * G
                                for k in ("results", "policy_mask", "segment_versions"))
    tasks = _list_of(msg, "tasks", G) if "tasks" in msg else [task] * G
    group_id = GroupId(generator, seq)
    rollouts = []
    for i in range(G):
        if not isinstance(texts[i], str):
            raise MalformedMessage(WRONG_TYPE, f"completions[{i}]", f"got {type(texts[i]).__name__}")
        tokens = _token_ids(ids[i], f"completion_ids[{i}]", vocab_size, min_len=1)
        lp = _vector(logprobs[i], f"logprobs[{i}]", torch.float32)
        if len(lp) != len(tokens):
            raise MalformedMessage(WRONG_LENGTH, f"logprobs[{i}]",
                                   f"{len(lp)} log-probs for {len(tokens)} tokens")
        if not bool(torch.isfinite(lp).all()) or float(lp.max()) > _LOGPROB_SLACK:
            raise MalformedMessage(BAD_VALUE, f"logprobs[{i}]", "log-probs must be finite and <= 0")
        mask, segment_versions = _segments(masks[i], versions[i], i, len(tokens), version)
        if not isinstance(tasks[i], dict):
            raise MalformedMessage(WRONG_TYPE, f"tasks[{i}]", f"got {type(tasks[i]).__name__}")
        rollouts.append(Rollout(
            prompt_ids=prompt_ids, completion_ids=tokens, behaviour_logprobs=lp, policy_mask=mask,
            segment_versions=segment_versions, version=version, group_id=group_id, prompt=prompt,
            completion=texts[i], task=tasks[i],
            result=None if results[i] is None else _result(results[i], f"results[{i}]")))
    return RolloutGroup(group_id=group_id, version=version, rollouts=rollouts, sent_at=sent_at, slot=slot)


FLOOD_FRAMES = 10_000
"""Messages rejected in a row, with no valid one between, that make a flood: the reader
then fails the run naming it (``FrameFlood``). A role of the app never sends a bad frame,
so a few come only from outside (or a role with another secret); 10,000 in a row means
the queue is someone else's now. At the queues' own pace that is seconds of nothing but
rejections (a rejection costs one store round trip and an HMAC, ~0.1 ms): long enough
that a burst never ends a run, short enough that a queue drowned in junk is named within
seconds rather than found by the 600 s silence timeout. A flood that lets valid messages
through now and then is only counted: the run goes on."""


class FrameFlood(RuntimeError):
    """A reader saw ``FLOOD_FRAMES`` rejected messages in a row: a sustained flood."""


Admit = Callable[[RolloutGroup], "tuple[str, str] | None"]
"""``admit(group)``: ``None`` to take a valid group, or ``(reason, detail)`` to refuse it
(``llamarl.app.control.seen_groups.Admission``: a replay, a version from the future)."""


class Rejections:
    """Counts messages dropped on receipt, by reason, and logs the first of each
    (reason, field) once: a flood of bad messages costs a counter, not a log line each.
    ``accepted()`` is told of every valid message; ``flood_frames`` rejections in a row
    without one raise ``FrameFlood``."""

    def __init__(self, where: str, flood_frames: int = FLOOD_FRAMES) -> None:
        self.where, self.flood_frames = where, flood_frames
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._in_a_row = 0

    def __call__(self, reason: str, detail: str, field_name: str = "") -> None:
        self.counted(reason, detail, field_name)
        self._in_a_row += 1
        if self._in_a_row >= self.flood_frames:
            raise FrameFlood(
                f"{self.where}: {self._in_a_row} messages rejected in a row with no valid one between "
                f"(so far {dict(self.counts)}): a flood of frames on the control store's queues, from "
                f"outside the app or from a role with another secret; the store's port must be "
                f"reachable only by the app's roles (docs/security.md)")

    def counted(self, reason: str, detail: str, field_name: str = "") -> None:
        """A message dropped for ``reason``, counted and logged once per reason and field.
        Called alone for one that is valid app traffic as often as not (a group too old to
        train): not part of a flood's run (it came from a role, signed)."""
        self.counts[reason] += 1
        if (reason, field_name) not in self._logged:
            self._logged.add((reason, field_name))
            log.warning("%s: dropped a message (%s%s): %s; further ones like it are only counted",
                        self.where, reason, f" in {field_name!r}" if field_name else "", detail)

    def accepted(self, n: int = 1) -> None:
        """``n`` valid messages arrived: the run of rejections is over."""
        if n:
            self._in_a_row = 0

    def metrics(self) -> dict[str, float]:
        """The counts so far under their metric names. The pipeline's worker thread adds
        reasons while the trainer reads: one C-level copy of the dict, then iterate."""
        return {names.rejected_metric(k): float(n) for k, n in dict(self.counts).items()}

    def decode(self, msgs: list[dict[str, Any]], admit: Admit | None = None,
               **checks: Any) -> list[RolloutGroup]:
        """The groups of ``msgs`` that keep the contract and that ``admit`` (when given)
        lets in; the others are counted."""
        groups = []
        for msg in msgs:
            try:
                group = from_message(msg, **checks)
            except MalformedMessage as e:
                self(e.reason, str(e), e.field)
                continue
            refused = admit(group) if admit is not None else None
            if refused is not None:
                self(*refused)
                continue
            self.accepted()
            groups.append(group)
        return groups


__all__ = ["FLOOD_FRAMES", "FrameFlood", "GroupId", "MalformedMessage", "Rejections", "Rollout", "RolloutGroup", "from_message",
           "policy_segments", "to_message"]
