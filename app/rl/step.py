"""What every RL loop in llamarl shares: rollouts, the trainer's forward pass, one
policy-gradient step, and held-out evaluation.

The single-process loop (``llamarl.app.roles.local``) and the distributed trainer (``llamarl.app.roles.trainer``)
both call ``train_step`` on batches of ``Rollout``: the synchronous reference and the
asynchronous app differ only in where rollouts come from.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from llamarl.app.tasks import answers
from llamarl.app.rl import losses
from llamarl.app.rl import mismatch
from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.rl.contract import GroupId, Rollout, RolloutGroup
from llamarl.app.rl.packing import completion_rows, packed_completion_logprobs, prompt_key, right_padded
from llamarl.app.model.policy import encode_prompts
from llamarl.app.config import StepConfig
from llamarl.app.rewards import CompositeReward, RewardResult
from llamarl.app.rl.sharding import Ranks, full_value, reshard
from llamarl.app.sampling import Decoder, Samples, SamplingParams, cache_kwarg, sample, token_logprobs


def completion_logprobs(model: PreTrainedModel, rollouts: list[Rollout], *, pad_id: int,
                        temperature: float = 1.0, top_p: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) of each completion token under ``model``, right-padded.

    Returns ``(logp_BT, mask_BT)`` with T the longest completion (at least 2), ``mask_BT``
    1 on the policy's tokens (``Rollout.policy_mask``: an environment's tokens are fed,
    neither scored nor given a log-prob) and 0 elsewhere. The log-probs are those
    of the distribution the sampler draws from (temperature, then top-p), computed by the
    sampler's own ``token_logprobs``; with ``top_p < 1`` a token outside this model's
    nucleus (possible only when the weights moved since sampling) is kept in it, so its
    log-prob stays finite (see ``token_logprobs``).

    Rollouts that share a prompt (the G samples of a group) run it once: the prompt pass
    fills a KV cache that is indexed out to each of them, then the completions run on top
    of it, and gradients flow back through the shared prompt pass. With G = 8 and prompts
    twice as long as answers, this is about a third of the work of running every
    sequence whole.
    """
    device = next(model.parameters()).device
    unique: dict[bytes, int] = {}
    prompts: list[torch.Tensor] = []
    rows: list[int] = []
    for r in rollouts:
        rows.append(unique.setdefault(prompt_key(r), len(unique)))
        if rows[-1] == len(prompts):
            prompts.append(r.prompt_ids)
    row_prompt = torch.tensor(rows, device=device)
    P = max(len(p) for p in prompts)
    # Left-padded: every prompt ends at column P - 1.
    left_UP = torch.arange(P) >= P - torch.tensor([len(p) for p in prompts])[:, None]
    p_ids = torch.full(left_UP.shape, pad_id, dtype=torch.long)
    p_ids[left_UP] = torch.cat(prompts)
    p_ids, p_mask = p_ids.to(device), left_UP.long().to(device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    cache, cache_arg = DynamicCache(), cache_kwarg(model)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                logits_to_keep=1, **{cache_arg: cache})  # only the last position's are used
    first_BV = out.logits[:, -1][row_prompt]  # predicts each completion's first token

    # At least 2: every micro-batch runs the same two forward passes (prompt, then
    # completions), which a sharded model's collectives need on every rank; a padded
    # column is masked out.
    T = max(2, max(len(r.completion_ids) for r in rollouts))
    targets, real, mask = completion_rows(rollouts, T, pad_id=pad_id, device=device)
    # Completion tokens 0..T-2 predict tokens 1..T-1.
    cache.batch_select_indices(row_prompt)
    attn = torch.cat([p_mask[row_prompt], real[:, :-1].long()], dim=-1)
    pos = p_pos[row_prompt][:, -1:] + 1 + torch.arange(T - 1, device=device)
    rest = model(input_ids=targets[:, :-1], attention_mask=attn, position_ids=pos,
                 use_cache=True, **{cache_arg: cache}).logits
    logits_BTV = torch.cat([first_BV[:, None], rest], dim=1)
    logp_BT = token_logprobs(logits_BTV, targets, temperature, top_p)
    return logp_BT * mask, mask


def _placeholder(pad_id: int) -> Rollout:
    """A rollout a rank with a smaller share runs at zero weight: its gradient is exactly
    0, and its forward and backward passes issue the sharded model's collectives (two
    completion tokens: the padded pass then runs both of its forward passes)."""
    return Rollout(prompt_ids=[pad_id], completion_ids=[pad_id, pad_id], behaviour_logprobs=[0.0, 0.0],
                   version=0, advantage=0.0)


Tokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""log pi, log mu and lag of completion tokens, flat: what ``mismatch.mismatch_sums`` takes."""


def _logprobs(model: PreTrainedModel, chunk: list[Rollout], cfg: StepConfig, *, pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp_BT, mu_BT, mask_BT)`` of a micro-batch: pi by ``cfg``'s trainer pass, mu padded
    alike, both 0 where ``mask_BT`` is (padding, an environment's tokens)."""
    logprobs = packed_completion_logprobs if cfg.trainer_pass == "packed" else completion_logprobs
    logp_BT, mask_BT = logprobs(model, chunk, pad_id=pad_id, temperature=cfg.temperature, top_p=cfg.top_p)
    mu_BT = right_padded([r.behaviour_logprobs for r in chunk], logp_BT.shape[1], 0.0).to(logp_BT.device)
    return logp_BT, mu_BT.masked_fill_(mask_BT == 0, 0.0), mask_BT


def _tokens(chunk: list[Rollout], logp_BT: torch.Tensor, mu_BT: torch.Tensor, mask_BT: torch.Tensor,
            policy_version: int) -> Tokens:
    """The ``Tokens`` of a micro-batch (the policy's), lag = ``policy_version`` - the token's version."""
    versions_BT = right_padded([r.token_versions() for r in chunk], mask_BT.shape[1], 0).to(logp_BT.device)
    kept_BT = mask_BT.bool()
    return logp_BT.detach()[kept_BT], mu_BT[kept_BT], policy_version - versions_BT[kept_BT]


def _micro_batch_loss(model: PreTrainedModel, chunk: list[Rollout], cfg: StepConfig, *, pad_id: int,
                      ref_model: PreTrainedModel | None
                      ) -> tuple[torch.Tensor, dict[str, float], float, tuple[torch.Tensor, ...]]:
    """The loss of one micro-batch under ``cfg`` (normalised within it), its metrics, its
    token count, and its ``(logp_BT, mu_BT, mask_BT)``."""
    logp_BT, mu_BT, mask_BT = _logprobs(model, chunk, cfg, pad_id=pad_id)
    adv_B = torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=logp_BT.device)
    if cfg.loss == "aipo":
        loss, m = losses.aipo_loss(logp_BT, mu_BT, adv_B, mask_BT, rho_max=cfg.rho_max,
                                   normaliser=cfg.normaliser, correction=cfg.ratio_correction)
    else:
        loss, m = losses.ppo_clip_loss(logp_BT, mu_BT, adv_B, mask_BT, clip_eps=cfg.clip_eps,
                                       normaliser=cfg.normaliser)
    if cfg.kl_coef > 0 and ref_model is not None:
        with torch.no_grad():
            ref_BT = _logprobs(ref_model, chunk, cfg, pad_id=pad_id)[0]
        kl, km = losses.kl_penalty(logp_BT, ref_BT, mask_BT, normaliser=cfg.normaliser)
        loss = loss + cfg.kl_coef * kl
        m = {**m, **km}
    return loss, m, mask_BT.sum().item(), (logp_BT, mu_BT, mask_BT)


def micro_batches(rollouts: list[Rollout], cfg: StepConfig) -> list[list[Rollout]]:
    """The micro-batches ``train_step`` passes through the model: the rollouts with a
    non-zero advantage (all of them with a KL term), at most ``cfg.micro_batch`` each."""
    active = rollouts if cfg.kl_coef > 0 else [r for r in rollouts if r.advantage != 0]
    # A group's rollouts stay together (their prompt runs once) and similar prompt lengths
    # share a micro-batch (less padding).
    active = sorted(active, key=lambda r: (len(r.prompt_ids), prompt_key(r)))
    return [active[i: i + cfg.micro_batch] for i in range(0, len(active), cfg.micro_batch)]


def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, rollouts: list[Rollout],
               cfg: StepConfig, *, pad_id: int, ref_model: PreTrainedModel | None = None,
               ranks: Ranks | None = None, policy_version: int | None = None) -> dict[str, float]:
    """One optimizer step on ``rollouts`` (advantages already set), in micro-batches.

    The loss of each micro-batch is weighted by its share of the batch's normaliser
    (tokens or sequences), so the accumulated gradient equals the full-batch gradient.
    A rollout whose advantage is 0 adds exactly nothing to the policy-gradient loss
    (every term is 0 * log pi), so without a KL term it skips the forward and backward
    pass; the normaliser still counts it, so the gradient is the same. Groups whose
    rewards are all equal (often half of them) cost nothing to train on. The ratio
    statistics describe the rollouts that were passed through.

    ``ranks`` (several trainer ranks; ``model`` sharded by ``llamarl.app.rl.sharding``): ``rollouts``
    is this rank's share of the batch. The normaliser counts every rank's rollouts and
    the sharded model sums the ranks' gradients, so the step is the one a single process
    takes on the whole batch; every rank runs as many micro-batches as the rank with the
    most (the others at zero weight), since each forward and backward pass is a
    collective; the metrics are the whole batch's. A rank with no rollout takes part too;
    when no rank has one, nothing is updated and the metrics are ``{}``.

    ``policy_version`` (the version of ``model``'s weights) adds the train/inference
    mismatch of the tokens passed through, by lag (``llamarl.app.rl.mismatch``); when none is (every
    advantage 0), of one micro-batch per rank run forward without gradient for it.
    """
    if not rollouts and ranks is None:
        raise ValueError("train_step needs at least one rollout")
    # Dropout stays off: pi_theta must be the same function the generator sampled from
    # (mu), or the importance ratios measure dropout noise instead of policy change.
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    chunks = micro_batches(rollouts, cfg)
    counts = [sum(r.policy_tokens for r in rollouts), len(rollouts), sum(map(len, chunks)), len(chunks)]
    if ranks is not None:
        counts[:3], counts[3:] = ranks.sum(counts[:3]), ranks.max(counts[3:])
    total_tokens, total_rollouts, total_active, n_chunks = counts
    if total_rollouts == 0:  # no rank has a rollout: no update, as one process skips such a batch
        return {}
    sums: dict[str, float] = {"loss": 0.0, "weights": 0.0}
    ratio_max = 1.0 if n_chunks == 0 else -float("inf")
    seen: list[Tokens] = []
    for i in range(int(n_chunks)):
        chunk, weight = (chunks[i], 1.0) if i < len(chunks) else ([_placeholder(pad_id)], 0.0)
        loss, m, tokens, passed = _micro_batch_loss(model, chunk, cfg, pad_id=pad_id, ref_model=ref_model)
        if policy_version is not None and weight:
            seen.append(_tokens(chunk, *passed, policy_version))
        share = weight * (tokens / total_tokens if cfg.normaliser == "token" else len(chunk) / total_rollouts)
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        sums["weights"] += share
        for k, v in m.items():
            if k == "ratio_max":
                ratio_max = max(ratio_max, v) if weight else ratio_max
            else:
                sums[k] = sums.get(k, 0.0) + v * share
    keys = sorted(sums)
    if ranks is not None:  # every rank ran the same micro-batches' metrics: the same keys
        sums = dict(zip(keys, ranks.sum([sums[k] for k in keys])))
        ratio_max = ranks.max([ratio_max])[0]
    weights = sums.pop("weights")
    stats = {k: (v if k == "loss" else v / weights) for k, v in sums.items()}
    if policy_version is not None:
        if n_chunks == 0:  # no rank ran the training pass: one forward each (a collective when sharded)
            chunk = rollouts[: cfg.micro_batch] or [_placeholder(pad_id)]
            with torch.no_grad():
                passed = _logprobs(model, chunk, cfg, pad_id=pad_id)
            reshard(model)  # no backward follows: the root's parameters would stay whole
            seen += [_tokens(chunk, *passed, policy_version)] if rollouts else []
        stats.update(_mismatch(seen, cfg.rho_max, ranks))
    if n_chunks == 0:  # an all-zero gradient, as the full pass would have given
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        stats.update(ratio_mean=1.0, frac_truncated=0.0)
    grad_norm = full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    return {**stats, "ratio_max": ratio_max, "grad_norm": float(grad_norm),
            "response_len": total_tokens / max(1, total_rollouts),
            "frac_skipped": 1 - total_active / max(1, total_rollouts)}


def _mismatch(seen: list[Tokens], rho_max: float, ranks: Ranks | None) -> dict[str, float]:
    """``mismatch`` metrics of the tokens every rank has ``seen`` (called by every rank)."""
    if seen:
        logp_N, mu_N, lag_N = (torch.cat(parts) for parts in zip(*seen))
    else:
        logp_N = mu_N = torch.zeros(0)
        lag_N = torch.zeros(0, dtype=torch.long)
    lags = int(lag_N.max()) + 1 if lag_N.numel() else 0
    if ranks is not None:
        lags = int(ranks.max([lags])[0])
    if lags == 0:
        return {}
    sums, maxima = mismatch.mismatch_sums(logp_N.cpu(), mu_N.cpu(), lag_N.cpu(), rho_max=rho_max, lags=lags)
    if ranks is not None:
        sums, maxima = ranks.sum(sums), ranks.max(maxima)
    by_lag = mismatch.mismatch_metrics(sums, maxima)
    return {**by_lag, **mismatch.worst_lag(by_lag)}


def score_groups(groups: list[RolloutGroup], reward: CompositeReward,
                 timeout_s: float | None = None) -> list[RewardResult]:
    """Score every rollout of ``groups`` in one batched call and attach the results.
    Quarantined rollouts get ``reward = None``: the trainer never learns from them."""
    results = reward.score([r.sample() for g in groups for r in g.rollouts], timeout_s)
    i = 0
    for g in groups:
        g.attach(results[i: i + len(g.rollouts)])
        i += len(g.rollouts)
    return results


def set_group_advantages(rollouts: list[Rollout], *, normalize_std: bool) -> dict[str, float]:
    """Group-relative advantages within each prompt's group (groups may differ in size
    when some rollouts were quarantined; a group of one has advantage 0)."""
    groups: dict[GroupId, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    zero_var = 0
    for g in groups.values():
        rewards_1G = torch.tensor([[r.reward for r in g]], dtype=torch.float32)
        adv_1G, m = losses.group_advantages(rewards_1G, normalize_std=normalize_std)
        zero_var += m["frac_zero_var"]
        for r, a in zip(g, adv_1G[0].tolist()):
            r.advantage = a
    return {"frac_zero_var": zero_var / max(1, len(groups))}


def generate_groups(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    problems: Sequence[tasks.Problem], *, group_size: int, params: SamplingParams,
                    version: int, rng: torch.Generator | None = None, generator_id: int = 0,
                    first_seq: int = 0,
                    format_prompt: Callable[[str], str] = tasks.format_prompt,
                    decoder: Decoder = "auto",
                    send: Callable[[RolloutGroup], None] | None = None) -> list[RolloutGroup]:
    """A group of ``group_size`` completions for each problem, sampled in one batch and
    tagged with ``version``; group ids ``(generator_id, first_seq + i)``. Each rollout's
    ``task`` is its problem's ``meta()`` (reference answer and its format); ``decoder``:
    ``sample``'s. With ``send`` (a generator's outbox), the sampler's finished batch goes
    on from the decode loop to be cut into groups, each handed to ``send`` as it is built,
    and nothing is returned; without, the groups are returned."""
    model.eval()
    texts = [format_prompt(p.question) for p in problems]
    prompts = encode_prompts(tokenizer, texts)
    repeated = [ids for ids in prompts for _ in range(group_size)]
    kept: list[RolloutGroup] = []

    def hand_on(out: Samples) -> None:
        # One copy off the device; every rollout's tokens and log-probs are views of it.
        tokens_BT, logprobs_BT, lengths = out.tokens_BT.cpu(), out.logprobs_BT.cpu(), out.lengths_B.tolist()
        for g, (p, text, ids) in enumerate(zip(problems, texts, prompts)):
            group_id = GroupId(generator_id, first_seq + g)
            task, prompt_ids = p.meta(), torch.tensor(ids, dtype=torch.int64)
            rollouts = []
            for i in range(g * group_size, (g + 1) * group_size):
                n = lengths[i]
                rollouts.append(Rollout(
                    prompt_ids=prompt_ids, completion_ids=tokens_BT[i, :n],
                    behaviour_logprobs=logprobs_BT[i, :n], version=version,
                    group_id=group_id, prompt=text, task=task,
                    completion=tokenizer.decode(tokens_BT[i, :n], skip_special_tokens=True)))
            (send or kept.append)(RolloutGroup(group_id=group_id, version=version, rollouts=rollouts))

    sample(model, repeated, params, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
           generator=rng, decoder=decoder, then=hand_on)
    return kept


def eval_completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     problems: Sequence[tasks.Problem], *, max_new_tokens: int, temperature: float = 0.0,
                     batch_size: int = 128, generator: torch.Generator | None = None,
                     format_prompt: Callable[[str], str] = tasks.format_prompt) -> list[str]:
    """One completion per problem, in order: greedy (``temperature=0``) or sampled at
    ``temperature``, ``batch_size`` problems per ``sample`` call (the generators' sampler;
    ``batch_size=1`` decodes them one at a time, the reference a batched run must match)."""
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    texts = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i: i + batch_size]
        prompts = encode_prompts(tokenizer, [format_prompt(p.question) for p in chunk])
        out = sample(model, prompts, params, eos_id=tokenizer.eos_token_id,
                     pad_id=tokenizer.pad_token_id, generator=generator)
        texts += [tokenizer.decode(out.completion_ids(j), skip_special_tokens=True) for j in range(len(chunk))]
    return texts


def grade(problems: Sequence[tasks.Problem], completions: Sequence[str]) -> dict[str, float]:
    """Accuracy overall and per level (built-in problems; a dataset's have level 0, none)
    and ``format``, the share of completions whose final answer the verifier can read (a
    ``####`` or ``\\boxed{}`` one). Correct is ``math_verifier``'s verdict: the last of
    either marker equals the reference (``llamarl.app.tasks.answers``)."""
    correct: dict[int, list[bool]] = {}
    for p, text in zip(problems, completions, strict=True):
        correct.setdefault(p.level, []).append(answers.is_correct(text, p.answer))
    flat = [c for cs in correct.values() for c in cs]
    formatted = sum(answers.final_answer(text) is not None for text in completions)
    metrics = {"accuracy": sum(flat) / max(1, len(flat)), "format": formatted / max(1, len(problems))}
    metrics.update({f"accuracy_level{k}": sum(v) / len(v) for k, v in sorted(correct.items()) if k > 0})
    return metrics


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[tasks.Problem],
             *, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 128,
             generator: torch.Generator | None = None,
             format_prompt: Callable[[str], str] = tasks.format_prompt) -> dict[str, float]:
    """Held-out ``grade`` of ``eval_completions``: greedy (``temperature=0``) or sampled
    at ``temperature`` (one sample per problem)."""
    return grade(problems, eval_completions(model, tokenizer, problems, max_new_tokens=max_new_tokens,
                                            temperature=temperature, batch_size=batch_size,
                                            generator=generator, format_prompt=format_prompt))
