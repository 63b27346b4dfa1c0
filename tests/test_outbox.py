"""A generator's push path in one process: the sampler's finished batch goes on from the
decode loop, cut into groups, each framed into a real store queue by the ``Outbox`` as it
is built (``generate_groups(..., send=...)``), with its slot passed on and the generator's
time split into ``generate`` and ``queue_full`` intervals."""

from __future__ import annotations

import torch

from llamarl.app.control.outbox import Outbox
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.slots import HeldSlots
from llamarl.app.control.transport import StoreQueue, host_store
from llamarl.app.metrics.events import Timeline
from llamarl.app.model import policy
from llamarl.app.rl import step as rl
from llamarl.app.rl.contract import from_message
from llamarl.app.sampling import SamplingParams
from llamarl.app.tasks import arithmetic as tasks

SECRET = bytes(range(32))


def test_each_group_is_framed_and_sent_as_the_sampled_batch_is_cut_into_it():
    model, tok = policy.create_default_policy(seed=0)
    store = host_store(0, None, timeout_s=30, bind="127.0.0.1")
    queue = StoreQueue(store, "rollouts", SECRET, maxlen=8)
    held = HeldSlots(SignedStore(store, SECRET, "generator/0"))
    held.take([7, 9])
    timeline = Timeline("generator", 0)
    outbox = Outbox(queue, held, timeline, should_stop=lambda: False)
    problems = tasks.make_split("train", 2, seed=0)
    same = dict(group_size=2, params=SamplingParams(max_new_tokens=5), version=1, generator_id=0, first_seq=3,
                decoder="eager")
    returned = rl.generate_groups(model, tok, problems, rng=torch.Generator().manual_seed(0), **same)

    outbox.open([7, 9], first_seq=3)
    assert rl.generate_groups(model, tok, problems, rng=torch.Generator().manual_seed(0), send=outbox.send,
                              **same) == []
    outbox.close()

    sent = [from_message(m) for m in queue.pop_many(8, 5.0)]
    assert [(g.group_id, g.slot) for g in sent] == [((0, 3), 7), ((0, 4), 9)]
    for mine, theirs in zip(returned, sent):  # the same draws, whichever way they left the sampler
        for a, b in zip(mine.rollouts, theirs.rollouts):
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert held.slots == []  # both passed on
    tokens = sum(len(r.completion_ids) for g in returned for r in g.rollouts)
    assert (outbox.sent, outbox.rollouts, outbox.tokens) == (2, 4, tokens) and outbox.push_s > 0
    assert [(e["kind"], e["what"]) for e in timeline.drain()] == (
        [("busy", "generate"), ("idle", "queue_full")] * 2 + [("busy", "generate")])
