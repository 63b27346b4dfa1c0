"""Trainer replica 0's duties (``llamarl.app.roles.controller.Controller``) alone, in this
process, against a real store on loopback: a run directory from its start to its end,
one step's hook (another role's metrics written, a checkpoint saved), and a resume of
that checkpoint with the counters it carried."""

from __future__ import annotations

import json
import sqlite3

import torch

from llamarl.app import names
from llamarl.app.config import GeneratorConfig, TrainerConfig
from llamarl.app.control import runtime, slots
from llamarl.app.metrics import events as metrics
from llamarl.app.model.policy import load_policy
from llamarl.app.rl.contract import Rejections
from llamarl.app.roles.controller import Carried, Controller, Snapshot, StepDone
from llamarl.app.state import checkpoint, train_state
from role_processes import TEST_SECRET, loopback_store


def controller(rt: runtime.Runtime, tmp_path, **cfg) -> Controller:
    trainer = TrainerConfig(runs_dir=str(tmp_path), run_id="run", steps=3, eval_every=100, eval_size=2,
                            prompts_per_step=2, group_size=2, device="cpu", **cfg)
    return Controller(rt, trainer, GeneratorConfig(max_new_tokens=4), num_generators=0, num_reward=0, world=1,
                      timeline=metrics.Timeline("trainer", 0), rejections=Rejections("trainer/0"))


def scalars(run_dir, name: str) -> list[tuple]:
    with sqlite3.connect(run_dir / metrics.DB_NAME) as db:
        return db.execute("SELECT step, role, value FROM scalars WHERE name = ? ORDER BY step", (name,)).fetchall()


def start(c: Controller) -> tuple[torch.nn.Module, Carried]:
    model, tokenizer = load_policy(c.prepare(), device=torch.device("cpu"))
    return model, c.open_run(model, tokenizer)


def test_a_run_directory_from_its_start_to_its_end_and_its_resume(tiny_policy, tmp_path, caplog):
    store = loopback_store(timeout_s=30)
    with runtime.Runtime.join("trainer", 0, store, TEST_SECRET) as rt:
        c = controller(rt, tmp_path, policy=str(tiny_policy))
        model, carried = start(c)
        assert carried == Carried() and c.full_model is model
        # What every other role reads before it starts.
        assert rt.signed.get(names.RESUME_KEY) == {"step": 0, "train_state": ""}
        assert rt.signed.get(names.SLOTS_DONE_KEY) == {"frontier": 0, "done": []}
        assert rt.signed.get(names.RESERVED_KEY) == {"count": 0}
        # Another role reads the config (its events carry this attempt's token), and its
        # events reach the database through the metrics queue.
        with runtime.Runtime.join("generator", 0, store, TEST_SECRET) as gen:
            assert gen.signed.get(names.CONFIG_KEY)["run_dir"] == str((tmp_path / "run").resolve())
            gen.emit(metrics.scalars({"test/from_generator": 7.0}, role="generator", replica=0, step=1), flush=True)
        # Trainer rank 0 gave back two places and dropped two stale groups, one of them
        # at a step before the checkpoint.
        rt.signed.put(names.dropped_key("trainer/0"), 2)
        ledger = slots.SlotLedger(frontier=2, done={3})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # No completion of this first step had an answer: the warning names the flags.
        c.after_step(StepDone(step=1, version=1, groups=[], values={names.FRAC_NO_ANSWER: 1.0}, duplicates=1,
                              checkpoint=Snapshot(model, optimizer, 1, ledger, dropped=2, skipped=1)))
        assert [r for r in caplog.records if r.levelname == "WARNING" and "--system-prompt" in r.getMessage()]
        run_dir = c.run_dir
        assert scalars(run_dir, "test/from_generator") == [(1, "generator", 7.0)]
        assert scalars(run_dir, names.FAULTS_DUPLICATE_GROUPS) == [(1, "trainer", 1.0)]
        assert scalars(run_dir, names.DATA_SLOT) == [(1, "trainer", 2.0)]
        saved = checkpoint.complete(run_dir / checkpoint.DIR_NAME)
        assert [step for step, _ in saved] == [1]
        state = json.loads((saved[0][1] / train_state.DIR_NAME / train_state.STATE_FILE).read_text())
        assert {k: state[k] for k in ("step", "version", "ledger", "dropped", "dropped_groups", "skipped")} == {
            "step": 1, "version": 1, "ledger": {"frontier": 2, "done": [3]}, "dropped": 2, "dropped_groups": 2,
            "skipped": 1}
        c.close("finished 1 steps")
    assert rt.control.stop_reason() == "finished 1 steps"
    with sqlite3.connect(run_dir / metrics.DB_NAME) as db:
        assert "finished_at" in dict(db.execute("SELECT key, value FROM meta").fetchall())

    # The resume, in a new app: the counters continue where the checkpoint left them.
    store = loopback_store(timeout_s=30)
    with runtime.Runtime.join("trainer", 0, store, TEST_SECRET) as rt:
        c = controller(rt, tmp_path, policy=str(tiny_policy), resume="run")
        _, carried = start(c)
        assert carried == Carried(dropped=2, skipped=1, given_back=2)
        assert c.run_dir == run_dir
        assert rt.signed.get(names.RESUME_KEY) == {"step": 1, "train_state": str(saved[0][1] / train_state.DIR_NAME)}
        assert rt.signed.get(names.SLOTS_DONE_KEY) == {"frontier": 2, "done": [3]}
        assert rt.signed.get(names.RESERVED_KEY) == {"count": 3}
        assert rt.signed.get(names.dropped_key("trainer/0")) == 2
        c.close("stopped", failed=True)


def test_a_flood_of_metric_events_goes_out_in_messages_under_the_frame_limit():
    """A loop that emits tens of thousands of events at once (a busy-waiting timeline) must
    not build one message over the frame limit, which would end the role: they go out in
    messages of METRICS_PER_MESSAGE, every event kept, in order."""
    from llamarl.app.control.frames import MAX_FRAME_BYTES, encode

    store = loopback_store(timeout_s=30)
    with runtime.Runtime.join("generator", 0, store, TEST_SECRET) as gen:
        flood = [metrics.interval("idle", "wait_weights", float(i), float(i) + 0.001, role="generator")
                 for i in range(70_000)]
        gen.emit(flood, flush=True)
        queue = gen.queue(names.METRICS)
        got = []
        while (msg := queue.pop(timeout_s=1.0)) is not None:
            assert len(encode(msg, TEST_SECRET)) < MAX_FRAME_BYTES
            _, _, events = metrics.checked_batch(msg)
            assert len(events) <= runtime.METRICS_PER_MESSAGE
            got.extend(events)
    assert [e["t0"] for e in got] == [e["t0"] for e in flood]
