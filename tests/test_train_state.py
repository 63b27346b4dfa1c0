"""The trainer's training state (app/state/train_state.py): a saved state loads back exactly
(model, optimizer, RNG), inside the atomic checkpoint; the slot ledger gives every slot
once; every resume that cannot work is refused before anything is written."""

from __future__ import annotations

import json
import random

import pytest
import torch

from llamarl.app.state import checkpoint
from llamarl.app.model import policy
from llamarl.app.state import train_state
from llamarl.app.metrics.events import DB_NAME
from llamarl.app.control.slots import SlotLedger
from llamarl.app.state.train_state import Resume, ResumeError, find_resume
from llamarl.app.weights.layout import flatten_parameters_
from role_processes import loopback_store, run_roles


def _trainer_model(seed: int = 0):
    model, tokenizer = policy.create_default_policy(seed=seed)
    flatten_parameters_(model)
    return model, tokenizer, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer, shift: int = 0) -> None:
    ids = torch.tensor([[1, 5, 6, 7, 8]]) + shift
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def _save_run(tmp_path, step: int, *, config: dict | None = None, with_state: bool = True):
    """A run directory with a metrics DB and one checkpoint of a model trained ``step`` steps."""
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / DB_NAME).write_bytes(b"")
    (run_dir / "config.json").write_text(json.dumps(config or {"lr": 0.01}))
    model, tokenizer, optimizer = _trainer_model()
    for _ in range(step):
        _step(model, optimizer)

    def extra(partial):
        train_state.save(partial / train_state.DIR_NAME, model, optimizer, {
            "step": step, "version": step, "config": config or {"lr": 0.01},
            "fingerprint": train_state.fingerprint(model),
            "parameter_shapes": train_state.parameter_shapes(model),
            "ledger": SlotLedger().state_dict(), "rng": train_state.rng_state()})

    checkpoint.save(model, tokenizer, run_dir / checkpoint.DIR_NAME, step, extra=extra if with_state else None)
    return run_dir, model, optimizer


def test_model_and_optimizer_round_trip_exactly(tmp_path):
    run_dir, model, optimizer = _save_run(tmp_path, 2)
    resume = find_resume(tmp_path / "runs", "", "r1")
    assert (resume.step, resume.path) == (2, run_dir / "checkpoints" / "step-2")
    fresh, _, fresh_opt = _trainer_model(seed=0)
    resume.check_model(fresh)
    train_state.load(resume.train_state, fresh, fresh_opt)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    # The optimizer state came back too: one more step on both gives the same weights.
    _step(model, optimizer)
    _step(fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # The parameters are still views of the flat buffer the weight sync sends.
    flat = {p.untyped_storage().data_ptr() for p in fresh.parameters()}
    assert len(flat) == 1


def test_rng_states_round_trip():
    state = json.loads(json.dumps(train_state.rng_state()))
    expected = (torch.rand(3), random.random())
    train_state.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_ledger_gives_each_slot_once_and_regenerates_the_missing_ones():
    ledger = SlotLedger()
    for s in (0, 1, 3, 5, 2, 8):  # out of order, as several generators deliver
        ledger.consume(s)
    assert (ledger.frontier, ledger.done, ledger.count) == (4, {5, 8}, 6)
    with pytest.raises(ValueError, match="consumed twice"):
        ledger.consume(3)
    # After a resume the counter restarts at count: the holes 4, 6, 7 first, then 9 on.
    assert ledger.slot_ids(range(6, 11)) == [4, 6, 7, 9, 10]
    assert SlotLedger().slot_ids(range(0, 3)) == [0, 1, 2]
    again = SlotLedger.from_state(json.loads(json.dumps(ledger.state_dict())))
    assert again == ledger
    with pytest.raises(ValueError, match="bad slot ledger"):
        SlotLedger.from_state({"frontier": 4, "done": [2]})


def test_one_process_consumes_a_steps_slots_once():
    ledger = SlotLedger()
    assert ledger.consume_across_ranks([0, 2, None, 2]) == [True, True, True, False]
    assert ledger.consume_across_ranks([1, 0]) == [True, False]
    assert (ledger.frontier, ledger.done) == (3, set())


def test_auto_on_a_new_run_id_is_a_fresh_run_and_on_a_run_without_checkpoint_step_0(tmp_path):
    assert find_resume(tmp_path, "r1", "") is None
    assert find_resume(tmp_path, "new-run", "auto") is None
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / DB_NAME).write_bytes(b"")
    assert find_resume(tmp_path, "r1", "auto") == Resume(run_dir=tmp_path / "r1", step=0)


@pytest.mark.parametrize("resume, run_id, message", [
    ("../x", "", "not a single safe directory name"),
    ("/abs", "", "not a single safe directory name"),
    ("auto", "", "give one"),
    ("nope", "", "no run 'nope'"),
])
def test_bad_run_ids_are_refused(tmp_path, resume, run_id, message):
    with pytest.raises(ResumeError, match=message):
        find_resume(tmp_path, run_id, resume)


def test_a_run_without_checkpoint_or_training_state_is_refused(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / DB_NAME).write_bytes(b"")
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        find_resume(tmp_path / "runs", "", "r1")
    partial = checkpoint.partial_path(tmp_path / "runs" / "r1" / checkpoint.DIR_NAME, 3)
    partial.mkdir(parents=True)
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        find_resume(tmp_path / "runs", "", "r1")


def test_a_policy_only_checkpoint_is_refused(tmp_path):
    _save_run(tmp_path, 1, with_state=False)
    with pytest.raises(ResumeError, match="has no readable training state"):
        find_resume(tmp_path / "runs", "", "r1")


def test_another_config_another_model_or_nothing_left_is_refused(tmp_path):
    _save_run(tmp_path, 2, config={"lr": 0.01, "steps": 4, "seed": 0})
    resume = find_resume(tmp_path / "runs", "", "r1")
    resume.check({"lr": 0.01, "steps": 8, "seed": 0, "save_every": 3}, steps=8)  # resumable changes
    with pytest.raises(ResumeError, match=r"another config \(lr: 0.01 then, 0.02 now; seed"):
        resume.check({"lr": 0.02, "steps": 4, "seed": 1}, steps=4)
    with pytest.raises(ResumeError, match="at step 2 and --steps is 2: nothing left"):
        resume.check({"lr": 0.01, "steps": 2, "seed": 0}, steps=2)
    other = torch.nn.Linear(3, 4)
    with pytest.raises(ResumeError, match="another model than --policy: bias: None saved, \\[4\\] now"):
        resume.check_model(other)


def test_a_failing_training_state_leaves_no_checkpoint(tmp_path):
    model, tokenizer, _ = _trainer_model()

    def fails(partial):
        raise RuntimeError("collective failed")

    with pytest.raises(RuntimeError, match="collective failed"):
        checkpoint.save(model, tokenizer, tmp_path, 1, extra=fails)
    assert list(tmp_path.iterdir()) == []


def _two_trainer_ranks(store, rank: int, world_size: int, path: str) -> str:
    """A trainer rank holding a whole replica: settle two steps' slots across the ranks,
    save the training state collectively, then load it into a fresh model and optimizer."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model, _, optimizer = _trainer_model()
        _step(model, optimizer)  # the same data on both ranks: replicas stay equal
        ledger = SlotLedger()
        # Step 1: 0, 2, 4, 6 here, 1, 3, 7 there (5 in flight). Step 2: twins of a regenerated
        # slot: 8 on both ranks (rank 0 keeps it), and 3 again on rank 1, trained at step 1.
        first = ledger.consume_across_ranks([0, 2, 4, 6] if rank == 0 else [1, 3, 7])
        second = ledger.consume_across_ranks([8, 9, None] if rank == 0 else [3, 8, 10])
        train_state.save(path, model, optimizer, {"step": 1} if rank == 0 else None)
        fresh, _, fresh_opt = _trainer_model()
        train_state.load(path, fresh, fresh_opt)
        _step(model, optimizer)
        _step(fresh, fresh_opt)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        return f"{all(first)} {second} {ledger.frontier} {sorted(ledger.done)} {same}"
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_trainer_ranks_save_and_load_collectively(tmp_path):
    store = loopback_store(timeout_s=60)
    results = run_roles(_two_trainer_ranks, 2, store.port, 120, str(tmp_path / "train_state"))
    # Every slot trained once, whichever rank its copies reached; the same ledger on both
    # ranks: all up to 4, then 6 to 10 (5 was in flight).
    assert results == [(0, "True [True, True, True] 5 [6, 7, 8, 9, 10] True"),
                       (1, "True [False, False, True] 5 [6, 7, 8, 9, 10] True")]
    assert json.loads((tmp_path / "train_state" / train_state.STATE_FILE).read_text())["step"] == 1


# --------------------------------------------------------------------------- another rank count

def _whole_state(model, optimizer) -> dict:
    """Model and optimizer state, whole (a collective with FSDP2: every rank gathers),
    keyed by name: what a resume must restore, whatever the number of trainer ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True) if train_state._distributed() else None
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    tensors = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        tensors.update({f"optimizer/{fqn}/{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
              for g in optim_sd["param_groups"]]
    return {"tensors": tensors, "groups": groups}


def _tiny_trainer(ranks: int, seed: int = 0):
    """What llamarl.app.roles.trainer holds, for a tiny Llama: one rank's model flattened, several
    ranks' sharded by FSDP2 (``llamarl.app.rl.sharding``); AdamW."""
    from llamarl.app.rl import sharding
    from tiny_models import tiny_llama

    model = tiny_llama()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
    if ranks == 1:
        flatten_parameters_(model)
    else:
        sharding.shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _load_then_save_on_two_ranks(store, rank: int, world_size: int, one: str, two: str, out: str) -> str:
    """2 FSDP2 ranks (of other weights) load a 1-rank training state from ``one``; then
    train a step each on their own tokens (FSDP2 adds the gradients) and save to ``two``.
    Rank 0 writes the whole state it held after each to ``out``-loaded / ``out``-saved."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model, optimizer = _tiny_trainer(world_size, seed=1)
        train_state.load(one, model, optimizer)
        loaded = _whole_state(model, optimizer)
        _step(model, optimizer, shift=rank)
        train_state.save(two, model, optimizer, {"step": 2} if rank == 0 else None)
        saved = _whole_state(model, optimizer)
        if rank == 0:
            torch.save(loaded, f"{out}-loaded")
            torch.save(saved, f"{out}-saved")
        return "ok"
    finally:
        dist.destroy_process_group()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["groups"] == b["groups"]
    assert sorted(a["tensors"]) == sorted(b["tensors"])
    assert any(k.endswith("/exp_avg_sq") for k in a["tensors"])  # the optimizer's state is there
    for name, t in a["tensors"].items():
        assert torch.equal(t, b["tensors"][name]), name


@pytest.mark.integration
def test_one_ranks_state_resumes_on_two_sharded_ranks_and_back(tmp_path):
    """``trainer_ranks`` may change at a resume (``RESUMABLE``): DCP reshards as it loads.
    1 -> 2: a one-process trainer's state (flattened model, as llamarl.app.roles.trainer keeps it)
    loaded by 2 FSDP2 ranks is, whole, the state saved. 2 -> 1: the state those ranks
    saved after a step of their own, loaded by one process, is, whole, what they held."""
    store = loopback_store(timeout_s=60)
    one, two, out = tmp_path / "one_rank", tmp_path / "two_ranks", tmp_path / "whole"
    model, optimizer = _tiny_trainer(1)
    _step(model, optimizer)
    train_state.save(one, model, optimizer, {"step": 1})
    results = run_roles(_load_then_save_on_two_ranks, 2, store.port, 180, str(one), str(two), str(out))
    assert results == [(0, "ok"), (1, "ok")], results
    _assert_same_state(torch.load(f"{out}-loaded", weights_only=True), _whole_state(model, optimizer))
    fresh, fresh_opt = _tiny_trainer(1, seed=1)  # other weights: all of them must be loaded
    train_state.load(two, fresh, fresh_opt)
    _assert_same_state(_whole_state(fresh, fresh_opt), torch.load(f"{out}-saved", weights_only=True))


def test_one_run_directory_has_one_live_trainer(tmp_path):
    """Two --resume of one run: the second trainer is refused at once, naming the first,
    before it writes anything; once the first lets go (it ended), the run can be resumed."""
    from llamarl.app.state.train_state import ResumeError, hold_run_dir

    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    first = hold_run_dir(run_dir, "app llamarl-first (pid 1 on host)")
    with pytest.raises(ResumeError, match=r"run run-1 is being trained now by app llamarl-first \(pid 1 on host\)"):
        hold_run_dir(run_dir, "app llamarl-second (pid 2 on host)")
    first.close()
    second = hold_run_dir(run_dir, "app llamarl-second (pid 2 on host)")
    assert (run_dir / ".trainer.lock").read_text() == "app llamarl-second (pid 2 on host)"
    second.close()
