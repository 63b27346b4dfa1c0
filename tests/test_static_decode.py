"""The static-shape decoder (``llamarl.app.sampling.static_decode``) on CPU, where it runs without
capture: the same tokens as the eager loop when greedy, log-probs equal to a recompute by
the model's own forward, buckets, compaction, masks and weights updated in place. Its
CUDA capture is in ``test_static_decode_gpu.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from llamarl.app.sampling import SamplingParams, precision, sample, static_decode
from llamarl.app.sampling.kernels import Int8DynamicKernel, int8_engine
from llamarl.app.sampling.static_decode import StaticDecoder
from llamarl.app.sampling.static_state import StaticState, StepKey, bucket_for, bucket_sizes, capacity_for
from test_sampler import PAD, check_stopping, make_model, prompts, tokenizer, trainer_logprobs  # noqa: F401


def distinct_eos(model, batch: list[list[int]], T: int) -> int:
    """A token greedy decoding draws early in some rows and not in others, so that with
    it as EOS rows end at different steps and the batch shrinks through its buckets."""
    probe = sample(model, batch, SamplingParams(max_new_tokens=T, temperature=0), eos_id=-1,
                   pad_id=PAD, decoder="eager")
    counts = torch.bincount(probe.tokens_BT[:, : T // 2].flatten(), minlength=2)
    return int(counts.argmax())


@pytest.fixture(scope="module")
def llama(tokenizer):  # noqa: F811
    return make_model("llama", len(tokenizer))


@pytest.fixture(scope="module")
def batch(prompts):  # noqa: F811
    """24 rows (buckets 24, 16, 8): six prompts x 4 samples."""
    return [p for p in prompts for _ in range(4)]


def test_buckets_are_the_rows_then_powers_of_two_down_to_eight():
    assert bucket_sizes(64) == (64, 32, 16, 8)
    assert bucket_sizes(24) == (24, 16, 8)
    assert bucket_sizes(65) == (65, 64, 32, 16, 8)
    assert bucket_sizes(8) == (8,)
    assert bucket_sizes(5) == (5,)
    assert bucket_sizes(1) == (1,)
    sizes = bucket_sizes(64)
    assert [bucket_for(n, sizes) for n in (64, 33, 32, 17, 9, 8, 1)] == [64, 64, 32, 32, 16, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(65, sizes)
    assert [capacity_for(n) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]


@pytest.mark.parametrize("check_every", [1, static_decode.CHECK_EVERY])
def test_greedy_tokens_equal_the_eager_loop(llama, batch, check_every, monkeypatch):
    """Rows end at different steps, so the static batch goes 24 -> 16 -> 8 rows."""
    monkeypatch.setattr(static_decode, "CHECK_EVERY", check_every)
    compactions = []
    select = StaticState.select_rows_
    monkeypatch.setattr(StaticState, "select_rows_",
                        lambda st, order, filled: (compactions.append(len(order)), select(st, order, filled)))
    T = 24
    eos = distinct_eos(llama, batch, T)
    greedy = SamplingParams(max_new_tokens=T, temperature=0)
    eager = sample(llama, batch, greedy, eos_id=eos, pad_id=PAD, decoder="eager")
    static = sample(llama, batch, greedy, eos_id=eos, pad_id=PAD, decoder="static")
    # The batch left its bucket for smaller ones (several at once when many rows end).
    assert compactions and compactions[-1] == 8 and compactions == sorted(set(compactions), reverse=True)
    assert torch.equal(static.tokens_BT, eager.tokens_BT)
    assert torch.equal(static.lengths_B, eager.lengths_B)
    assert (static.logprobs_BT - eager.logprobs_BT).abs().max() <= 1e-5
    check_stopping(static, eos, T)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_logprobs_equal_a_recompute_by_the_model(llama, batch, temperature, top_p):
    T = 16
    eos = distinct_eos(llama, batch, T)
    params = SamplingParams(max_new_tokens=T, temperature=temperature, top_p=top_p)
    out = sample(llama, batch, params, eos_id=eos, pad_id=PAD, decoder="static",
                 generator=torch.Generator().manual_seed(3))
    check_stopping(out, eos, T)
    ref_BT = trainer_logprobs(llama, batch, out, temperature=temperature, top_p=top_p)
    for i in range(len(batch)):
        n = int(out.lengths_B[i])
        assert (out.logprobs_BT[i, :n] - ref_BT[i, :n]).abs().max() <= 1e-5


def test_draws_are_reproducible_from_the_seed(llama, batch):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)

    def run(seed: int):
        return sample(llama, batch, params, eos_id=-1, pad_id=PAD, decoder="static",
                      generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.logprobs_BT, b.logprobs_BT)
    assert not torch.equal(a.tokens_BT, c.tokens_BT)
    # Repeated prompts are sampled independently.
    assert len({tuple(r) for r in a.tokens_BT.tolist()}) > len(batch) // 2


def test_a_smaller_call_and_a_longer_one_reuse_or_grow_the_state(llama, batch, prompts):  # noqa: F811
    decoder = StaticDecoder(llama)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    decoder.run(batch, params, eos_id=-1, pad_id=PAD, generator=None)
    state = decoder.state
    kv_ptr = state.kv.data_ptr()
    # Fewer rows (padded to the bucket above them, 8), shorter: the same tensors.
    small = decoder.run(prompts, params, eos_id=-1, pad_id=PAD, generator=None)
    assert decoder.state is state and state.kv.data_ptr() == kv_ptr
    eager = sample(llama, prompts, params, eos_id=-1, pad_id=PAD, decoder="eager")
    assert torch.equal(small.tokens_BT, eager.tokens_BT)
    # More positions than the capacity: a bigger state, whose graphs (on CUDA) go into a
    # new memory pool: the old one's graphs are gone, and torch refuses to capture into
    # a pool whose graphs are all gone while it still holds memory (``_drop_graphs``).
    decoder._pool = "the old graphs' pool"
    decoder.run(prompts, SamplingParams(max_new_tokens=state.capacity, temperature=0), eos_id=-1,
                pad_id=PAD, generator=None)
    assert decoder.state is not state and decoder.state.capacity > state.capacity
    assert decoder.state.rows == state.rows  # rows never shrink
    assert decoder._pool is None and not decoder.graphs


def test_select_rows_moves_each_rows_state_and_filled_cache():
    """Compaction: row r takes row order[r]'s tensors and its first ``filled`` positions."""
    model = make_model("llama", 40)
    decoder = StaticDecoder(model)
    decoder.refresh_weights()
    st = decoder._state_for(8, 10)
    st.tok_R.copy_(torch.arange(8) + 100)
    st.pos_R.copy_(torch.arange(8) + 200)
    st.out_row_R.copy_(torch.arange(8))
    st.alive_R.copy_(torch.tensor([0, 1, 0, 1, 1, 0, 0, 0], dtype=torch.bool))
    st.bias_RC.copy_(torch.arange(8.0)[:, None].expand_as(st.bias_RC))
    st.kv[1].copy_(torch.arange(8.0).view(1, 1, 8, 1, 1, 1).expand_as(st.kv[1]))
    st.kv[1, :, :, :, :, 5:] = -1.0
    order = torch.argsort((~st.alive_R).to(torch.uint8), stable=True)[:4]
    assert order.tolist() == [1, 3, 4, 0]  # live rows first, then finished ones
    st.select_rows_(order, filled=5)
    assert st.tok_R[:4].tolist() == [101, 103, 104, 100]
    assert st.pos_R[:4].tolist() == [201, 203, 204, 200]
    assert st.out_row_R[:4].tolist() == [1, 3, 4, 0]
    assert st.alive_R[:4].tolist() == [True, True, True, False]
    assert st.bias_RC[:4, 0].tolist() == [1.0, 3.0, 4.0, 0.0]
    assert st.kv[1, :, :, :4, :, :5].amax(dim=(0, 1, 3, 4, 5)).tolist() == [1.0, 3.0, 4.0, 0.0]
    assert (st.kv[1, :, :, :4, :, 5:] == -1).all()  # unfilled positions are not copied


def test_a_step_writes_the_slot_opens_the_mask_and_advances_in_place(llama, prompts):  # noqa: F811
    decoder = StaticDecoder(llama)
    decoder.run(prompts, SamplingParams(max_new_tokens=2, temperature=0), eos_id=-1, pad_id=PAD,
                generator=None)
    st = decoder.state
    b, P = len(prompts), max(len(p) for p in prompts)
    key = StepKey(b, 0.0, 1.0, -1)
    ptrs = [t.data_ptr() for t in (st.kv, st.bias_RC, st.tok_R, st.pos_R, st.t_1, st.slot_1)]
    slot, t, pos = int(st.slot_1), int(st.t_1), st.pos_R[:b].clone()
    assert slot == P + 1 and t == 2  # after the call: two tokens, one decode step
    assert (st.bias_RC[:b, P + 1:] == float("-inf")).all()
    before = st.kv[1, :, :, :b, :, slot].clone()
    with torch.inference_mode():
        decoder._step(st, key)
    assert (st.bias_RC[:b, slot] == 0).all() and (st.bias_RC[:b, slot + 1:] == float("-inf")).all()
    assert not torch.equal(st.kv[1, :, :, :b, :, slot], before)
    assert int(st.slot_1) == slot + 1 and int(st.t_1) == t + 1 and torch.equal(st.pos_R[:b], pos + 1)
    assert [x.data_ptr() for x in (st.kv, st.bias_RC, st.tok_R, st.pos_R, st.t_1, st.slot_1)] == ptrs


def test_new_weights_are_copied_into_the_same_storage_and_sampled_from(llama, prompts, tokenizer):  # noqa: F811
    """What a weight swap does (copy into the parameters) reaches the steps without new
    storage for what they read."""
    model = make_model("llama", len(tokenizer))
    other = make_model("llama", len(tokenizer))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    decoder = static_decode.decoder_for(model)
    before = sample(model, prompts, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    ptrs = [k.w_KM.data_ptr() for layer in decoder.linears.layers for k in layer]
    with torch.no_grad():
        for live, new in zip(model.parameters(), other.parameters()):
            live.copy_(new)
    after = sample(model, prompts, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    assert [k.w_KM.data_ptr() for layer in decoder.linears.layers for k in layer] == ptrs
    expected = sample(other, prompts, greedy, eos_id=-1, pad_id=PAD, decoder="eager")
    assert torch.equal(after.tokens_BT, expected.tokens_BT)
    assert not torch.equal(after.tokens_BT, before.tokens_BT)
    assert not decoder.refresh_weights()  # nothing changed since the last call
    twin = copy.deepcopy(model)  # a reference model: its own decoder, made at its first call
    assert getattr(twin, static_decode._ATTACHED[False]) is None
    assert static_decode.decoder_for(twin) is not decoder


def test_parameters_rebound_to_new_storage_are_sampled_from(tokenizer, prompts):  # noqa: F811
    """Not what the weight receiver does (it copies in place), but a ``.data`` rebinding
    must not leave the steps reading the old storage."""
    model = make_model("llama", len(tokenizer))
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    sample(model, prompts, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.5
    after = sample(model, prompts, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    assert torch.equal(after.tokens_BT, sample(model, prompts, greedy, eos_id=-1, pad_id=PAD,
                                               decoder="eager").tokens_BT)


def test_models_without_the_fast_path_keep_the_eager_loop(tokenizer, prompts):  # noqa: F811
    gpt2 = make_model("gpt2", len(tokenizer))
    out = sample(gpt2, prompts, SamplingParams(max_new_tokens=4), eos_id=-1, pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))  # auto: eager
    assert out.tokens_BT.shape == (len(prompts), 4)
    assert not hasattr(gpt2, static_decode._ATTACHED[False])
    with pytest.raises(ValueError, match="Llama fast path"):
        sample(gpt2, prompts, SamplingParams(max_new_tokens=4), eos_id=-1, pad_id=PAD, decoder="static")


@pytest.mark.skipif(int8_engine() is None, reason="no quantized engine")
def test_int8_runs_through_the_same_static_step(tokenizer, batch):
    """A quantized generator's kernels are what the static step runs: greedy tokens equal
    the eager loop's with the same int8 kernels (no row ends: the batch stays whole, so
    the activations' per-tensor scales see the same rows), and a new version reaches it."""
    model = make_model("llama", len(tokenizer))
    weights = precision.quantize_(model, "int8")
    weights.refresh()
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    static = sample(model, batch, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    eager = sample(model, batch, greedy, eos_id=-1, pad_id=PAD, decoder="eager")
    decoder = static_decode.decoder_for(model)
    assert all(isinstance(k, Int8DynamicKernel) for layer in decoder.linears.layers for k in layer)
    assert torch.equal(static.tokens_BT, eager.tokens_BT)
    packed = decoder.linears.layers[0][0].packed
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    weights.refresh()
    sample(model, batch, greedy, eos_id=-1, pad_id=PAD, decoder="static")
    assert decoder.linears.layers[0][0].packed is not packed


def test_generators_decode_as_gen_decoder_says(tokenizer):  # noqa: F811
    """``--gen-decoder`` reaches ``sample`` through ``rl.generate_groups``."""
    from llamarl.app.rl import step as rl
    from llamarl.app.tasks import arithmetic as tasks
    from llamarl.app.config import GeneratorConfig

    problems = tasks.make_split("eval", 2, seed=0)
    for decoder in ("eager", "static"):
        model = make_model("llama", len(tokenizer))
        gen = GeneratorConfig(max_new_tokens=6, gen_decoder=decoder)
        groups = rl.generate_groups(model, tokenizer, problems, group_size=2, params=gen.sampling(), version=0,
                                    rng=torch.Generator().manual_seed(0), decoder=gen.gen_decoder)
        assert hasattr(model, static_decode._ATTACHED[False]) == (decoder == "static")
        assert all(len(r.behaviour_logprobs) and r.behaviour_logprobs.max() <= 0 for g in groups for r in g.rollouts)
    with pytest.raises(ValueError, match="gen_decoder"):
        GeneratorConfig(gen_decoder="graphs")  # type: ignore[arg-type]
    assert GeneratorConfig(gen_decoder="compiled", gen_precision="bf16").gen_decoder == "compiled"
    with pytest.raises(ValueError, match="int8"):
        GeneratorConfig(gen_decoder="compiled", gen_precision="int8")


def test_compiled_steps_equal_the_eager_loop_and_take_new_weights(tokenizer, prompts):  # noqa: F811
    """``decoder="compiled"``: the same step through torch.compile (inductor's C++ kernels
    on CPU), a bucket compiled at its first use. After a weight swap (copied in normal
    mode into parameters whose kernels were made in inference mode), bucket 16's
    compiled step runs the new weights without compiling again, and bucket 8 compiles
    then: the same greedy tokens and log-probs as the eager loop throughout."""
    from torch._dynamo.utils import counters

    model = make_model("llama", len(tokenizer))
    batch = [p for p in prompts[:4] for _ in range(4)]  # 16 rows: buckets 16, 8
    greedy = SamplingParams(max_new_tokens=12, temperature=0)

    def both(rows, reference):
        """``model`` compiled, and ``reference`` (its weights) through the eager loop."""
        return (sample(model, rows, greedy, eos_id=-1, pad_id=PAD, decoder="compiled"),
                sample(reference, rows, greedy, eos_id=-1, pad_id=PAD, decoder="eager"))

    compiled, eager = both(batch, model)
    decoder = static_decode.decoder_for(model, compiled=True)
    assert decoder.compiled and not decoder.capture and not decoder.graphs
    assert [k.rows for k in decoder.steps] == [16] and decoder.capture_s > 0
    assert torch.equal(compiled.tokens_BT, eager.tokens_BT)
    assert static_decode.decoder_for(model) is not decoder  # the captured one is another
    other = make_model("llama", len(tokenizer))
    with torch.no_grad():  # what the weight receiver does
        for live, p in zip(model.parameters(), other.parameters()):
            p.add_(torch.randn_like(p) * 0.5)
            live.copy_(p)
    graphs = counters["stats"]["unique_graphs"]
    after, expected = both(batch, other)
    assert counters["stats"]["unique_graphs"] == graphs  # no compilation
    assert torch.equal(after.tokens_BT, expected.tokens_BT) and not torch.equal(after.tokens_BT, compiled.tokens_BT)
    assert (after.logprobs_BT - expected.logprobs_BT).abs().max() <= 1e-5
    small, expected = both(prompts[:2] * 4, other)  # 8 rows of the same state: bucket 8
    assert sorted(k.rows for k in decoder.steps) == [8, 16] and counters["stats"]["unique_graphs"] == graphs + 1
    assert torch.equal(small.tokens_BT, expected.tokens_BT)


@pytest.mark.skipif(int8_engine() is None, reason="no quantized engine")
def test_the_compiled_decoder_refuses_int8(tokenizer, prompts):  # noqa: F811
    model = make_model("llama", len(tokenizer))
    precision.quantize_(model, "int8").refresh()
    with pytest.raises(ValueError, match="int8"):
        sample(model, prompts, SamplingParams(max_new_tokens=2), eos_id=-1, pad_id=PAD, decoder="compiled")


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.7, 0.8)])
def test_the_step_is_capturable_no_host_read_no_graph_break(tokenizer, temperature, top_p):  # noqa: F811
    """What CUDA graph capture needs of ``_step``, checked on CPU with the decoder on the
    meta device (tensors without data): run as it is (what ``_capture_all`` captures), a
    read back to the host (``.item()``, ``int(x.sum())``, ``bool(x.any())`` in a branch,
    ``.tolist()``) or a boolean-mask index (a data-dependent shape) raises; traced by
    dynamo (what ``compiled`` compiles) with ``fullgraph=True``, a graph break raises, and
    every value in the graph is a tensor of static shape on the decoder's device (no
    host tensor made per step, whose value a graph would freeze, no unbacked size)."""
    import functools

    model = make_model("llama", len(tokenizer)).to("meta")
    decoder = StaticDecoder(model)
    key = StepKey(16, temperature, top_p, eos_id=2)
    with torch.inference_mode():
        decoder.refresh_weights()
        st = decoder._state_for(key.rows, 40)
        decoder._step(st, key)
    graphs = []

    def inspect(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.inference_mode():
        torch.compile(functools.partial(decoder._step, st, key), backend=inspect, fullgraph=True, dynamic=False)()
    (gm,) = graphs
    outputs = [(n.format_node(), v) for n in gm.graph.nodes if n.op != "output"
               for v in (lambda x: x if isinstance(x, (tuple, list)) else [x])(n.meta.get("example_value"))]
    assert len(outputs) > 50  # the whole step is one graph
    wrong = [node for node, v in outputs if not (isinstance(v, torch.Tensor) and v.device.type == "meta"
                                                  and all(isinstance(d, int) for d in v.shape))]
    assert not wrong, wrong


def test_every_input_of_the_compiled_step_is_a_static_address(tokenizer):  # noqa: F811
    """What cudagraph trees need to replay the compiled step as CUDA graphs, read on CPU
    from the metadata AOT autograd hands inductor (``TracingContext.fw_metadata``): every
    graph input is a static input (``_prepare_compile``'s marks), so none is copied into
    the trees' own buffers before each replay (the weights, the KV cache), and those the
    step writes in place are among them, or the trees would run the step without its
    graphs ("skipping cudagraphs due to mutated inputs": ``check_for_mutation`` in
    torch/_inductor/cudagraph_utils.py). On CPU inductor never gets that far (its
    graphs are CUDA only), hence this check."""
    import functools

    from torch._dynamo.backends.common import aot_autograd

    decoder = StaticDecoder(make_model("llama", len(tokenizer)), compiled=True)
    key = StepKey(8, 0.7, 0.8, eos_id=2)
    seen = {}

    def read_metadata(gm: torch.fx.GraphModule, example_inputs):
        meta = torch._guards.TracingContext.get().fw_metadata
        seen["inputs"] = len(meta.input_info)
        seen["static"] = set(meta.static_input_indices)
        seen["written"] = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
        return gm

    with torch.inference_mode():
        decoder.refresh_weights()
        st = decoder._state_for(key.rows, 40)
        st.ready_for_warmup_()
        decoder._prepare_compile(st)
        torch.compile(functools.partial(decoder._step, st, key), backend=aot_autograd(fw_compiler=read_metadata),
                      fullgraph=True, dynamic=False)()
    assert len(seen["written"]) >= 8  # the KV cache, the bias, the counters, the outputs, ...
    assert seen["static"] == set(range(seen["inputs"]))


def test_capture_warm_up_runs_on_a_state_the_last_call_filled_to_capacity(llama, prompts):  # noqa: F811
    """A new sampling setting on a used state is captured after warm-up steps on what the
    last call left there: rows at position capacity - 1 when the call filled it. The
    warm-up (``_warm_up``, run by ``_capture_all`` on a side stream; device-generic)
    must start them over, or its steps index past the rotary tables (on CUDA a
    device-side assert)."""
    decoder = StaticDecoder(llama)
    P = max(len(p) for p in prompts)
    T = capacity_for(P + 1) - P  # prompt + new tokens == the capacity
    decoder.run(prompts, SamplingParams(max_new_tokens=T, temperature=0), eos_id=-1, pad_id=PAD, generator=None)
    st = decoder.state
    assert st.capacity == P + T and int(st.pos_R[: len(prompts)].max()) == st.capacity - 1
    with torch.inference_mode():
        decoder._warm_up(st, StepKey(len(prompts), 0.7, 0.8, eos_id=-1))
    assert int(st.pos_R.max()) == 1  # each warm-up step starts at position 0
    after = decoder.run(prompts, SamplingParams(max_new_tokens=T, temperature=0), eos_id=-1, pad_id=PAD,
                        generator=None)
    eager = sample(llama, prompts, SamplingParams(max_new_tokens=T, temperature=0), eos_id=-1, pad_id=PAD,
                   decoder="eager")
    assert torch.equal(after.tokens_BT, eager.tokens_BT)  # the call sets the state up again
