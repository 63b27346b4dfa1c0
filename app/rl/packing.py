"""The trainer's forward pass over packed rollouts: no completion padded to the longest.

``rl.completion_logprobs`` (the padded pass) runs a micro-batch as two padded batches:
the prompts, left-padded to the longest, then every completion on top of its prompt's KV
cache, right-padded to the longest completion. With completions of very different
lengths (a few tokens to ``max_new_tokens``) most of the second batch is padding.

``packed_completion_logprobs`` runs one forward pass over *packed rows*. Each prompt of
the micro-batch makes one *block*: the prompt once, then each of its completions back
to back (all but the last token of each: the last one is predicted, never fed). Blocks
go into rows as long as the longest block (first fit, longest first), so short blocks
share a row. A mask lets each completion attend to its prompt and to its own earlier
tokens only (nothing across blocks), and its position ids continue after the prompt,
so every token sees exactly what it sees in the padded pass (or in its own unpadded
sequence): the log-probs are the same up to float rounding. A row's only padding is at
its end.
Logits are computed only at the positions that predict a completion token (the prompt's
last position predicts every completion's first token).

Price: the mask is a dense ``(rows, 1, L, L)`` additive tensor and attention runs over
whole rows (L: the longest block, a prompt and its completions), so the attention's cost
grows with the square of L; the matmuls, which dominate at short rows, shrink with the
padding. The model's attention must take a 4-D additive mask (Hugging Face's ``eager``
and ``sdpa`` do; ``flash_attention_2`` does not: use ``--trainer-pass padded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedModel

from llamarl.app.rl.contract import Rollout
from llamarl.app.sampling import token_logprobs


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch laid out in packed rows (R rows of L tokens)."""

    ids_RL: torch.Tensor
    position_RL: torch.Tensor
    block_RL: torch.Tensor
    """Which prompt's block a token belongs to (the prompt's index), -1 padding."""
    segment_RL: torch.Tensor
    """0 for a prompt token, k for a token of the row's k-th completion (from 1), -1 padding."""
    keep_RL: torch.Tensor
    """The positions whose logits predict a completion token."""
    index_BT: torch.Tensor
    """For completion token t of rollout b: its logits' index among the kept positions
    (row-major); 0 past the completion's end (masked out by the caller)."""
    real_tokens: int
    """Tokens fed that are not padding."""


def prompt_key(r: Rollout) -> bytes:
    """``r``'s prompt as a hashable key, read from its tensor: equal keys are equal
    prompts, and prompts of one length sort by key as their id lists do (big-endian bytes
    of ids >= 0)."""
    return r.prompt_ids.numpy().astype(">i8").tobytes()


def right_padded(rows: Sequence[torch.Tensor], T: int, fill: float | int | bool) -> torch.Tensor:
    """1-D ``rows`` (each at most ``T`` long) as one ``(len(rows), T)`` tensor, each row
    right-padded with ``fill``: one concatenation and one masked write."""
    lengths_B = torch.tensor([len(r) for r in rows])
    out = torch.full((len(rows), T), fill, dtype=rows[0].dtype)
    out[torch.arange(T) < lengths_B[:, None]] = torch.cat(list(rows))
    return out


def completion_rows(rollouts: list[Rollout], T: int, *, pad_id: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(targets_BT, real_BT, mask_BT)`` of ``rollouts``' completions right-padded to
    ``T``: the token ids (``pad_id`` after the end), where a token is (bool: what the
    model attends to) and where a token carries loss (float 1/0: the policy's tokens,
    ``policy_mask``; an environment's token is fed and attended to, never scored)."""
    targets_BT = right_padded([r.completion_ids for r in rollouts], T, pad_id)
    real_BT = torch.arange(T) < torch.tensor([len(r.completion_ids) for r in rollouts])[:, None]
    mask_BT = right_padded([r.policy_mask for r in rollouts], T, False).float()
    return targets_BT.to(device), real_BT.to(device), mask_BT.to(device)


def _rows(lengths: list[int]) -> list[list[int]]:
    """Prompt blocks (by index) into rows as long as the longest block, first fit in
    order of decreasing length: short blocks share a row instead of each padding one."""
    capacity = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        row = next((u for u, free in enumerate(room) if free >= lengths[j]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(j)
        room[row] -= lengths[j]
    return rows


def pack(rollouts: list[Rollout], *, pad_id: int, device: torch.device) -> PackedRows:
    """A *block* per distinct prompt of ``rollouts`` (the prompt, then its completions),
    blocks placed into rows by ``_rows``."""
    blocks: dict[bytes, list[int]] = {}
    for b, r in enumerate(rollouts):
        blocks.setdefault(prompt_key(r), []).append(b)
    members = list(blocks.values())
    prompts = [rollouts[bs[0]].prompt_ids for bs in members]
    lengths = [len(p) + sum(len(rollouts[b].completion_ids) - 1 for b in bs) for p, bs in zip(prompts, members)]
    rows = _rows(lengths)
    R, L = len(rows), max(lengths)
    T = max(len(r.completion_ids) for r in rollouts)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    position = torch.zeros((R, L), dtype=torch.long)
    block = torch.full((R, L), -1, dtype=torch.long)
    segment = torch.full((R, L), -1, dtype=torch.long)
    keep = torch.zeros((R, L), dtype=torch.bool)
    where_BT = torch.zeros((len(rollouts), T), dtype=torch.long)  # flat position u * L + i
    for u, row in enumerate(rows):
        start, completions = 0, 0
        for j in row:
            prompt = prompts[j]
            P, first = len(prompt), start
            ids[u, start: start + P] = prompt
            position[u, start: start + P] = torch.arange(P)
            block[u, start: start + lengths[j]] = j
            segment[u, start: start + P] = 0
            keep[u, start + P - 1] = True
            start += P
            for b in members[j]:
                fed = rollouts[b].completion_ids[:-1]
                n = len(fed)
                completions += 1
                ids[u, start: start + n] = fed
                position[u, start: start + n] = torch.arange(P, P + n)
                segment[u, start: start + n] = completions
                keep[u, start: start + n] = True
                # Token 0 is predicted at the prompt's last position, token t at fed token t - 1.
                where_BT[b, 0] = u * L + first + P - 1
                where_BT[b, 1: n + 1] = u * L + torch.arange(start, start + n)
                start += n
    kept_index = keep.flatten().cumsum(0) - 1  # flat position -> index among kept positions
    return PackedRows(ids_RL=ids.to(device), position_RL=position.to(device), block_RL=block.to(device),
                      segment_RL=segment.to(device), keep_RL=keep.to(device),
                      index_BT=kept_index[where_BT].clamp(min=0).to(device), real_tokens=sum(lengths))


def block_mask(rows: PackedRows, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``(R, 1, L, L)`` mask: a query sees the earlier keys of its own block
    that are its prompt's or its own completion's. Padding queries see the padding
    before them (never a fully masked row, whose softmax would be NaN); nothing real
    sees them."""
    L = rows.segment_RL.shape[1]
    causal_LL = torch.ones((L, L), dtype=torch.bool, device=rows.segment_RL.device).tril()
    same_block_RLL = rows.block_RL[:, :, None] == rows.block_RL[:, None, :]
    q_RL1, k_R1L = rows.segment_RL[:, :, None], rows.segment_RL[:, None, :]
    allowed_RLL = causal_LL & same_block_RLL & ((k_R1L == 0) | (k_R1L == q_RL1))
    mask = torch.zeros(allowed_RLL.shape, dtype=dtype, device=rows.segment_RL.device)
    return mask.masked_fill_(~allowed_RLL, torch.finfo(dtype).min)[:, None]


def packed_completion_logprobs(model: PreTrainedModel, rollouts: list[Rollout], *, pad_id: int,
                               temperature: float = 1.0, top_p: float = 1.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``rl.completion_logprobs`` returns, ``(logp_BT, mask_BT)`` right-padded to the
    longest completion (``mask_BT``: the policy's tokens), from one forward pass over
    packed rows (see the module)."""
    param = next(model.parameters())
    rows = pack(rollouts, pad_id=pad_id, device=param.device)
    mask_4d = block_mask(rows, param.dtype if param.dtype.is_floating_point else torch.float32)
    kept_NV = model(input_ids=rows.ids_RL, attention_mask=mask_4d, position_ids=rows.position_RL,
                    logits_to_keep=rows.keep_RL, use_cache=False).logits.reshape(-1, model.config.vocab_size)
    targets_BT, _, mask_BT = completion_rows(rollouts, rows.index_BT.shape[1], pad_id=pad_id, device=param.device)
    logp_BT = token_logprobs(kept_NV[rows.index_BT], targets_BT, temperature, top_p)
    return logp_BT * mask_BT, mask_BT


def padded_tokens(rollouts: list[Rollout]) -> int:
    """Token slots the padded pass feeds for this micro-batch: its distinct prompts padded
    to the longest, then every completion but its last token padded to the longest."""
    P = max(len(r.prompt_ids) for r in rollouts)
    T = max(2, max(len(r.completion_ids) for r in rollouts))
    return len({prompt_key(r) for r in rollouts}) * P + len(rollouts) * (T - 1)
