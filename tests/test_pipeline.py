"""The trainer's rollout stream (``llamarl.pipelines.rollouts``) over a real TCPStore, in-process."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from torchdata.nodes import IterableWrapper

from llamarl.app.config import StreamConfig
from llamarl.app.rl.contract import GroupId, Rejections, Rollout, RolloutGroup, to_message
from llamarl.app.rewards import build_reward
from llamarl.app.control.seen_groups import Admission
from llamarl.app.control import slots
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.slots import Settlement, SlotLedger
from llamarl.app.control.transport import Stopped, StoreQueue, host_store
from llamarl.pipelines.rollouts import Gate, Holding, QueueSource, RolloutStream, StalenessFilter
from role_processes import wait_until

SECRET = bytes(range(32))
G = 4  # completions per group


@pytest.fixture()
def queue():
    store = host_store(0, None, timeout_s=30, bind="127.0.0.1")
    return StoreQueue(store, "rollouts", SECRET, maxlen=64)


def make_group(seq: int, version: int, texts: list[str], *, answer: float | None = 7.0,
               replica: int = 0) -> RolloutGroup:
    """G rollouts of one prompt, as a generator makes them (``rl.generate_groups``)."""
    task = {"solution": "3 + 4 = 7", "level": 1}
    if answer is not None:
        task["answer"] = answer
    gid = GroupId(replica, seq)
    return RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[5, 6, 7], completion_ids=list(range(i + 1)),
                behaviour_logprobs=[-0.5 - 0.25 * i] * (i + 1), version=version, group_id=gid,
                prompt="Q: Ann has 3 apples and gets 4 more.", completion=text, task=task)
        for i, text in enumerate(texts)])


def message(seq: int, version: int, n_correct: int = 1, *, replica: int = 0,
            answer: float | None = 7.0) -> dict:
    texts = ["3 + 4 = 7\n#### 7"] * n_correct + ["#### 8"] * (G - n_correct)
    return to_message(make_group(seq, version, texts, answer=answer, replica=replica))


def never() -> bool:
    return False


def settlement(queue: StoreQueue, max_staleness: int, rejections: Rejections,
               emitted: list[dict] | None = None) -> Settlement:
    """One trainer rank's slot settlement, its records in the queue's store."""
    return Settlement(SignedStore(queue.store, SECRET, "trainer/0"), rank=0, world=1, ledger=SlotLedger(),
                      max_staleness=max_staleness, rejections=rejections,
                      emit=(emitted if emitted is not None else []).extend)


@pytest.fixture()
def stream_over():
    """Makes rollout streams over a queue and closes every one after the test: a stream's
    worker thread left inside a store call at interpreter exit aborts the test process."""
    made: list[RolloutStream] = []

    def make(queue, *, rejections: Rejections | None = None, settlement_: Settlement | None = None,
             reward="math_verifier", admit=None, health=None, should_stop=never, **overrides) -> RolloutStream:
        rejections = rejections or Rejections("test")
        config = StreamConfig(**{**dict(reward_timeout_s=10.0, groups_per_batch=2, max_staleness=1, timeout_s=5.0),
                                 **overrides})
        made.append(RolloutStream(queue, config, reward=build_reward(reward) if reward else None,
                                  settlement=settlement_ or settlement(queue, config.max_staleness, rejections),
                                  rejections=rejections, should_stop=should_stop, admit=admit, health=health))
        return made[-1]

    yield make
    for stream in made:
        stream.close()


# --------------------------------------------------------------------------- QueueSource

def test_queue_source_pops_the_oldest_version_first(queue):
    for slot, version in enumerate([2, 0, 3, 1, 0]):
        queue.push(message(slot, version), timeout_s=5)
    source = QueueSource(queue, timeout_s=5, should_stop=never, rejections=Rejections("test"))
    source.reset()
    got = [(g.version, g.group_id.seq) for g in (next(source) for _ in range(5))]
    # By version; among equal versions in arrival order.
    assert got == [(0, 1), (0, 4), (1, 3), (2, 0), (3, 2)]


def test_queue_source_times_out_naming_the_queue(queue):
    source = QueueSource(queue, timeout_s=0.2, should_stop=never, rejections=Rejections("test"))
    source.reset()
    with pytest.raises(TimeoutError, match=r"queue 'rollouts'.*0\.2 s"):
        next(source)


def test_queue_source_stops_when_asked(queue):
    source = QueueSource(queue, timeout_s=30, should_stop=lambda: True, rejections=Rejections("test"))
    source.reset()
    with pytest.raises(Stopped):
        next(source)


def test_the_stream_checks_health_while_it_waits_and_raises_its_error_as_it_was(queue, stream_over):
    """A producer that died is noticed while the trainer is blocked in ``next_batch``, and
    the error reaches it as raised, not re-wrapped by torchdata's prefetch thread."""
    class ProducerGone(RuntimeError):
        pass

    checks: list[float] = []

    def health() -> None:
        checks.append(time.monotonic())
        if len(checks) == 3:
            raise ProducerGone("no heartbeat for 10 s from reward/0")

    stream = stream_over(queue, health=health, timeout_s=600.0)
    with pytest.raises(ProducerGone) as caught:
        stream.next_batch(0)
    assert str(caught.value) == "no heartbeat for 10 s from reward/0"
    assert len(checks) == 3


def test_the_stream_does_not_check_health_while_rollouts_flow(queue, stream_over):
    calls: list[int] = []
    for slot in range(2):
        queue.push(message(slot, 0), timeout_s=5)
    stream = stream_over(queue, health=lambda: calls.append(1))
    assert len(stream.next_batch(0)) == 2
    assert calls == []


# --------------------------------------------------------------------------- StalenessFilter

def test_staleness_filter_drops_and_reports_groups_over_the_bound():
    groups = [make_group(i, v, ["#### 7"] * G) for i, v in enumerate([3, 1, 2, 0, 3])]
    dropped: list[tuple[int, int]] = []
    node = StalenessFilter(IterableWrapper(groups), max_staleness=1, current_version=lambda: 3,
                           on_drop=lambda group, lag: dropped.append((group.group_id.seq, lag)))
    node.reset()
    kept = [g.group_id.seq for g in node]
    assert kept == [0, 2, 4]  # versions 3, 2, 3: lag <= 1
    assert dropped == [(1, 2), (3, 3)]


def test_staleness_filter_counts_an_episodes_oldest_segment():
    """An episode of version 3 whose first turn was sampled at version 1 is 2 behind at 3."""
    episode = make_group(0, 3, ["#### 7"] * G)
    for r in episode.rollouts:
        r.segment_versions = torch.tensor([1])
    dropped: list[int] = []
    node = StalenessFilter(IterableWrapper([episode, make_group(1, 3, ["#### 7"] * G)]), max_staleness=1,
                           current_version=lambda: 3, on_drop=lambda g, lag: dropped.append(lag))
    node.reset()
    assert [g.group_id.seq for g in node] == [1] and dropped == [2]


def test_staleness_filter_reads_the_version_when_the_group_is_taken():
    """The bound is checked at consumption time: the version moves between groups."""
    version = {"now": 0}
    groups = [make_group(i, 0, ["#### 7"] * G) for i in range(3)]
    dropped: list[int] = []
    node = StalenessFilter(IterableWrapper(groups), max_staleness=0,
                           current_version=lambda: version["now"], on_drop=lambda g, lag: dropped.append(lag))
    node.reset()
    assert next(node).group_id.seq == 0
    version["now"] = 1
    with pytest.raises(StopIteration):
        next(node)
    assert dropped == [1, 1]


# --------------------------------------------------------------------------- the full stream

def test_rollout_stream_scores_settles_batches_and_filters(queue, stream_over):
    emitted: list[dict] = []
    sent = [message(0, 2, n_correct=1), message(1, 0, n_correct=2),  # seq 1: too stale
            message(2, 1, n_correct=3), message(3, 2, answer=None),  # seq 3: every reward raises
            message(4, 2, n_correct=0), message(5, 1, n_correct=4, replica=1)]
    for msg in sent:
        queue.push(msg, timeout_s=5)
    rejections = Rejections("test")
    settled = settlement(queue, 1, rejections, emitted)
    stream = stream_over(queue, rejections=rejections, settlement_=settled)
    batches = [stream.next_batch(2) for _ in range(2)]
    assert all(len(b) == 2 for b in batches), "groups_per_batch groups per batch"
    groups = {g.group_id.seq: g for b in batches for g in b}
    # Oldest version first: seq 1 (v0, dropped), seq 2 and 5 (v1), then seq 0 and 3.
    assert [[g.group_id for g in b] for b in batches] == [[(0, 2), (1, 5)], [(0, 0), (0, 3)]]
    assert settled.dropped == 1, "seq 1, settled as dropped with the first batch"
    assert [(e["step"], e["version"], e["staleness"]) for e in emitted] == [(3, 0, 2)] * G
    for seq, g in groups.items():
        assert len(g.rollouts) == G and {r.group_id for r in g.rollouts} == {g.group_id}
        if seq == 3:  # quarantined: no reward, no advantage, so the trainer leaves them out
            assert all(r.reward is None and r.advantage is None for r in g.rollouts)
            continue
        rewards = [r.reward for r in g.rollouts]
        mean = sum(rewards) / G
        assert all(r.advantage == pytest.approx(r.reward - mean) for r in g.rollouts)
        assert math.isclose(sum(r.advantage for r in g.rollouts), 0.0, abs_tol=1e-6)
    assert [r.reward for r in groups[2].rollouts] == [1.0, 1.0, 1.0, 0.0]
    assert [r.reward for r in groups[0].rollouts] == [1.0, 0.0, 0.0, 0.0]
    assert [r.advantage for r in groups[5].rollouts] == [0.0] * G  # all correct: no signal
    trained = [r for b in batches for g in b for r in g.rollouts if r.reward is not None]
    assert len(trained) == 3 * G


def test_a_batch_comes_settled_without_a_second_copy_of_a_consumed_slot(queue, stream_over):
    """Slot 9 was trained; its twin (a lost executor's group that got out, and the
    regenerated one) arrives with slot 10's group: the batch the trainer gets holds slot
    10 only, and the twin is counted."""
    rejections = Rejections("test")
    settled = settlement(queue, 1, rejections)
    settled.ledger.consume(9)
    for seq, slot in enumerate([9, 10]):
        group = make_group(seq, 0, ["#### 7"] * G)
        group.slot = slot
        queue.push(to_message(group), timeout_s=5)
    stream = stream_over(queue, rejections=rejections, settlement_=settled)
    assert [g.slot for g in stream.next_batch(0)] == [10]
    assert settled.duplicates == 1 and settled.ledger.state_dict() == {"frontier": 0, "done": [9, 10]}


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_two_ranks_on_one_queue_each_get_their_share_of_a_step(queue, stream_over, max_staleness):
    """Two trainer ranks pop the same queue, 2 groups each per step. In a synchronous run
    the generators make exactly one step's groups (4) and wait for the step to train; with
    staleness 1, two steps' (8). Neither rank may take what the other needs: before the
    holding cap, the first rank's lookahead took all of them and the second waited in vain."""
    groups_per_step = 4
    for seq in range((1 + max_staleness) * groups_per_step):
        queue.push(message(seq, 0), timeout_s=5)
    first, second = (stream_over(queue, groups_per_batch=2, max_staleness=max_staleness, ranks=2,
                                 timeout_s=3.0) for _ in range(2))
    got_first = first.next_batch(0)
    time.sleep(0.5)  # the first rank's prefetch thread runs on: it must stop at its cap
    got_second = second.next_batch(0)
    seqs = [g.group_id.seq for g in got_first + got_second]
    assert len(seqs) == 4 and len(set(seqs)) == 4


def test_holding_counts_and_waits_for_room():
    holding = Holding(cap=2)
    holding.take(2)
    assert holding.room() == 0 and not holding.wait_for_room(0.05)
    threading.Timer(0.05, holding.release).start()
    assert holding.wait_for_room(5.0) and holding.room() == 1
    with pytest.raises(ValueError, match="at least one group"):
        Holding(cap=0)


def test_rollout_stream_reads_scores_attached_by_a_reward_executor(queue, stream_over):
    group = make_group(0, 0, ["3 + 4 = 7\n#### 7"] * 2 + ["#### 8"] * 2)
    group.attach(build_reward("math_verifier").score([r.sample() for r in group.rollouts]))
    queue.push(to_message(group), timeout_s=5)
    stream = stream_over(queue, reward=None, reward_timeout_s=None, groups_per_batch=1,
                         max_staleness=0, normalize_std=True)
    (got,) = stream.next_batch(0)
    assert [r.reward for r in got.rollouts] == [1.0, 1.0, 0.0, 0.0]
    # normalize_std: (r - mean) / std with the population std (0.5 here)
    assert [r.advantage for r in got.rollouts] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-4)


def test_rollout_stream_drops_and_counts_bad_messages_and_goes_on(queue, stream_over):
    """Garbage frames, frames under another secret and messages that break the contract
    (missing field, wrong type, log-probs vs tokens) are dropped and counted by reason;
    the good groups around them are trained on."""
    missing = message(1, 0)
    del missing["prompt_ids"]
    wrong_type = message(2, 0)
    wrong_type["version"] = "0"
    short_logprobs = message(3, 0)
    short_logprobs["logprobs"][2] = short_logprobs["logprobs"][2][:-1]
    unscored_ok = message(4, 0)
    queue.push(message(0, 0), timeout_s=5)
    for bad in (missing, wrong_type, short_logprobs):
        queue.push(bad, timeout_s=5)
    queue.store.queue_push(queue.key, b"not a frame at all")
    StoreQueue(queue.store, queue.name, bytes(32), maxlen=64).push(message(9, 0), timeout_s=5)
    queue.push(unscored_ok, timeout_s=5)
    rejections = Rejections("test")
    stream = stream_over(queue, rejections=rejections, groups_per_batch=2, max_staleness=0)
    (first, second) = stream.next_batch(0)
    assert [first.group_id.seq, second.group_id.seq] == [0, 4]
    assert dict(rejections.counts) == {"missing_field": 1, "wrong_type": 1, "wrong_length": 1,
                                       "malformed_frame": 1, "bad_tag": 1}


def test_rollout_stream_refuses_a_replay_and_a_future_version_before_batching(queue, stream_over):
    """A second copy of a group and a group from a version the trainer has not published
    are counted and take no place in a batch: the batch is made of the next good groups."""
    for msg in (message(0, 0), message(0, 0), message(1, 5), message(2, 0)):
        queue.push(msg, timeout_s=5)
    rejections = Rejections("test")
    stream = stream_over(queue, rejections=rejections, groups_per_batch=2, max_staleness=0,
                         admit=Admission(current_version=lambda: 0))
    assert [g.group_id.seq for g in stream.next_batch(0)] == [0, 2]
    assert dict(rejections.counts) == {"replay": 1, "future_version": 1}


def test_rollout_stream_surfaces_a_silent_queue(queue, stream_over):
    stream = stream_over(queue, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="rollouts"):
        stream.next_batch(0)


def test_rejected_messages_do_not_reset_the_silence_deadline(queue, stream_over):
    """A stream fed only garbage still reports its producers silent."""
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            queue.store.queue_push(queue.key, b"garbage")
            time.sleep(0.01)

    feeder = threading.Thread(target=flood)
    feeder.start()
    try:
        with pytest.raises(TimeoutError, match="rollouts"):
            stream_over(queue, timeout_s=0.5).next_batch(0)
    finally:
        stop.set()
        feeder.join(5)


# --------------------------------------------------------------------------- closing the stream

def test_closing_the_stream_stops_its_worker_thread_polling_the_store(queue, stream_over):
    """After close() the prefetcher's daemon thread never touches the store again (one
    caught inside a store call at interpreter exit aborts the process)."""
    stream = stream_over(queue, reward_timeout_s=1.0, groups_per_batch=1, max_staleness=0,
                         timeout_s=600.0)
    queue.push(message(0, 0, n_correct=1), timeout_s=5)
    stream.next_batch(0)  # the worker thread now waits on the empty queue for up to 600 s
    stream.close()
    stream.close()  # twice is fine
    queue.push(message(1, 0, n_correct=1), timeout_s=5)
    time.sleep(0.3)  # ample time for a live poller (it polls every <= 10 ms) to take it
    assert queue.depth() == 1, "a closed stream popped a message"
    with pytest.raises(Stopped, match="closed"):
        stream.next_batch(0)


def test_gate_waits_for_the_stage_inside_it_and_then_stays_shut():
    gate, inside, release = Gate(), threading.Event(), threading.Event()

    def stage() -> None:
        with gate:
            inside.set()
            release.wait(30)

    worker = threading.Thread(target=stage)
    worker.start()
    inside.wait(30)
    with pytest.raises(TimeoutError, match="still busy"):
        gate.close(timeout_s=0.1)  # the stage is still inside
    release.set()
    gate.close(timeout_s=30)
    worker.join(30)
    with pytest.raises(StopIteration):
        with gate:
            pass


def test_groups_the_stream_received_are_the_trainer_ranks_until_settled(queue, stream_over):
    """A batch may wait long for its last group: the groups it has are held by this
    trainer rank (``names.held_key``), so the overdue watcher leaves them alone; a group
    dropped unscored is not held any more; settled, none is."""
    def scored(slot: int, *, with_scores: bool = True) -> dict:
        group = make_group(slot, 0, ["3 + 4 = 7\n#### 7"] + ["#### 8"] * (G - 1))
        group.slot = slot
        if with_scores:
            group.attach(build_reward("math_verifier").score([r.sample() for r in group.rollouts]))
        return to_message(group)

    held = lambda: slots.held_by(SignedStore(queue.store, SECRET, CONTROLLER), "trainer/0")  # noqa: E731
    stream = stream_over(queue, reward=None, reward_timeout_s=None, groups_per_batch=3, max_staleness=0,
                         timeout_s=60.0)
    for msg in (scored(0), scored(1), scored(2, with_scores=False)):
        queue.push(msg, timeout_s=5)
    batch: list[RolloutGroup] = []
    waiting = threading.Thread(target=lambda: batch.extend(stream.next_batch(0)), daemon=True)
    waiting.start()
    wait_until(lambda: held() == [0, 1] and queue.depth() == 0, "slots 0 and 1 held, slot 2 dropped unscored")
    assert not batch, "the batch still waits for its third group"
    queue.push(scored(3), timeout_s=5)
    waiting.join(timeout=60)
    assert [g.slot for g in batch] == [0, 1, 3]
    assert held() == [], "settled: in the ledger, no longer held"
