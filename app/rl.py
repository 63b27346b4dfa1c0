"""What every RL loop in llamarl shares: rollouts, the trainer's forward pass, one
policy-gradient step, and held-out evaluation.

The single-process loop (``app.local``) and the distributed trainer (``app.trainer``)
both call ``train_step`` on batches of ``Rollout``: the synchronous reference and the
asynchronous app differ only in where rollouts come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from app import answers, losses, mismatch, tasks
from app.contract import GroupId, Rollout, RolloutGroup
from app.policy import encode_prompts
from app.rewards import CompositeReward, RewardResult
from app.sampling import SamplingParams, cache_kwarg, sample, token_logprobs


@dataclass(kw_only=True)
class StepConfig:
    """The knobs of one policy-gradient step (a slice of the trainer's config)."""

    loss: Literal["aipo", "ppo"] = "aipo"
    rho_max: float = 4.0
    ratio_correction: bool = True
    clip_eps: float = 0.2
    normaliser: losses.Normaliser = "token"
    kl_coef: float = 0.0
    # The generator's: log-probs are taken under the distribution it sampled from.
    temperature: float = 1.0
    top_p: float = 1.0
    micro_batch: int = 64
    max_grad_norm: float = 1.0


def completion_logprobs(model: PreTrainedModel, rollouts: list[Rollout], *, pad_id: int,
                        temperature: float = 1.0, top_p: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) of each completion token under ``model``, right-padded.

    Returns ``(logp_BT, mask_BT)`` with T the longest completion. The log-probs are those
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
    unique: dict[tuple[int, ...], int] = {}
    row_prompt = torch.tensor([unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in rollouts],
                              device=device)
    prompts = list(unique)
    P = max(len(p) for p in prompts)
    p_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    p_mask = torch.zeros_like(p_ids)
    for u, p in enumerate(prompts):  # left-padded: every prompt ends at column P - 1
        p_ids[u, P - len(p):] = torch.tensor(p, device=device)
        p_mask[u, P - len(p):] = 1
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    cache, cache_arg = DynamicCache(), cache_kwarg(model)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                logits_to_keep=1, **{cache_arg: cache})  # only the last position's are used
    first_BV = out.logits[:, -1][row_prompt]  # predicts each completion's first token

    T = max(len(r.completion_ids) for r in rollouts)
    targets = torch.full((len(rollouts), T), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rollouts), T), dtype=torch.float32, device=device)
    for b, r in enumerate(rollouts):
        targets[b, : len(r.completion_ids)] = torch.tensor(r.completion_ids, device=device)
        mask[b, : len(r.completion_ids)] = 1
    logits_BTV = first_BV[:, None]
    if T > 1:  # completion tokens 0..T-2 predict tokens 1..T-1
        cache.batch_select_indices(row_prompt)
        attn = torch.cat([p_mask[row_prompt], mask[:, :-1].long()], dim=-1)
        pos = p_pos[row_prompt][:, -1:] + 1 + torch.arange(T - 1, device=device)
        rest = model(input_ids=targets[:, :-1], attention_mask=attn, position_ids=pos,
                     use_cache=True, **{cache_arg: cache}).logits
        logits_BTV = torch.cat([logits_BTV, rest], dim=1)
    logp_BT = token_logprobs(logits_BTV, targets, temperature, top_p)
    return logp_BT * mask, mask


def _padded(rows: list[list[float]], T: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros((len(rows), T), dtype=torch.float32, device=device)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.tensor(r, dtype=torch.float32, device=device)
    return out


def _token_triples(rollouts: list[Rollout], logp_BT: torch.Tensor, mu_BT: torch.Tensor, mask_BT: torch.Tensor,
                   policy_version: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi, log mu and lag (``policy_version`` - the rollout's) of every completion
    token of ``rollouts``, flat: what ``mismatch.mismatch_by_lag`` takes."""
    lag_BT = torch.tensor([policy_version - r.version for r in rollouts], device=logp_BT.device)
    kept_BT = mask_BT.bool()
    return logp_BT.detach()[kept_BT], mu_BT[kept_BT], lag_BT[:, None].expand_as(mask_BT)[kept_BT]


def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, rollouts: list[Rollout],
               cfg: StepConfig, *, pad_id: int, ref_model: PreTrainedModel | None = None,
               reduce_grads: Callable[[list[torch.Tensor]], None] | None = None,
               policy_version: int | None = None) -> dict[str, float]:
    """One optimizer step on ``rollouts`` (advantages already set), in micro-batches.

    The loss of each micro-batch is weighted by its share of the batch's normaliser
    (tokens or sequences), so the accumulated gradient equals the full-batch gradient.
    A rollout whose advantage is 0 adds exactly nothing to the policy-gradient loss
    (every term is 0 * log pi), so without a KL term it skips the forward and backward
    pass; the normaliser still counts it, so the gradient is the same. Groups whose
    rewards are all equal (often half of them) cost nothing to train on. The ratio
    statistics describe the rollouts that were passed through.

    ``reduce_grads`` (data parallel) is called once with every parameter's gradient after
    the last backward, whatever the number of micro-batches this rank ran; a data-parallel
    rank with no usable rollout this step still joins it with a zero gradient.

    ``policy_version`` (the version of ``model``'s weights) adds the train/inference
    mismatch of the tokens passed through, by lag (``app.mismatch``); when none is (every
    advantage 0), of one micro-batch run forward without gradient for it.
    """
    if not rollouts and reduce_grads is None:
        raise ValueError("train_step needs at least one rollout")
    # Dropout stays off: pi_theta must be the same function the generator sampled from
    # (mu), or the importance ratios measure dropout noise instead of policy change.
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(len(r.completion_ids) for r in rollouts)
    active = rollouts if cfg.kl_coef > 0 else [r for r in rollouts if r.advantage != 0]
    # A group's rollouts stay together (their prompt runs once) and similar prompt lengths
    # share a micro-batch (less padding).
    active = sorted(active, key=lambda r: (len(r.prompt_ids), r.prompt_ids))
    sums: dict[str, float] = {"loss": 0.0}
    weights = 0.0
    ratio_max = 1.0
    tokens: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # log pi, log mu, lag
    for i in range(0, len(active), cfg.micro_batch):
        chunk = active[i: i + cfg.micro_batch]
        logp_BT, mask_BT = completion_logprobs(model, chunk, pad_id=pad_id,
                                               temperature=cfg.temperature, top_p=cfg.top_p)
        mu_BT = _padded([r.behaviour_logprobs for r in chunk], logp_BT.shape[1], logp_BT.device)
        adv_B = torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=logp_BT.device)
        if policy_version is not None:
            tokens.append(_token_triples(chunk, logp_BT, mu_BT, mask_BT, policy_version))
        if cfg.loss == "aipo":
            loss, m = losses.aipo_loss(logp_BT, mu_BT, adv_B, mask_BT, rho_max=cfg.rho_max,
                                       normaliser=cfg.normaliser, correction=cfg.ratio_correction)
        else:
            loss, m = losses.ppo_clip_loss(logp_BT, mu_BT, adv_B, mask_BT, clip_eps=cfg.clip_eps,
                                           normaliser=cfg.normaliser)
        if cfg.kl_coef > 0 and ref_model is not None:
            with torch.no_grad():
                ref_BT, _ = completion_logprobs(ref_model, chunk, pad_id=pad_id,
                                                temperature=cfg.temperature, top_p=cfg.top_p)
            kl, km = losses.kl_penalty(logp_BT, ref_BT, mask_BT, normaliser=cfg.normaliser)
            loss = loss + cfg.kl_coef * kl
            m = {**m, **km}
        share = (mask_BT.sum().item() / total_tokens if cfg.normaliser == "token"
                 else len(chunk) / len(rollouts))
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        weights += share
        for k, v in m.items():
            if k == "ratio_max":
                ratio_max = max(ratio_max, v) if weights > share else v
            else:
                sums[k] = sums.get(k, 0.0) + v * share
    stats = {k: (v if k == "loss" else v / weights) for k, v in sums.items()}
    if policy_version is not None and not tokens and rollouts:
        # No rollout went through the pass (every advantage 0): one forward without
        # gradient over a micro-batch of them, so that every step measures the mismatch.
        chunk = rollouts[: cfg.micro_batch]
        with torch.no_grad():
            logp_BT, mask_BT = completion_logprobs(model, chunk, pad_id=pad_id, temperature=cfg.temperature,
                                                   top_p=cfg.top_p)
        mu_BT = _padded([r.behaviour_logprobs for r in chunk], logp_BT.shape[1], logp_BT.device)
        tokens.append(_token_triples(chunk, logp_BT, mu_BT, mask_BT, policy_version))
    if tokens:
        logp_N, mu_N, lag_N = (torch.cat(t) for t in zip(*tokens))
        stats.update(mismatch.mismatch_by_lag(logp_N, mu_N, lag_N, rho_max=cfg.rho_max))
    if not active:  # an all-zero gradient, as the full pass would have given
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        stats.update(ratio_mean=1.0, frac_truncated=0.0)
    if reduce_grads is not None:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reduce_grads([p.grad for p in model.parameters()])
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {**stats, "ratio_max": ratio_max, "grad_norm": float(grad_norm),
            "response_len": total_tokens / max(1, len(rollouts)),
            "frac_skipped": 1 - len(active) / max(1, len(rollouts))}


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
                    format_prompt: Callable[[str], str] = tasks.format_prompt) -> list[RolloutGroup]:
    """A group of ``group_size`` completions for each problem, sampled in one batch and
    tagged with ``version``; group ids ``(generator_id, first_seq + i)``. Each rollout's
    ``task`` is its problem's ``meta()`` (reference answer and its format)."""
    model.eval()
    texts = [format_prompt(p.question) for p in problems]
    prompts = encode_prompts(tokenizer, texts)
    repeated = [ids for ids in prompts for _ in range(group_size)]
    out = sample(model, repeated, params, eos_id=tokenizer.eos_token_id,
                 pad_id=tokenizer.pad_token_id, generator=rng)
    groups = []
    for g, (p, text, ids) in enumerate(zip(problems, texts, prompts)):
        group_id = GroupId(generator_id, first_seq + g)
        task = p.meta()
        rollouts = []
        for i in range(g * group_size, (g + 1) * group_size):
            n = int(out.lengths_B[i])
            rollouts.append(Rollout(
                prompt_ids=ids, completion_ids=out.tokens_BT[i, :n].tolist(),
                behaviour_logprobs=out.logprobs_BT[i, :n].tolist(), version=version,
                group_id=group_id, prompt=text, task=task,
                completion=tokenizer.decode(out.tokens_BT[i, :n], skip_special_tokens=True)))
        groups.append(RolloutGroup(group_id=group_id, version=version, rollouts=rollouts))
    return groups


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[tasks.Problem],
             *, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 128,
             generator: torch.Generator | None = None,
             format_prompt: Callable[[str], str] = tasks.format_prompt) -> dict[str, float]:
    """Held-out accuracy overall and per level (built-in problems; a dataset's have level
    0, none), and ``format``, the share of answers the verifier can read (a ``####`` or
    ``\\boxed{}`` final answer), greedy (``temperature=0``) or sampled at ``temperature``
    (one sample per problem). Correct is ``math_verifier``'s verdict: the last of either
    marker equals the reference (``app.answers``)."""
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    correct: dict[int, list[bool]] = {}
    formatted = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i: i + batch_size]
        prompts = encode_prompts(tokenizer, [format_prompt(p.question) for p in chunk])
        out = sample(model, prompts, params, eos_id=tokenizer.eos_token_id,
                     pad_id=tokenizer.pad_token_id, generator=generator)
        for j, p in enumerate(chunk):
            text = tokenizer.decode(out.completion_ids(j), skip_special_tokens=True)
            correct.setdefault(p.level, []).append(answers.is_correct(text, p.answer))
            formatted += answers.final_answer(text) is not None
    flat = [c for cs in correct.values() for c in cs]
    metrics = {"accuracy": sum(flat) / max(1, len(flat)), "format": formatted / max(1, len(problems))}
    metrics.update({f"accuracy_level{k}": sum(v) / len(v) for k, v in sorted(correct.items()) if k > 0})
    return metrics
