"""Bad frames on a running app are dropped and counted, never fatal; a weight version
altered in flight is refused; only a sustained flood ends a run, naming it.
``llamarl.llamarl`` through TorchX's runner on local_llamarl (``app_launch``).

Someone on the network without the secret can push garbage or frames signed with another
secret, and can replay frames they captured. The malformed-but-signed messages and the
versions outside the trainer's window are forged here with the app's secret: what a buggy
or compromised role could send.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from torchx.specs import AppState

from llamarl.app.control import frames
from llamarl.app.control import incarnations
from llamarl.app.metrics import events as metrics
from llamarl.app import names
from llamarl.app.rl.contract import FLOOD_FRAMES, GroupId, Rollout, RolloutGroup, to_message
from llamarl.app.rewards import RewardResult
from llamarl.app.control.seen_groups import first_seq
from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.transport import StoreQueue, connect_store
from llamarl.app.weights.digest import TEST_CORRUPT_ENV
from app_launch import APP_TIMEOUT_S, GROUP_SIZE, PROMPTS_PER_STEP, launch, rows
from test_failfast import assert_fails_naming

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 8  # room for the test to capture frames to replay while the run goes on
QUEUES = (names.ROLLOUTS, names.SCORED, names.METRICS)  # lost_slots: signed control records


FORGER = 99
"""The replica of a generator that does not exist: the groups the test forges are its."""


def register_forger(store, secret: bytes) -> int:
    """Register a process of generator ``FORGER`` under the app's attempt, as a role with
    the secret could (readers take groups only from registered processes); its first seq."""
    attempt = SignedStore(store, secret, "test").get(names.CONFIG_KEY, writers=(CONTROLLER,))["attempt"]
    return first_seq(incarnations.register(SignedStore(store, secret, names.member("generator", FORGER)),
                                           FORGER, attempt))


def forged_group(seq: int, version: int) -> dict:
    """A scored group of generator ``FORGER``, signed later."""
    gid = GroupId(FORGER, seq)
    group = RolloutGroup(group_id=gid, version=version, rollouts=[
        Rollout(prompt_ids=[5, 6], completion_ids=[7, 8], behaviour_logprobs=[-1.0, -1.0], version=version,
                group_id=gid, task={"answer": 1.0}, result=RewardResult(1.0, {"math_verifier": 1.0}))
        for _ in range(GROUP_SIZE)])
    return to_message(group)


def replay_one_of_each(store, queues: tuple[str, ...], secret: bytes, timeout_s: float = APP_TIMEOUT_S) -> None:
    """Capture one real frame from each of ``queues`` (racing their readers, all queues
    polled in turn) and push each back twice: the original goes on its way, the copy is a
    replay (a group trained twice, a metrics batch written twice, if nothing refused it)."""
    missing = list(queues)
    deadline = time.monotonic() + timeout_s
    while missing:
        for queue in list(missing):
            try:
                frame = store.queue_pop(names.queue_key(queue), block=False)
            except Exception:  # empty: the reader was quicker this time
                continue
            real = frames.decode(frame, secret)  # a real group, or metrics batch, of the app
            assert real.get("kind") == "rollout_group" or "events" in real, real
            store.queue_push(names.queue_key(queue), frame)
            store.queue_push(names.queue_key(queue), frame)
            missing.remove(queue)
        assert time.monotonic() < deadline, f"no frame to capture on {missing} in {timeout_s:g} s"


def counts(db, role: str) -> dict[str, float]:
    """Rejections by reason for ``role``: each process's highest count, summed."""
    return dict(rows(db, f"SELECT name, SUM(c) FROM (SELECT name, replica, MAX(value) AS c FROM scalars "
                         f"WHERE role = '{role}' AND name LIKE 'security/%' GROUP BY name, replica) "
                         f"GROUP BY name"))


def test_bad_frames_on_every_queue_are_dropped_and_counted_and_the_run_finishes(tiny_policy, tmp_path):
    """Synchronous (so nothing is stale but the forged group), a reward executor reading
    ``rollouts``, the trainer ``scored`` and ``metrics`` (the lost slots that generators
    read are signed control records, tested with the other control keys); generator 1
    receives weight version 2 altered in flight (the test hook)."""
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=2, num_reward=1, max_staleness=0,
                env={TEST_CORRUPT_ENV: "1:2"}) as app:
        app.wait_for_log("trainer", "step 1/", timeout_s=APP_TIMEOUT_S)
        secret = app.secret()
        store = connect_store(f"127.0.0.1:{app.store_port}", timeout_s=30)
        # Captured and pushed again (first: the queues then hold only the app's own frames).
        replay_one_of_each(store, QUEUES, secret)
        for queue in QUEUES:  # from anyone: garbage, and a frame under another secret
            store.queue_push(names.queue_key(queue), b"\x00garbage")
            StoreQueue(store, queue, bytes(32), maxlen=10**6).push({"slot": 3, "events": []}, timeout_s=10)
        signed = {q: StoreQueue(store, q, secret, maxlen=10**6) for q in QUEUES}
        seq = register_forger(store, secret)
        # Signed, yet malformed: a group with a wrong type, a metrics event with a text value.
        signed[names.ROLLOUTS].push({**forged_group(seq, 0), "version": "0"}, timeout_s=10)
        signed[names.METRICS].push(metrics.batch_message([{**metrics.scalar("loss", 0.0, role="trainer"),
                                                           "value": "x"}], sender="trainer/0", stream=1, seq=0,
                                                          attempt="any"),
                                   timeout_s=10)
        # Signed, well formed, outside [trainer version - max_staleness, trainer version].
        signed[names.SCORED].push(forged_group(seq + 1, 10**6), timeout_s=10)  # from the future
        signed[names.SCORED].push(forged_group(seq + 2, 0), timeout_s=10)  # too old by now

        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        db = app.db()
        assert f"run finished: finished {STEPS} steps" in app.log("trainer")
        rejected = lambda *reasons: {names.rejected_metric(r): 1.0 for r in reasons}  # noqa: E731
        assert counts(db, "reward") == rejected("malformed_frame", "bad_tag", "wrong_type", "replay")
        assert counts(db, "trainer") == {names.rejected_metric("malformed_frame"): 2.0,
                                         names.rejected_metric("bad_tag"): 2.0,
                                         names.rejected_metric("replay"): 2.0,  # a group, a metrics batch
                                         **rejected("wrong_type", "future_version", "too_old")}
        assert counts(db, "generator") == {names.weight_digest_metric("mismatch"): 1.0}
        # Every step trained its own groups once: the replays and the forged groups never.
        used = rows(db, "SELECT step, version, staleness FROM staleness WHERE used = 1")
        assert len(used) == STEPS * PROMPTS_PER_STEP * GROUP_SIZE
        assert all(lag == 0 and version == step - 1 for step, version, lag in used)
        # The too-old group: dropped, counted (too_old above, and as staleness), its rows unused.
        assert rows(db, "SELECT COUNT(*), MIN(version) FROM staleness WHERE used = 0") == [(GROUP_SIZE, 0)]
        assert rows(db, f"SELECT MAX(value) FROM scalars WHERE name = '{names.DROPPED_STALE}'") == [(1.0,)]
        # Generator 1 refused version 2 (and went on with version 1); its log says so once.
        gen1 = app.log("generator", 1)
        assert gen1.count("refused weights of version") == 1
        assert "refused weights of version 2 (mismatch)" in gen1
        # Each kind of rejection is logged once per reader, not once per frame.
        assert app.log("trainer").count("dropped a message (bad_tag)") == 1


def test_a_sustained_flood_ends_the_run_naming_it(tiny_policy, tmp_path):
    """More junk in a row than FLOOD_FRAMES on the rollouts queue, so no valid group comes
    between: the run fails with an error that says what happened. The generator is held
    (SIGSTOP) from its start, before it registers (the trainer waits for it, nobody reads
    the queue), until the junk is in: its first group can only come after all of it."""
    with launch(tiny_policy, tmp_path, steps=STEPS, num_generators=1, max_staleness=0) as app:
        generator = f"llamarl.app.roles.generator .*--app-id {app.app_id} --replica 0"
        deadline = time.monotonic() + APP_TIMEOUT_S
        while not (pids := subprocess.run(["pgrep", "-f", generator], capture_output=True, text=True).stdout.split()):
            assert time.monotonic() < deadline, app.logs_tail()
            time.sleep(0.01)
        os.kill(int(pids[0]), signal.SIGSTOP)
        try:
            app.wait_for_log("trainer", "run directory", timeout_s=APP_TIMEOUT_S)
            store = connect_store(f"127.0.0.1:{app.store_port}", timeout_s=30)
            key = names.queue_key(names.ROLLOUTS)
            for _ in range(FLOOD_FRAMES + 100):
                store.queue_push(key, b"junk")
        finally:
            os.kill(int(pids[0]), signal.SIGCONT)
        assert_fails_naming(app, f"FrameFlood: trainer/0: {FLOOD_FRAMES} messages rejected in a row")
