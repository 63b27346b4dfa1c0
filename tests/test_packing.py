"""The packed trainer pass (llamarl.app.rl.packing): the layout of a small micro-batch derived by
hand, and the same log-probs, gradients and training step as the padded pass.

Tolerance: both passes compute every token's log-prob from the same keys and values;
only the shapes of the matmuls differ (rows of other lengths), hence the float32
summation order: 1e-5 relative is ~100 ulps, where a token attending to a wrong key
(another completion, padding) or a shifted position moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from llamarl.app.rl import packing
from llamarl.app.rl import step as rl
from llamarl.app.rl.contract import GroupId
from tiny_models import PAD, VOCAB, tiny_llama

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


def _rollout(prompt, completion, advantage=1.0, group=0):
    return rl.Rollout(prompt_ids=prompt, completion_ids=completion, behaviour_logprobs=[-2.0] * len(completion),
                      version=0, group_id=GroupId(0, group), advantage=advantage)


def _ragged(seed: int = 0) -> list[rl.Rollout]:
    """3 prompts of 2..4 tokens, 4 completions each of 1..9 tokens (a 1-token one too)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (2 + k,), generator=g).tolist()
        for i in range(4):
            c = 1 + (k * 4 + i * 5) % 9
            out.append(rl.Rollout(prompt_ids=prompt, completion_ids=torch.randint(3, VOCAB, (c,), generator=g).tolist(),
                                  behaviour_logprobs=(-torch.rand(c, generator=g) - 2.5).tolist(), version=0,
                                  group_id=GroupId(0, k), advantage=float(i % 3) - 0.7))
    return out


def test_pack_lays_out_a_micro_batch_as_derived_by_hand():
    # Prompt A = [5, 6] with completions [7, 8, 9] and [10]; prompt B = [11] with [12, 13].
    rs = [_rollout([5, 6], [7, 8, 9]), _rollout([11], [12, 13], group=1), _rollout([5, 6], [10])]
    rows = packing.pack(rs, pad_id=PAD, device=torch.device("cpu"))
    # Row 0: A, then [7, 8] (9 is predicted, never fed), then nothing of [10]. Row 1: B, [12].
    assert rows.ids_RL.tolist() == [[5, 6, 7, 8], [11, 12, PAD, PAD]]
    assert rows.position_RL.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert rows.block_RL.tolist() == [[0, 0, 0, 0], [1, 1, -1, -1]]
    assert rows.segment_RL.tolist() == [[0, 0, 1, 1], [0, 1, -1, -1]]
    assert rows.keep_RL.tolist() == [[False, True, True, True], [True, True, False, False]]
    assert rows.real_tokens == 6
    # Kept positions, row-major: 0 = A's last, 1 = after 7, 2 = after 8, 3 = B's last, 4 = after 12.
    assert rows.index_BT.tolist() == [[0, 1, 2], [3, 4, 0], [0, 0, 0]]
    mask = packing.block_mask(rows, torch.float32)[:, 0] == 0
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # The padding sees the padding before it, nothing else; nothing sees it.
    assert mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    # The padded pass: 2 prompts padded to 2, then 3 completions padded to 3 - 1 columns.
    assert packing.padded_tokens(rs) == 2 * 2 + 3 * 2


def test_short_blocks_share_a_row_and_never_see_each_other():
    # Blocks: A = [5, 6] + [7, 8] (4 tokens), B = [11] + [12] (2), C = [14] + [15] (2).
    # Rows of 4, longest first: [A], then B and C side by side.
    rs = [_rollout([11], [12, 13], group=1), _rollout([5, 6], [7, 8, 9]), _rollout([14], [15, 16], group=2)]
    rows = packing.pack(rs, pad_id=PAD, device=torch.device("cpu"))
    assert rows.ids_RL.tolist() == [[5, 6, 7, 8], [11, 12, 14, 15]]
    assert rows.position_RL.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]], "positions restart with each block"
    assert rows.block_RL.tolist() == [[1, 1, 1, 1], [0, 0, 2, 2]]
    assert rows.segment_RL.tolist() == [[0, 0, 1, 1], [0, 1, 0, 2]]
    # Kept: A's last, after 7, after 8 | B's last, after 12, C's last, after 15.
    assert rows.index_BT.tolist() == [[3, 4, 0], [0, 1, 2], [5, 6, 0]]
    mask = packing.block_mask(rows, torch.float32)[1, 0] == 0
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert rows.real_tokens == 8


def test_completions_of_one_prompt_do_not_see_each_other():
    rs = [_rollout([5, 6], [7, 8, 9]), _rollout([5, 6], [10, 11, 12])]
    mask = packing.block_mask(packing.pack(rs, pad_id=PAD, device=torch.device("cpu")), torch.float32)[0, 0] == 0
    # Row: 5 6 | 7 8 | 10 11. Token 10 sees the prompt and itself, not 7 or 8.
    assert mask[4].int().tolist() == [1, 1, 0, 0, 1, 0]
    assert mask[5].int().tolist() == [1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_packed_log_probs_and_gradients_equal_the_padded_pass(tiny_model, temperature, top_p):
    rs = _ragged()
    grads = []
    values = []
    for fn in (rl.completion_logprobs, packing.packed_completion_logprobs):
        model = copy.deepcopy(tiny_model)
        logp_BT, mask_BT = fn(model, rs, pad_id=PAD, temperature=temperature, top_p=top_p)
        (logp_BT * torch.linspace(-1, 1, logp_BT.numel()).view_as(logp_BT)).sum().backward()
        values.append((logp_BT, mask_BT))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    (padded, padded_mask), (packed, packed_mask) = values
    T = max(len(r.completion_ids) for r in rs)
    assert packed.shape == (len(rs), T) and torch.equal(packed_mask, padded_mask[:, :T])
    torch.testing.assert_close(packed, padded[:, :T], **TOL)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, **TOL, msg=name)


def test_a_packed_training_step_is_the_padded_one(tiny_model):
    rs = _ragged(seed=1)
    after = []
    for trainer_pass in ("padded", "packed"):
        model = copy.deepcopy(tiny_model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient
        cfg = rl.StepConfig(micro_batch=5, kl_coef=0.1, trainer_pass=trainer_pass)
        m = rl.train_step(model, optimizer, rs, cfg, pad_id=PAD, ref_model=copy.deepcopy(tiny_model))
        after.append((m, dict(model.named_parameters())))
    (m_padded, padded), (m_packed, packed) = after
    assert sorted(m_padded) == sorted(m_packed)
    for k, v in m_padded.items():
        assert m_packed[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for name, p in padded.items():
        torch.testing.assert_close(packed[name], p, **TOL, msg=name)


def test_step_config_refuses_an_unknown_pass():
    with pytest.raises(ValueError, match="trainer_pass"):
        dataclasses.replace(rl.StepConfig(), trainer_pass="ragged")
