"""The trainer's rollout stream (``pipelines.rollouts``) over a real TCPStore, in-process."""

from __future__ import annotations

import math
import threading
import time

import pytest
from torchdata.nodes import IterableWrapper

from app.generator import group_message
from app.rewards import Sample, build_reward
from app.rl import Rollout
from app.transport import Stopped, StoreQueue, decode, encode, host_store
from pipelines.rollouts import Gate, QueueSource, RolloutStream, StalenessFilter, group_from_message

SECRET = bytes(range(32))
G = 4  # completions per group


@pytest.fixture()
def queue():
    store = host_store(0, None, timeout_s=30, host="127.0.0.1")
    return StoreQueue(store, "rollouts", SECRET, maxlen=64)


def make_group(slot: int, version: int, texts: list[str], *, answer: float | None = 7.0) -> list[Rollout]:
    """G rollouts of one prompt, as a generator makes them (meta of ``rl.generate_rollouts``)."""
    meta = {"solution": "3 + 4 = 7", "level": 1, "prompt": "Q: Ann has 3 apples and gets 4 more."}
    if answer is not None:
        meta["answer"] = answer
    return [Rollout(prompt_ids=[5, 6, 7], completion_ids=list(range(i + 1)),
                    behaviour_logprobs=[-0.5 - 0.25 * i] * (i + 1), version=version, group=f"slot{slot}",
                    meta={**meta, "completion": text})
            for i, text in enumerate(texts)]


def message(slot: int, version: int, n_correct: int = 1, *, replica: int = 0,
            answer: float | None = 7.0) -> dict:
    texts = ["3 + 4 = 7\n#### 7"] * n_correct + ["#### 8"] * (G - n_correct)
    return group_message(make_group(slot, version, texts, answer=answer), replica)


def never() -> bool:
    return False


# --------------------------------------------------------------------------- messages

def test_group_message_round_trips_through_the_wire_format():
    group = make_group(3, version=5, texts=["#### 7", "#### 1", "no answer", "#### 7.0"])
    msg = decode(encode(group_message(group, replica=1), SECRET), SECRET)
    back = group_from_message(msg)
    assert len(back) == len(group)
    for sent, got in zip(group, back):
        assert got.prompt_ids == sent.prompt_ids
        assert got.completion_ids == sent.completion_ids
        assert got.behaviour_logprobs == sent.behaviour_logprobs  # exact: never recomputed
        assert (got.version, got.group) == (5, "slot3")
        assert got.meta["completion"] == sent.meta["completion"]
        assert got.meta["answer"] == 7.0 and got.meta["prompt"] == sent.meta["prompt"]
        assert got.meta["generator"] == 1
        assert got.reward is None and got.advantage is None


# --------------------------------------------------------------------------- QueueSource

def test_queue_source_pops_the_oldest_version_first(queue):
    for slot, version in enumerate([2, 0, 3, 1, 0]):
        queue.push(message(slot, version), timeout_s=5)
    source = QueueSource(queue, timeout_s=5, should_stop=never)
    source.reset()
    got = [(m["version"], m["group"]) for m in (next(source) for _ in range(5))]
    # By version; among equal versions in arrival order.
    assert got == [(0, "slot1"), (0, "slot4"), (1, "slot3"), (2, "slot0"), (3, "slot2")]


def test_queue_source_times_out_naming_the_queue(queue):
    source = QueueSource(queue, timeout_s=0.2, should_stop=never)
    source.reset()
    with pytest.raises(TimeoutError, match=r"queue 'rollouts'.*0\.2 s"):
        next(source)


def test_queue_source_stops_when_asked(queue):
    source = QueueSource(queue, timeout_s=30, should_stop=lambda: True)
    source.reset()
    with pytest.raises(Stopped):
        next(source)


# --------------------------------------------------------------------------- StalenessFilter

def test_staleness_filter_drops_and_reports_groups_over_the_bound():
    groups = [make_group(i, v, ["#### 7"] * G) for i, v in enumerate([3, 1, 2, 0, 3])]
    dropped: list[tuple[str, int]] = []
    node = StalenessFilter(IterableWrapper(groups), max_staleness=1, current_version=lambda: 3,
                           on_drop=lambda group, lag: dropped.append((group[0].group, lag)))
    node.reset()
    kept = [g[0].group for g in node]
    assert kept == ["slot0", "slot2", "slot4"]  # versions 3, 2, 3: lag <= 1
    assert dropped == [("slot1", 2), ("slot3", 3)]


def test_staleness_filter_reads_the_version_when_the_group_is_taken():
    """The bound is checked at consumption time: the version moves between groups."""
    version = {"now": 0}
    groups = [make_group(i, 0, ["#### 7"] * G) for i in range(3)]
    dropped: list[int] = []
    node = StalenessFilter(IterableWrapper(groups), max_staleness=0,
                           current_version=lambda: version["now"], on_drop=lambda g, lag: dropped.append(lag))
    node.reset()
    assert next(node)[0].group == "slot0"
    version["now"] = 1
    with pytest.raises(StopIteration):
        next(node)
    assert dropped == [1, 1]


# --------------------------------------------------------------------------- the full stream

def test_rollout_stream_scores_batches_and_filters(queue):
    version = {"now": 2}
    dropped: list[tuple[str, int]] = []
    sent = [message(0, 2, n_correct=1), message(1, 0, n_correct=2),  # slot1: too stale
            message(2, 1, n_correct=3), message(3, 2, answer=None),  # slot3: every reward raises
            message(4, 2, n_correct=0), message(5, 1, n_correct=4, replica=1)]
    for msg in sent:
        queue.push(msg, timeout_s=5)
    stream = RolloutStream(queue, reward=build_reward("math_verifier"), reward_timeout_s=10.0,
                           groups_per_batch=2, max_staleness=1, current_version=lambda: version["now"],
                           on_drop=lambda g, lag: dropped.append((g[0].group, lag)),
                           normalize_std=False, should_stop=never, timeout_s=5.0)
    batches = [stream.next_batch() for _ in range(2)]
    assert all(len(b) == 2 for b in batches), "groups_per_batch groups per batch"
    groups = {g[0].group: g for b in batches for g in b}
    # Oldest version first: slot1 (v0, dropped), slot2 and slot5 (v1), then slot0 and slot3.
    assert [[g[0].group for g in b] for b in batches] == [["slot2", "slot5"], ["slot0", "slot3"]]
    assert dropped == [("slot1", 2)]
    for name, g in groups.items():
        assert len(g) == G and len({r.group for r in g}) == 1, "a group never straddles batches"
        if name == "slot3":  # quarantined: no reward, no advantage, so the trainer leaves them out
            assert all(r.reward is None and r.advantage is None for r in g)
            continue
        rewards = [r.reward for r in g]
        mean = sum(rewards) / G
        assert all(r.advantage == pytest.approx(r.reward - mean) for r in g)
        assert math.isclose(sum(r.advantage for r in g), 0.0, abs_tol=1e-6)
    assert [r.reward for r in groups["slot2"]] == [1.0, 1.0, 1.0, 0.0]
    assert [r.reward for r in groups["slot0"]] == [1.0, 0.0, 0.0, 0.0]
    assert [r.advantage for r in groups["slot5"]] == [0.0] * G  # all correct: no signal
    trained = [r for b in batches for g in b for r in g if r.reward is not None]
    assert len(trained) == 3 * G


def test_rollout_stream_reads_scores_attached_by_a_reward_executor(queue):
    reward = build_reward("math_verifier")
    msg = message(0, 0, n_correct=2)
    results = reward.score([Sample(prompt=msg["meta"]["prompt"], completion=t, meta=msg["meta"])
                            for t in msg["texts"]])
    msg["results"] = [r.to_dict() for r in results]
    queue.push(msg, timeout_s=5)
    stream = RolloutStream(queue, reward=None, reward_timeout_s=None, groups_per_batch=1,
                           max_staleness=0, current_version=lambda: 0, on_drop=lambda g, lag: None,
                           normalize_std=True, should_stop=never, timeout_s=5.0)
    (group,) = stream.next_batch()
    assert [r.reward for r in group] == [1.0, 1.0, 0.0, 0.0]
    # normalize_std: (r - mean) / std with the population std (0.5 here)
    assert [r.advantage for r in group] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-4)


def test_rollout_stream_surfaces_a_silent_queue(queue):
    stream = RolloutStream(queue, reward=build_reward("math_verifier"), reward_timeout_s=10.0,
                           groups_per_batch=2, max_staleness=1, current_version=lambda: 0,
                           on_drop=lambda g, lag: None, normalize_std=False, should_stop=never,
                           timeout_s=0.3)
    with pytest.raises(TimeoutError, match="rollouts"):
        stream.next_batch()


# --------------------------------------------------------------------------- closing the stream

def test_closing_the_stream_stops_its_worker_thread_polling_the_store(queue):
    """After close() the prefetcher's daemon thread never touches the store again (one
    caught inside a store call at interpreter exit aborts the process)."""
    stream = RolloutStream(queue, reward=build_reward("math_verifier"), reward_timeout_s=1.0,
                           groups_per_batch=1, max_staleness=0, current_version=lambda: 0,
                           on_drop=lambda g, lag: None, normalize_std=False, should_stop=never,
                           timeout_s=600.0)
    queue.push(message(0, 0, n_correct=1), timeout_s=5)
    stream.next_batch()  # the worker thread now waits on the empty queue for up to 600 s
    stream.close()
    stream.close()  # twice is fine
    queue.push(message(1, 0, n_correct=1), timeout_s=5)
    time.sleep(0.3)  # ample time for a live poller (it polls every <= 10 ms) to take it
    assert queue.depth() == 1, "a closed stream popped a message"
    with pytest.raises(Stopped, match="closed"):
        stream.next_batch()


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
