"""Static-shape decoding for the Llama fast path: each decode step is one function of
fixed shapes per batch bucket, and on CUDA it is captured once as a CUDA graph and
replayed, so a step costs one launch and the host never waits for the device per token.

Why: on a GPU the eager loop (``decode.run``) is bound by kernel launches and Python (a
step of a 374M Llama cost ~10 ms at 64 and at 256 rows alike on an H200), and it reads
``alive`` back to the host after every token, so the CPU cannot queue the next step.

What is static (the device tensors, the batch buckets, the KV capacity) is
``llamarl.app.sampling.static_state``.

One step (``StaticDecoder._step``): ``LlamaFastPath.decode_at`` (the eager decode's code,
writing at a device-side slot), then the sampling the eager loop does, inside the step:
temperature and top-p (``logits.process_logits``), the inverse-CDF draw at the row's u
(``logits.inverse_cdf``), the log-prob gather, the EOS check.

Host syncs: the live rows are counted on the host every ``CHECK_EVERY`` steps only (to
stop early and to compact); in between, steps are queued back to back.

Weights: the step reads the fast path's fused kernels from storage this decoder owns,
refreshed in place when the model's parameters have changed since the last call (the
weight receiver's in-place copy shows in their version counters): at fp32 the fused
matrices are rewritten where they are (``fused_weights(out=...)``; o and down are the
parameters themselves), at another precision the kernels ``GenWeights.refresh`` built
are copied in (``FusedLinears.load_``). A new version therefore needs no recapture and
no new storage for what the graphs read. Ordering on CUDA: the receiver's thread writes
only its staging buffers; the copy into the parameters (``llamarl.app.weights.subscriber.swap_staged``)
and this refresh run on the generator's own thread between ``sample`` calls, on its
current stream, the one the graphs replay on, so a copy starts after the last replay
that read the old weights and the next call's replays start after it, with no host
wait. (The warm-up and the capture run on a side stream of the decoder's own, with
``capture_error_mode="thread_local"``: the receiver's thread may use the GPU meanwhile;
cuBLAS's workspaces are dropped around each capture, as cudagraph trees do, so that
the one a graph bakes in lives in the graphs' own memory pool: ``_capture_all``.)

On CPU the same code runs without capture (``capture=False``): the bucketing, masks and
in-place updates are what the CPU tests check. Whether a CPU generator uses it is
``DEFAULT_DECODER`` (see there for the measurement).

Two ways to run the steps (``StaticDecoder(compiled=...)``; ``sample(decoder="static")``
and ``sample(decoder="compiled")``), the same ``_step`` in both, as issue 18 asks to
measure:

- *captured* (``static``): on CUDA each bucket's step is captured by hand as a
  ``torch.cuda.CUDAGraph`` at the call's start (``_capture_all``) and replayed; on CPU
  the step runs as it is. The graph's static inputs are exactly the tensors above,
  chosen here, so a weight swap or a compaction cannot trigger a re-trace or a copy
  into compile-managed buffers, and a capture costs milliseconds, not a compilation.
- *compiled* (``compiled``): each bucket's step goes through ``torch.compile(mode=
  "reduce-overhead", fullgraph=True, dynamic=False)`` at its first use (logged with its
  seconds): inductor fuses the elementwise work between the matmuls (norms, rotary,
  SiLU, the sampling) into generated kernels, and on CUDA replays the result as CUDA
  graphs (cudagraph trees). Every tensor the step reads or writes is marked as a
  static address (``torch._dynamo.mark_static_address``): cudagraph trees copy any
  other input into their own buffer before each replay, and skip the graphs of a
  function that writes one in place, which the step does to all of its state. On CPU
  ``reduce-overhead`` has no graphs to replay: compile then means inductor's C++
  kernels for the same fused work, and the launch-free CPU gains what fusion and
  fewer Python dispatches save. A bucket compiles at its first use, not at the call's
  start: a compilation costs seconds on CPU (tens on a GPU for a 374M model) per
  bucket, and a batch whose rows rarely end never reaches the smaller buckets.

Which is faster where is ``benchmarks/sampler.py``'s to measure (on CPU:
``benchmarks/results/sampler_compiled_cpu.json``; on CUDA: ``benchmarks/gpu_check.py``'s
``sampler_benchmark``). Until a GPU measurement says otherwise the hand capture is
``auto``'s choice on CUDA: it replays the step's own kernels with no compile time per
bucket, and its static inputs are exactly the tensors above. Compile captures the same
work only because the step writes the KV cache by ``index_put_`` on the KV tensor itself
(``StaticState.store_kv`` says why).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch
from transformers import PreTrainedModel

from llamarl.app.sampling import decode, precision
from llamarl.app.sampling.kernels import Int8DynamicKernel
from llamarl.app.sampling.kv_cache import Prefixes, new_cache
from llamarl.app.sampling.llama_fast import FusedLinears, FusedWeights, LlamaFastPath, fused_linears, fused_weights
from llamarl.app.sampling.static_state import StaticState, StepKey, bucket_for, capacity_for
from llamarl.app.sampling.logits import inverse_cdf, process_logits, token_logprobs

if TYPE_CHECKING:
    from llamarl.app.sampling import SamplingParams

log = logging.getLogger("llamarl")

CHECK_EVERY = 8
"""Decode steps between two host reads of the live rows. On a GPU a read stalls the launch
queue until the device catches up; what a larger k costs is up to k - 1 steps run after
the last row ended, and k - 1 steps in a bigger bucket after rows could have left it.
Measured on CPU only, where a read costs nothing (``benchmarks/sampler.py --sampler
captured --check-every 1 4 8 16 --config default --rows 32 64``, 2 shared cores, loaded;
``benchmarks/results/sampler_decoders_cpu.json``): 32 rows 3204 / 3440 / 3453 / 2686
tokens/s, 64 rows 5727 / 5128 / 4923 / 5298: 8 costs at most about the noise there, 16
starts to cost. TO RE-MEASURE ON A GPU (``--device cuda``), where the reads are what k
saves."""

CAPTURE_WARMUP_STEPS = 3
"""Steps run on a side stream before a capture (cuBLAS and allocator warm-up, as
``torch.cuda.graphs`` asks)."""

COMPILE_RECOMPILE_LIMIT = 64
"""dynamo's compiled entries allowed on ``_step``'s code object (its default, 8, is
per code object, and every decoder of a process compiles the same ``_step``: a bucket
and sampling setting per entry, e.g. 3 cases of ``benchmarks/sampler.py`` take 3-14).
The compiled decoder raises the process's ``torch._dynamo.config.recompile_limit`` to
this at least; past it, ``fullgraph=True`` makes dynamo raise rather than fall back."""

_ATTACHED = {False: "llamarl_static_decoder", True: "llamarl_compiled_decoder"}
"""The model attribute holding its decoder, per ``compiled``."""


class StaticDecoder:
    """The static-shape decode of one model (``decoder_for``): its state, its fused
    weights and, on CUDA, one captured graph per bucket and sampling setting, or with
    ``compiled`` one ``torch.compile``d step per bucket and setting on any device (the
    module docstring). ``capture``: CUDA graphs by hand (default: on CUDA, unless
    ``compiled``)."""

    def __init__(self, model: PreTrainedModel, *, compiled: bool = False, capture: bool | None = None) -> None:
        if not LlamaFastPath.supports(model):
            raise ValueError("static decoding runs the Llama fast path, which does not support "
                             f"{type(model).__name__}")
        if compiled and capture:
            raise ValueError("a compiled decoder's graphs are torch.compile's (reduce-overhead): capture=True "
                             "would capture its steps a second time")
        self.model = model
        self.device = next(model.parameters()).device
        self.compiled = compiled
        self.capture = not compiled and (self.device.type == "cuda" if capture is None else capture)
        self.linears: FusedLinears | None = None
        self.state: StaticState | None = None
        self.graphs: dict[StepKey, torch.cuda.CUDAGraph] = {}
        self.steps: dict[StepKey, Callable[[], None]] = {}
        """``compiled``: the compiled step of each bucket and setting of ``state``."""
        self.capture_s = 0.0
        """Seconds spent capturing graphs or compiling steps, all of them (0 on CPU
        uncompiled)."""
        self.cudagraph_skips = 0
        """``compiled`` on CUDA: how often inductor ran compiled steps without their CUDA
        graphs over all calls so far (torch's ``counters["inductor"]["cudagraph_skips"]``
        during them: at compilation, and at replays, e.g. past cudagraph trees'
        re-recording limit), each logged by torch with its reason; 0 is the point."""
        self._stamp: tuple | None = None
        self._fused: FusedWeights | None = None
        self._pool = None
        """The memory pool every graph of ``graphs`` was captured into (``_capture_all``);
        None while there are none."""
        self._capture_stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model (a reference model, a quantized generator copy) gets no
        decoder: this one's state and graphs belong to the original's weights; the copy
        makes its own at its first static call."""
        return None

    # -- weights -------------------------------------------------------------------
    @staticmethod
    def _storage(stamp: tuple | None) -> tuple | None:
        return None if stamp is None else tuple(ptr for ptr, _ in stamp[1:])

    @torch.inference_mode()
    def refresh_weights(self) -> bool:
        """Bring the fused kernels the steps read up to the model's weights, in place;
        True when they changed."""
        stamp = precision.weights_stamp(self.model)
        if stamp == self._stamp:
            return False
        if self.linears is not None and self._storage(stamp) != self._storage(self._stamp):
            # Parameters rebound to new storage (not copied into, as the weight receiver
            # does): the kernels and graphs read the old one. Start over (rare).
            log.info("static decoder: the model's parameters moved to new storage; rebuilding its "
                     "weights, state and graphs")
            self.linears = self.state = None
            self._drop_graphs()
        quantized = precision.fast_linears(self.model)
        if self.compiled and quantized is not None and any(
                isinstance(k, Int8DynamicKernel) for layer in quantized.layers for k in layer):
            raise ValueError("the compiled decoder runs kernels made of tensors (fp32, bf16, fp8); this "
                             "precision's kernels hold prepacked objects torch.compile cannot trace (int8: "
                             "use the static or the eager decoder)")
        if self.linears is None:
            # fp32: the kernels are the fused matrices themselves (and the o and down
            # parameters), which a new version rewrites in place.
            self._fused = None if quantized is not None else fused_weights(self.model)
            self.linears = fused_linears(self.model, precision.fast_kernel(self.model), self._fused)
        elif quantized is not None:
            self.linears.load_(quantized)  # the precision's kernels for this version
        else:
            fused_weights(self.model, out=self._fused)
        self._stamp = stamp
        return True

    # -- state and graphs ------------------------------------------------------------
    def _state_for(self, rows: int, positions: int) -> StaticState:
        st = self.state
        if st is None or st.rows < rows or st.capacity < positions:
            rows = max(rows, st.rows if st else 0)
            capacity = capacity_for(max(positions, st.capacity if st else 0))
            fast_path = LlamaFastPath(self.model, capacity, self.linears)
            self.state = st = StaticState(fast_path, rows, capacity)
            self._drop_graphs()  # they read the old state's tensors
        return st

    def _drop_graphs(self) -> None:
        """Forget every captured graph and compiled step, and the graphs' memory pool: a
        pool all of whose graphs are gone must not be captured into again. torch's
        allocator keeps such a pool while any block of it is still allocated, and a
        capture into it then fails ``create_or_incref_pool``'s internal assert
        ``use_count > 0`` (c10/cuda/CUDACachingAllocator.cpp); a new state's graphs get
        a new pool (blocks can stay allocated there: a cuBLAS workspace made in a capture
        by torch's lazy initialization, which ``_capture_all`` drops, or anything else
        torch keeps from a capture)."""
        self.graphs.clear()
        self.steps.clear()
        self._pool = None

    def _step(self, st: StaticState, key: StepKey) -> None:
        """One decode step of the first ``key.rows`` rows, then the next token's draw."""
        b = key.rows
        logits_bV = st.fast_path.decode_at(st.tok_R[:b], st.pos_R[:b], st.decode_kv(b), st.store_kv(b),
                                           st.slot_1, st.bias_RC[:b, None, None, :])
        st.pos_R[:b].add_(1)
        st.slot_1.add_(1)
        self._sample(st, logits_bV, key)

    @staticmethod
    def _sample(st: StaticState, logits_bV: torch.Tensor, key: StepKey) -> None:
        """Column ``t_1`` of the outputs for the first ``len(logits_bV)`` rows; ``t_1`` + 1."""
        b = logits_bV.shape[0]
        logp_bV = process_logits(logits_bV, key.temperature, key.top_p)
        rows_b, col_b = st.out_row_R[:b], st.t_1.expand(b)
        if key.temperature == 0:
            tok_b = logp_bV.argmax(-1)
        else:
            tok_b = inverse_cdf(logp_bV, st.u_BT[rows_b, col_b])
        st.tokens_BT.index_put_((rows_b, col_b), tok_b)
        st.logprobs_BT.index_put_((rows_b, col_b), token_logprobs(
            logits_bV, tok_b, key.temperature, key.top_p, sampled_from_NV=logp_bV))
        st.alive_R[:b].logical_and_(tok_b != key.eos_id)
        st.tok_R[:b].copy_(tok_b)
        st.t_1.add_(1)

    def _run_step(self, st: StaticState, key: StepKey) -> None:
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        elif self.compiled:
            step = self.steps.get(key)
            if step is None:
                self._compile(st, key)  # which runs the step once
            else:
                step()
        else:
            self._step(st, key)

    def _static_inputs(self, st: StaticState) -> list[torch.Tensor]:
        """Every tensor a step reads or writes: the state's, the kernels', the rotary
        tables and the model's parameters (the embedding)."""
        state = [v for v in vars(st).values() if isinstance(v, torch.Tensor)]
        kernels = [v for v in _kernel_attributes(self.linears) if isinstance(v, torch.Tensor)]
        rotary = [st.fast_path.cos_LD, st.fast_path.sin_LD]
        return [*state, *kernels, *rotary, *self.model.parameters()]

    def _prepare_compile(self, st: StaticState) -> None:
        """Mark every tensor a step of ``st`` touches as a static address, and let dynamo
        keep an entry per bucket and setting (``COMPILE_RECOMPILE_LIMIT``)."""
        import torch._dynamo

        for x in self._static_inputs(st):
            torch._dynamo.mark_static_address(x)
        config = torch._dynamo.config  # recompile_limit: cache_size_limit in older torch
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), COMPILE_RECOMPILE_LIMIT))

    def _compile(self, st: StaticState, key: StepKey) -> None:
        """``key``'s step through ``torch.compile`` (module docstring), compiled and run
        once: the first call of a bucket's step is its compilation."""
        self._prepare_compile(st)
        step = torch.compile(functools.partial(self._step, st, key), mode="reduce-overhead", fullgraph=True,
                             dynamic=False)
        t0 = time.perf_counter()
        step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.capture_s += seconds
        self.steps[key] = step
        log.info("static decoder: compiled the decode step of bucket %d (capacity %d, temperature %g, top-p %g) "
                 "in %.2f s", key.rows, st.capacity, key.temperature, key.top_p, seconds)

    def _warm_up(self, st: StaticState, key: StepKey) -> None:
        """``CAPTURE_WARMUP_STEPS`` steps on whatever ``st`` holds (the last call's rows,
        or zeros), each from a state it can run on (``StaticState.ready_for_warmup_``)."""
        for _ in range(CAPTURE_WARMUP_STEPS):
            st.ready_for_warmup_()
            self._step(st, key)

    def _capture_all(self, st: StaticState, template: StepKey) -> None:
        """One graph per bucket at ``template``'s sampling setting (before the call
        sets the state up: the warm-up steps write into it)."""
        keys = [StepKey(b, template.temperature, template.top_p, template.eos_id) for b in st.buckets]
        keys = [k for k in keys if k not in self.graphs]
        if not keys:
            return
        t0 = time.perf_counter()
        # One memory pool for every bucket's graph: they never run concurrently, and no
        # tensor a capture allocates outlives it (every output is a state tensor made
        # outside), so any order of replays is safe.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # The warm-up and the capture on one stream of the decoder's own, on its device
        # (torch.cuda.graph's default capture stream is one per process, made on
        # whichever device was current then).
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream, current = self._capture_stream, torch.cuda.current_stream(self.device)
        for key in keys:
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._warm_up(st, key)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # cuBLAS's workspaces, one per (handle, stream) made at its first matmul, are
            # dropped, as cudagraph trees do around every warm-up and recording
            # (torch/_inductor/cudagraph_trees.py, clear_cublas_manager), before the
            # capture and after it. The capture's matmuls then bake in a workspace made
            # inside it, from the graphs' own pool, which only captures into that pool
            # allocate from and whose graphs never run concurrently; one made outside,
            # in the ordinary pool, would be handed to other tensors at the next clear
            # (the compiled decoder's, transformers' static cache) while the graph still
            # replays into it. Dropped after the capture, none of it stays allocated in
            # the pool (see _drop_graphs).
            torch._C._cuda_clearCublasWorkspaces()
            try:
                # thread_local: the weight receiver's thread may use the GPU meanwhile
                # (its work is not captured, and does not break this capture).
                with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                    self._step(st, key)
            finally:
                torch._C._cuda_clearCublasWorkspaces()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.capture_s += seconds
        log.info("static decoder: captured %d decode steps (buckets %s, capacity %d) in %.2f s",
                 len(keys), ",".join(str(k.rows) for k in keys), st.capacity, seconds)

    # -- one call --------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, prompts: list[list[int]], params: SamplingParams, *, eos_id: int, pad_id: int,
            generator: torch.Generator | None, then: decode.Then | None = None,
            prefixes: Prefixes | None = None) -> decode.Samples | None:
        """``sample`` through static steps (prefilled after ``prefixes``' past); the
        ``Samples`` go on to ``then`` (``decode.finish``)."""
        with self._lock:
            skips = inductor_cudagraph_skips() if self.compiled else 0
            out = self._run(prompts, params, eos_id=eos_id, pad_id=pad_id, generator=generator, then=then,
                            prefixes=prefixes)
            if self.compiled and self.device.type == "cuda" and (new := inductor_cudagraph_skips() - skips):
                self.cudagraph_skips += new
                log.warning("static decoder: inductor ran compiled decode steps without their CUDA graphs %d "
                            "times in this call (%d so far; torch logged why)", new, self.cudagraph_skips)
            return out

    def _run(self, prompts, params, *, eos_id, pad_id, generator, then, prefixes):
        device = self.device
        B, T = len(prompts), params.max_new_tokens
        P = max(len(p) for p in prompts)
        self.refresh_weights()
        st = self._state_for(B, P + T)
        b = bucket_for(B, st.buckets)
        key = StepKey(b, params.temperature, params.top_p, eos_id)
        if self.capture:
            self._capture_all(st, key)

        cache, _ = new_cache(self.model, st.capacity, st.kv)  # writes the prefill set
        _, src_B, (logits_UV, valid_UP, next_pos_U1) = decode.prefill_fast(st.fast_path, prompts, cache, prefixes)
        # Rows B..b-1 copy row 0 (finite values to compute on) and write to the sink row.
        src_b = torch.cat([src_B, src_B[:1].expand(b - B)])
        st.kv[1, :, :, :b, :, :P] = st.kv[0, :, :, :, :, :P].index_select(2, src_b)
        st.bias_RC[:b].fill_(float("-inf"))
        st.bias_RC[:b, :P].masked_fill_(valid_UP[src_b], 0.0)
        st.pos_R[:b] = next_pos_U1[src_b, 0]
        st.out_row_R[:b] = torch.arange(b, device=device)
        st.out_row_R[B:b] = st.rows
        st.alive_R[:b] = torch.arange(b, device=device) < B
        st.tokens_BT[:B, :T] = pad_id
        if params.temperature > 0:
            st.u_BT[:B, :T] = torch.rand((B, T), generator=generator, device=device)
        st.t_1.fill_(0)
        st.slot_1.fill_(P)
        self._sample(st, logits_UV[src_b], key)

        t = 1
        while t < T:
            for _ in range(min(CHECK_EVERY, T - t)):
                self._run_step(st, key)
                t += 1
            if t >= T:
                break
            live = int(st.alive_R[:b].sum())  # the one host sync per CHECK_EVERY steps
            if live == 0:
                break
            smaller = bucket_for(live, st.buckets)
            if smaller < b:
                # Live rows first, then finished ones to fill the bucket.
                order = torch.argsort((~st.alive_R[:b]).to(torch.uint8), stable=True)[:smaller]
                st.select_rows_(order, P + t)
                b = smaller
                key = StepKey(b, params.temperature, params.top_p, eos_id)
        return decode.finish(st.tokens_BT[:B, :T].clone(), st.logprobs_BT[:B, :T].clone(),
                             eos_id=eos_id, pad_id=pad_id, then=then)


def decoder_for(model: PreTrainedModel, *, compiled: bool = False) -> StaticDecoder:
    """The model's static decoder (``compiled``: its compiled one), made on first use and
    kept on the model (its state, weights and graphs live as long as the model)."""
    decoder: StaticDecoder | None = getattr(model, _ATTACHED[compiled], None)
    if decoder is None:
        decoder = StaticDecoder(model, compiled=compiled)
        setattr(model, _ATTACHED[compiled], decoder)
    return decoder


def _kernel_attributes(linears: FusedLinears) -> list:
    """The attribute values of every kernel of ``linears`` (their weights and scales)."""
    return [v for layer in [*linears.layers, (linears.head,)] for kernel in layer for v in vars(kernel).values()]


def inductor_cudagraph_skips() -> int:
    """How many compiled functions inductor has run without their CUDA graphs so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]
