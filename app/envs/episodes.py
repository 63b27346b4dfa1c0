"""The generator's episode runner: many multi-turn episodes in flight, batched per turn.

Each episode: ``env.reset(row)`` renders to the prompt's ids; then rounds of

1. every episode waiting for the policy samples its turn, all of them in ONE ``sample``
   call (the same sampler as single-turn rollouts), stopping at the end-of-turn token
   (EOS; a Hermes tool call ends the turn too, since the template closes it with the
   end-of-turn token) or at ``max_new_tokens``. The call's prefill starts from the keys
   and values the episode's last turn kept (``Prefixes``; Llama-architecture policies),
   so it runs only the tokens since then, where the same weights made them: a weight
   version or parameter change in between (``weights_stamp``, which the generator's
   in-place swap bumps) drops them and the turn prefills its whole sequence, so that
   its log-probs are the recorded version's alone (not a mix of keys from the old
   weights and queries from the new);
2. each finished turn goes to ``env.step`` on a thread pool, with a deadline of
   ``env_step_timeout_s``: the next round samples the episodes that are ready while others'
   steps run, so one slow tool does not stall the batch;
3. a step's observation is rendered (``ChatFormat.observation``) and appended; the
   episode waits for the policy again.

An episode ends when a step says ``done``, after ``max_turns`` policy turns, when its
sequence reaches ``max_episode_tokens`` (or the model's context), or by a failure of its environment: a step past
its deadline (``step_timeout``) or one that raised (``env_error``), counted by reason in
``EpisodeStats`` and logged once per reason; the run goes on. A hung step's thread cannot
be killed (Python has no such thing): it holds one pool thread until it returns, which is
why the built-in Python tool runs in a process of its own that is killed at its deadline
(``llamarl.app.envs.sandbox``).

The result of an episode is a ``Rollout``: every token after the prompt is a completion
token, the policy's carrying their behaviour log-probs and ``policy_mask`` True, the
environment's masked (log-prob 0, no loss); each policy turn is a policy segment with
the version of the weights that sampled it (``version()`` read at each turn: a generator
that swaps weights between turns records it), so staleness counts its oldest turn. The
episode's reward, the sum of its steps' rewards (0 when none came, e.g. cut short), goes
into ``task["env_reward"]``, which the ``env_reward`` reward component returns.

The limits are the generator's own flags (``GeneratorConfig``: ``max_turns``,
``max_episode_tokens``, ``env_step_timeout_s``, and ``max_new_tokens`` per turn), read
from it rather than restated in a config of the runner's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llamarl.app.config import GeneratorConfig
from llamarl.app.envs.chat import ChatFormat
from llamarl.app.envs.protocol import Environment, Message, Step, as_messages, tool_schemas
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup
from llamarl.app.sampling import Prefixes, SamplingParams, sample
from llamarl.app.sampling.precision import weights_stamp

log = logging.getLogger("llamarl")

# Why an episode ended (``EpisodeStats.ends``).
DONE, MAX_TURNS, MAX_TOKENS, STEP_TIMEOUT, ENV_ERROR = "done", "max_turns", "max_episode_tokens", "step_timeout", "env_error"


@dataclass
class EpisodeStats:
    """Counts over the episodes run so far (the generator's metrics)."""

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter[str] = field(default_factory=Counter)
    ends: Counter[str] = field(default_factory=Counter)
    env_seconds: float = 0.0
    """Summed wall time of environment steps."""
    kv_cached_turns: int = 0
    """Policy turns prefilled after keys and values kept from the episode's last turn
    (only the tokens since then ran)."""

    def metrics(self) -> dict[str, float]:
        out = {"episodes": float(self.episodes), "episode_turns": float(self.turns),
               "tool_calls": float(self.tool_calls), "env_step_s": self.env_seconds,
               "kv_cached_turns": float(self.kv_cached_turns)}
        out.update({f"tool_errors/{k}": float(v) for k, v in self.tool_errors.items()})
        out.update({f"episode_end/{k}": float(v) for k, v in self.ends.items()})
        return out


@dataclass(eq=False)
class _Episode:
    env: Environment
    fmt: ChatFormat
    row: Mapping[str, Any]
    messages: list[Message]
    prompt: str
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    end: str | None = None
    step: Future | None = None
    deadline: float = 0.0
    limit: int = 0
    """Tokens after the prompt it may reach: ``max_episode_tokens``, or less where the
    model's context ends first."""
    kv: torch.Tensor | None = None
    """The keys and values of its sequence as of its last turn's prefill (``Prefixes``)."""
    kv_key: tuple | None = None
    """The weights ``kv`` was computed with: the version and ``weights_stamp``."""


class StepPool:
    """Daemon threads running environment steps. Not ``ThreadPoolExecutor``, whose
    threads the interpreter joins at exit: one hung step would keep the process alive."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"env-step-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the episode, which ends counted
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class EpisodeRunner:
    """Runs episodes of ``make_env()`` environments with ``model`` (see the module): the
    limits, sampling and decoder of ``gen``, or greedy decoding with ``greedy`` (the
    held-out evaluation); ``workers`` threads run environment steps beside decoding."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 make_env: Callable[[], Environment], gen: GeneratorConfig, *, greedy: bool = False,
                 workers: int = 8) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model, self.tokenizer, self.make_env, self.gen = model, tokenizer, make_env, gen
        self.temperature, self.top_p = (0.0, 1.0) if greedy else (gen.temperature, gen.top_p)
        self.pool = StepPool(workers)
        self.stats = EpisodeStats()
        self._logged: set[str] = set()
        self._kv_blocks: dict[int, list[int]] = {}
        """The blocks of kept keys and values this run's episodes hold (``_hold``): by
        address, their bytes and how many episodes hold a view of them."""

    def close(self) -> None:
        """Stop the pool's threads (a hung step's thread is abandoned: a daemon)."""
        self.pool.close()

    def _ended(self, ep: _Episode, reason: str, detail: str = "") -> None:
        ep.end = reason
        self._hold(ep, None, None)
        self.stats.ends[reason] += 1
        self._log_once(reason, detail)
        if callable(getattr(ep.env, "close", None)):  # optional: a client's connection, say
            self.pool.submit(ep.env.close)  # on the pool: closing may block like a step

    def _log_once(self, reason: str, detail: str) -> None:
        if detail and reason not in self._logged:
            self._logged.add(reason)
            log.warning("an episode ended (%s): %s; further ones are only counted", reason, detail)

    def _start(self, row: Mapping[str, Any]) -> _Episode | None:
        env = self.make_env()
        try:
            messages = as_messages(env.reset(row))
        except Exception as e:  # the environment's own failure ends its episode only
            self.stats.ends[ENV_ERROR] += 1
            self._log_once(ENV_ERROR, f"reset raised {type(e).__name__}: {e}")
            return None
        fmt = ChatFormat(self.tokenizer, tool_schemas(getattr(env, "tools", ())))
        prompt, prompt_ids = fmt.prompt(messages)
        context = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        limit = min(self.gen.max_episode_tokens, context - len(prompt_ids))
        if limit < 1:
            self.stats.ends[ENV_ERROR] += 1
            self._log_once(ENV_ERROR, f"a prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                           f"context of {context}")
            return None
        return _Episode(env, fmt, row, messages, prompt, prompt_ids, limit=limit)

    def _hold(self, ep: _Episode, kv: torch.Tensor | None, key: tuple | None) -> None:
        """Keep ``kv`` (made by weights ``key``) for ``ep``'s next turn, in place of what it
        held. A round's keys and values are views of one block (``LlamaFastPath.kept``),
        counted whole while any episode holds a view of it; a new block that would take
        the run past ``episode_kv_cache_mb`` is not kept."""
        if ep.kv is not None:
            held = self._kv_blocks[ep.kv.untyped_storage().data_ptr()]
            held[1] -= 1
            if held[1] == 0:
                del self._kv_blocks[ep.kv.untyped_storage().data_ptr()]
        ep.kv = ep.kv_key = None
        if kv is None:
            return
        block = kv.untyped_storage()
        if block.data_ptr() not in self._kv_blocks:
            if sum(n for n, _ in self._kv_blocks.values()) + block.nbytes() > self.gen.episode_kv_cache_mb * 2**20:
                return
            self._kv_blocks[block.data_ptr()] = [block.nbytes(), 0]
        self._kv_blocks[block.data_ptr()][1] += 1
        ep.kv, ep.kv_key = kv, key

    def _sample_turns(self, ready: list[_Episode], version: int, rng: torch.Generator | None) -> None:
        budgets = [ep.limit - len(ep.ids) for ep in ready]
        params = SamplingParams(max_new_tokens=min(self.gen.max_new_tokens, max(budgets)),
                                temperature=self.temperature, top_p=self.top_p)
        eot = ready[0].fmt.end_of_turn_id
        # Keys and values kept from the episodes' last turns, where the same weights made
        # them: after a swap between turns the sequence is prefilled again, so that the
        # turn's log-probs are those of the version it records.
        key = (version, weights_stamp(self.model)) if self.gen.episode_kv_cache_mb > 0 else None
        prefixes = Prefixes([ep.kv if ep.kv_key == key else None for ep in ready]) if key else None
        self.stats.kv_cached_turns += 0 if prefixes is None else sum(kv is not None for kv in prefixes.past)
        out = sample(self.model, [ep.prompt_ids + ep.ids for ep in ready], params, eos_id=eot,
                     pad_id=self.tokenizer.pad_token_id, generator=rng, decoder=self.gen.gen_decoder,
                     prefixes=prefixes)
        tokens_BT, logprobs_BT, lengths = out.tokens_BT.cpu(), out.logprobs_BT.cpu(), out.lengths_B.tolist()
        for i, ep in enumerate(ready):
            self._hold(ep, None if prefixes is None else prefixes.kept[i], key)
            n = min(lengths[i], budgets[i])
            turn_ids = tokens_BT[i, :n].tolist()
            ep.ids += turn_ids
            ep.logprobs += logprobs_BT[i, :n].tolist()
            ep.mask += [True] * n
            ep.versions.append(version)
            ep.turns += 1
            self.stats.turns += 1
            text = self.tokenizer.decode([t for t in turn_ids if t != eot], skip_special_tokens=False)
            ep.messages.append({"role": "assistant", "content": text})
            ep.step = self.pool.submit(_timed_step, ep.env, text)
            ep.deadline = time.monotonic() + self.gen.env_step_timeout_s

    def _finish_step(self, ep: _Episode) -> None:
        fut, ep.step = ep.step, None
        try:
            step, seconds = fut.result()  # type: ignore[union-attr]
        except Exception as e:
            self._ended(ep, ENV_ERROR, f"step raised {type(e).__name__}: {e}")
            return
        self.stats.env_seconds += seconds
        self.stats.tool_calls += step.tool_calls
        ep.tool_calls += step.tool_calls
        self.stats.tool_errors.update(step.tool_errors)
        if step.reward is not None:
            ep.rewards.append(float(step.reward))
        if step.done:
            return self._ended(ep, DONE)
        if ep.turns >= self.gen.max_turns:
            return self._ended(ep, MAX_TURNS)
        observation = as_messages(step.observation)
        try:
            _, obs_ids = ep.fmt.observation(ep.messages, observation)
        except ValueError as e:
            return self._ended(ep, ENV_ERROR, str(e))
        if not obs_ids:  # the next turn would merge into this one: one segment, two versions
            return self._ended(ep, ENV_ERROR, "an observation rendered to no tokens")
        # Room for the observation and at least one policy token after it.
        if len(ep.ids) + len(obs_ids) >= ep.limit:
            return self._ended(ep, MAX_TOKENS)
        ep.messages += observation
        ep.ids += obs_ids
        ep.logprobs += [0.0] * len(obs_ids)
        ep.mask += [False] * len(obs_ids)

    def _collect(self, waiting: list[_Episode], block: bool, stop: Callable[[], bool],
                 max_wait_s: float = 1.0) -> None:
        """Finish the steps that are done; with ``block``, first wait for one (or for the
        nearest deadline, or ``max_wait_s``). Steps past their deadline end their episodes."""
        if block:
            timeout = max(0.0, min(ep.deadline for ep in waiting) - time.monotonic())
            wait([ep.step for ep in waiting], timeout=min(timeout, max_wait_s),  # type: ignore[misc]
                 return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for ep in waiting:
            if ep.step.done():  # type: ignore[union-attr]
                self._finish_step(ep)
            elif now >= ep.deadline or stop():
                ep.step.cancel()  # type: ignore[union-attr]
                ep.step = None
                self._ended(ep, STEP_TIMEOUT, f"an environment step ran past its {self.gen.env_step_timeout_s:g} s "
                            "deadline" if not stop() else "")

    def run(self, rows: Sequence[Mapping[str, Any]], *, group_size: int, version: Callable[[], int],
            rng: torch.Generator | None = None, stop: Callable[[], bool] = lambda: False,
            between_turns: Callable[[], None] = lambda: None) -> list[list[_Episode]]:
        """``group_size`` episodes of each row, run to their ends; per row, its episodes
        (an episode whose reset failed is left out). ``between_turns`` runs before each
        round of sampling (a generator swaps in new weights there)."""
        model_was_training = self.model.training
        self.model.eval()
        self._kv_blocks.clear()  # episodes do not outlive a run
        flight = InFlight(self, rng=rng, stop=stop)
        for i, row in enumerate(rows):
            flight.admit(i, row, group_size)
        done: dict[Any, list[_Episode]] = {}
        try:
            while len(flight) and not stop():
                if flight.ready():
                    between_turns()
                done.update(flight.advance(version()))
        finally:
            self.model.train(model_was_training)
        left = {k: [ep for ep in g if ep.end is not None] for k, g in flight.groups.items()}  # stopped
        self.stats.episodes += sum(map(len, left.values()))
        return [done[i] if i in done else left[i] for i in range(len(rows))]

    def groups(self, rows: Sequence[Mapping[str, Any]], *, group_size: int, version: Callable[[], int],
               generator_id: int = 0, first_seq: int = 0, **kw: Any) -> list[RolloutGroup]:
        """``run``'s episodes as rollout groups, ids ``(generator_id, first_seq + i)``; a
        row none of whose episodes finished gives no group."""
        out = []
        for i, episodes in enumerate(self.run(rows, group_size=group_size, version=version, **kw)):
            if episodes:
                out.append(to_group(episodes, GroupId(generator_id, first_seq + i), self.tokenizer))
        return out


class InFlight:
    """Groups of episodes being played (``EpisodeRunner.run`` plays a batch of rows this
    way, a streaming generator keeps it filled): ``admit`` starts a row's G episodes under
    a key, ``advance`` plays one round (sample every episode waiting for the policy, in
    one ``sample`` call; collect the environment steps that are done) and hands back each
    group whose episodes have all ended, by key. A group with no episode that started (its
    resets failed) comes back at the next ``advance``, empty.

    Groups have a priority (a streaming generator's: the step their slot trains at): a
    round samples only the ready episodes of the lowest priority that has any, so the
    next step's episodes are sampled while the current step's wait on their environment,
    and never slow the current step's rounds down by sharing them."""

    def __init__(self, runner: EpisodeRunner, *, rng: torch.Generator | None = None,
                 stop: Callable[[], bool] = lambda: False) -> None:
        self.runner, self.rng, self.stop = runner, rng, stop
        self.groups: dict[Any, list[_Episode]] = {}
        self._priority: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def admit(self, key: Any, row: Mapping[str, Any], group_size: int, priority: int = 0) -> int:
        """Start ``group_size`` episodes of ``row`` as group ``key`` (lower ``priority``
        first); how many started."""
        if key in self.groups:
            raise ValueError(f"episode group {key!r} is already in flight")
        self.groups[key] = [ep for ep in (self.runner._start(row) for _ in range(group_size)) if ep is not None]
        self._priority[key] = priority
        return len(self.groups[key])

    def playing(self) -> int:
        """Episodes not yet ended: a group's ended episodes waiting for its last one to end
        hold no row of the decode batch."""
        return sum(ep.end is None for g in self.groups.values() for ep in g)

    def ready(self) -> bool:
        """Whether an episode waits for the policy's turn."""
        return any(ep.step is None and ep.end is None for g in self.groups.values() for ep in g)

    def advance(self, version: int, max_wait_s: float = 1.0) -> dict[Any, list[_Episode]]:
        """One round at weights ``version`` (see the class); when no episode waits for the
        policy it first waits up to ``max_wait_s`` for an environment step to finish."""
        live = [ep for g in self.groups.values() for ep in g if ep.end is None]
        ready: dict[int, list[_Episode]] = {}
        for k, g in self.groups.items():
            for ep in g:
                if ep.end is None and ep.step is None:
                    ready.setdefault(self._priority[k], []).append(ep)
        if ready:
            self.runner._sample_turns(ready[min(ready)], version, self.rng)
        if waiting := [ep for ep in live if ep.step is not None]:
            # Block only when nothing is left to sample: decoding goes on beside steps.
            self.runner._collect(waiting, block=not any(ep.step is None and ep.end is None for ep in live),
                                 stop=self.stop, max_wait_s=max_wait_s)
        done = {k: g for k, g in self.groups.items() if all(ep.end is not None for ep in g)}
        for k, g in done.items():
            del self.groups[k], self._priority[k]
            self.runner.stats.episodes += len(g)
        return done


def _timed_step(env: Environment, turn: str) -> tuple[Step, float]:
    t0 = time.monotonic()
    step = env.step(turn)
    if not isinstance(step, Step):
        raise TypeError(f"{type(env).__name__}.step returned {type(step).__name__}, not a Step")
    return step, time.monotonic() - t0


def episode_reward(ep: _Episode) -> float:
    """The sum of the episode's step rewards; 0 when it got none."""
    return float(sum(ep.rewards))


def to_group(episodes: list[_Episode], group_id: GroupId, tokenizer: PreTrainedTokenizerBase) -> RolloutGroup:
    """The episodes of one row as a ``RolloutGroup`` (its version: the newest turn's)."""
    version = max(max(ep.versions) for ep in episodes)
    prompt_ids = torch.tensor(episodes[0].prompt_ids, dtype=torch.int64)
    rollouts = []
    for ep in episodes:
        task = dict(ep.row)
        task.update(env_reward=episode_reward(ep), turns=ep.turns, tool_calls=ep.tool_calls, episode_end=ep.end)
        rollouts.append(Rollout(
            prompt_ids=prompt_ids, completion_ids=ep.ids, behaviour_logprobs=ep.logprobs,
            policy_mask=ep.mask, segment_versions=ep.versions, version=version, group_id=group_id,
            prompt=ep.prompt, task=task, completion=tokenizer.decode(ep.ids, skip_special_tokens=True)))
    return RolloutGroup(group_id=group_id, version=version, rollouts=rollouts)


__all__ = ["DONE", "ENV_ERROR", "EpisodeRunner", "EpisodeStats", "InFlight", "MAX_TOKENS", "MAX_TURNS",
           "STEP_TIMEOUT", "episode_reward", "to_group"]
