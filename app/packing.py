"""The trainer's forward pass over packed rollouts: no completion padded to the longest.

``rl.completion_logprobs`` (the padded pass) runs a micro-batch as two padded batches:
the prompts, left-padded to the longest, then every completion on top of its prompt's KV
cache, right-padded to the longest completion. With completions of very different
lengths (a few tokens to ``max_new_tokens``) most of the second batch is padding.

``packed_completion_logprobs`` runs one forward pass over *packed rows*: one row per
prompt of the micro-batch, holding the prompt once and then each of its completions
back to back (all but the last token of each: the last one is predicted, never fed).
A block mask lets each completion attend to the prompt and to its own earlier tokens
only, and its position ids continue after the prompt, so every token sees exactly what
it sees in the padded pass (or in its own unpadded sequence): the log-probs are the
same up to float rounding. A row's only padding is at its end, up to the longest row.
Logits are computed only at the positions that predict a completion token (the prompt's
last position predicts every completion's first token).

Price: the mask is a dense ``(rows, 1, L, L)`` additive tensor and attention runs over
whole rows (L = a prompt plus its completions), so the attention's cost grows with the
square of a row's length; the matmuls, which dominate at short rows, shrink with the
padding. The model's attention must take a 4-D additive mask (Hugging Face's ``eager``
and ``sdpa`` do; ``flash_attention_2`` does not: use ``--trainer-pass padded``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from app.contract import Rollout
from app.sampling import token_logprobs


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch laid out in packed rows (R rows of L tokens)."""

    ids_RL: torch.Tensor
    position_RL: torch.Tensor
    segment_RL: torch.Tensor
    """0 for a prompt token, k + 1 for a token of the row's k-th completion, -1 padding."""
    keep_RL: torch.Tensor
    """The positions whose logits predict a completion token."""
    index_BT: torch.Tensor
    """For completion token t of rollout b: its logits' index among the kept positions
    (row-major); 0 past the completion's end (masked out by the caller)."""
    real_tokens: int
    """Tokens fed that are not padding."""


def pack(rollouts: list[Rollout], *, pad_id: int, device: torch.device) -> PackedRows:
    """One row per distinct prompt of ``rollouts``, in order of first appearance."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for b, r in enumerate(rollouts):
        rows.setdefault(tuple(r.prompt_ids), []).append(b)
    lengths = [len(p) + sum(len(rollouts[b].completion_ids) - 1 for b in bs) for p, bs in rows.items()]
    R, L = len(rows), max(lengths)
    T = max(len(r.completion_ids) for r in rollouts)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    position = torch.zeros((R, L), dtype=torch.long)
    segment = torch.full((R, L), -1, dtype=torch.long)
    keep = torch.zeros((R, L), dtype=torch.bool)
    where_BT = torch.zeros((len(rollouts), T), dtype=torch.long)  # flat position u * L + i
    for u, (prompt, members) in enumerate(rows.items()):
        P = len(prompt)
        ids[u, :P] = torch.tensor(prompt)
        position[u, :P] = torch.arange(P)
        segment[u, :P] = 0
        keep[u, P - 1] = True
        start = P
        for k, b in enumerate(members):
            fed = rollouts[b].completion_ids[:-1]
            n = len(fed)
            ids[u, start: start + n] = torch.tensor(fed, dtype=torch.long)
            position[u, start: start + n] = torch.arange(P, P + n)
            segment[u, start: start + n] = k + 1
            keep[u, start: start + n] = True
            # Token 0 is predicted at the prompt's last position, token t at fed token t - 1.
            where_BT[b, 0] = u * L + P - 1
            where_BT[b, 1: n + 1] = u * L + torch.arange(start, start + n)
            start += n
    kept_index = keep.flatten().cumsum(0) - 1  # flat position -> index among kept positions
    return PackedRows(ids_RL=ids.to(device), position_RL=position.to(device), segment_RL=segment.to(device),
                      keep_RL=keep.to(device), index_BT=kept_index[where_BT].clamp(min=0).to(device),
                      real_tokens=sum(lengths))


def block_mask(segment_RL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``(R, 1, L, L)`` mask: a query sees earlier keys of the prompt and of
    its own segment. Padding queries see the prompt and the padding (never a fully
    masked row, whose softmax would be NaN); nothing real sees them."""
    L = segment_RL.shape[1]
    causal_LL = torch.ones((L, L), dtype=torch.bool, device=segment_RL.device).tril()
    q_RL1, k_R1L = segment_RL[:, :, None], segment_RL[:, None, :]
    allowed_RLL = causal_LL & ((k_R1L == 0) | (k_R1L == q_RL1))
    mask = torch.zeros(allowed_RLL.shape, dtype=dtype, device=segment_RL.device)
    return mask.masked_fill_(~allowed_RLL, torch.finfo(dtype).min)[:, None]


def packed_completion_logprobs(model: PreTrainedModel, rollouts: list[Rollout], *, pad_id: int,
                               temperature: float = 1.0, top_p: float = 1.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``rl.completion_logprobs`` returns, ``(logp_BT, mask_BT)`` right-padded to the
    longest completion, from one forward pass over packed rows (see the module)."""
    param = next(model.parameters())
    rows = pack(rollouts, pad_id=pad_id, device=param.device)
    mask_4d = block_mask(rows.segment_RL, param.dtype if param.dtype.is_floating_point else torch.float32)
    kept_NV = model(input_ids=rows.ids_RL, attention_mask=mask_4d, position_ids=rows.position_RL,
                    logits_to_keep=rows.keep_RL, use_cache=False).logits.reshape(-1, model.config.vocab_size)
    T = rows.index_BT.shape[1]
    targets_BT = torch.full((len(rollouts), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rollouts), T), dtype=torch.float32)
    for b, r in enumerate(rollouts):
        targets_BT[b, : len(r.completion_ids)] = torch.tensor(r.completion_ids)
        mask_BT[b, : len(r.completion_ids)] = 1
    targets_BT, mask_BT = targets_BT.to(param.device), mask_BT.to(param.device)
    logp_BT = token_logprobs(kept_NV[rows.index_BT], targets_BT, temperature, top_p)
    return logp_BT * mask_BT, mask_BT


def padded_tokens(rollouts: list[Rollout]) -> int:
    """Token slots the padded pass feeds for this micro-batch: its distinct prompts padded
    to the longest, then every completion but its last token padded to the longest."""
    prompts = {tuple(r.prompt_ids) for r in rollouts}
    T = max(2, max(len(r.completion_ids) for r in rollouts))
    return len(prompts) * max(len(p) for p in prompts) + len(rollouts) * (T - 1)
