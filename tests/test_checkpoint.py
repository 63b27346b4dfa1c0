"""Checkpoints (app/state/checkpoint.py): a saved directory is the trainer's policy exactly,
as from_pretrained loads it; saves are atomic; pruning keeps the newest; bad input fails
clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from llamarl.app.state import checkpoint
from llamarl.app.model import policy
from llamarl.app.metrics.events import LAST_CHECKPOINT
from llamarl.app.weights.layout import flatten_parameters_


@pytest.fixture(scope="module")
def trained():
    """The default policy as the trainer holds it: parameters are views of a flat buffer,
    moved off their initial values by an optimizer step on that buffer."""
    model, tokenizer = policy.create_default_policy(seed=0)
    flatten_parameters_(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model, tokenizer


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 9, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24]])


def test_a_saved_checkpoint_loads_with_from_pretrained_and_gives_the_same_logits(trained, tmp_path):
    model, tokenizer = trained
    path = checkpoint.save(model, tokenizer, tmp_path / "checkpoints", 7)
    assert path == tmp_path / "checkpoints" / "step-7"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (path / name).is_file(), name
    # Separate tensors, one per parameter, not one flat buffer.
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    params = dict(model.named_parameters())  # the tied lm_head is one of these
    assert shapes == {k: tuple(p.shape) for k, p in params.items()}

    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)
    fresh, _ = policy.create_default_policy(seed=0)
    with torch.no_grad():  # the trained weights, not the initial ones
        assert not torch.equal(fresh(_ids()).logits, loaded(_ids()).logits)
    assert policy.load_tokenizer(path)("1+2", add_special_tokens=False) == tokenizer("1+2", add_special_tokens=False)


def test_an_existing_step_is_never_overwritten(trained, tmp_path):
    model, tokenizer = trained
    path = checkpoint.save(model, tokenizer, tmp_path, 3)
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="step-3 already exists"):
        checkpoint.save(model, tokenizer, tmp_path, 3)
    assert (path / "model.safetensors").read_bytes() == before


def test_an_interrupted_save_leaves_nothing_that_looks_complete(trained, tmp_path, monkeypatch):
    model, tokenizer = trained

    def dies_half_way(model, tokenizer, path):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_policy", dies_half_way)
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot write checkpoint .*step-2: .*No space left"):
        checkpoint.save(model, tokenizer, tmp_path, 2)
    assert checkpoint.complete(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_leftover_partial_directory_is_not_listed_and_the_next_save_removes_it(trained, tmp_path):
    model, tokenizer = trained
    leftover = tmp_path / ".step-4.partial"  # what a killed process leaves
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    assert checkpoint.complete(tmp_path) == []
    path = checkpoint.save(model, tokenizer, tmp_path, 5)
    assert checkpoint.complete(tmp_path) == [(5, path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 10, 3):  # numeric order, not the names' order
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / ".step-11.partial").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert checkpoint.prune(tmp_path, 0) == []
    assert [s for s, _ in checkpoint.complete(tmp_path)] == [1, 2, 3, 10]
    assert checkpoint.prune(tmp_path, 2) == [tmp_path / "step-1", tmp_path / "step-2"]
    assert [s for s, _ in checkpoint.complete(tmp_path)] == [3, 10]
    assert checkpoint.prune(tmp_path, 2) == []
    assert (tmp_path / "notes.txt").exists() and (tmp_path / ".step-11.partial").exists()
    with pytest.raises(ValueError, match="keep_last must be >= 0"):
        checkpoint.prune(tmp_path, -1)


def test_an_unwritable_directory_is_a_clear_error(trained, tmp_path):
    model, tokenizer = trained
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the run directory should be")
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot write checkpoint .*runs/checkpoints/step-1"):
        checkpoint.save(model, tokenizer, blocker / "checkpoints", 1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoint.save(model, tokenizer, tmp_path, -1)


def test_record_latest_names_the_checkpoint_in_config_json(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"lr": 0.001}))
    checkpoint.record_latest(config, 4, tmp_path / "checkpoints" / "step-4")
    checkpoint.record_latest(config, 8, tmp_path / "checkpoints" / "step-8")
    assert json.loads(config.read_text()) == {
        "lr": 0.001, LAST_CHECKPOINT: {"step": 8, "path": str(tmp_path / "checkpoints" / "step-8")}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
