"""Sampler throughput: ``llamarl.app.sampling.sample`` vs ``model.generate``, same model, same batch.

The model is the warm-started default policy (it writes a worked solution and then EOS,
after 10-35 tokens), loaded fp32. Both sides sample 32 distinct held-out prompts
(``tasks.make_split("eval", 32, seed=0)``) with the same parameters: temperature 1,
top-p 1, top-k disabled, ``max_new_tokens`` 64, the tokenizer's EOS and pad ids.

Fairness: the RL generator needs the log-prob of every sampled token (the behaviour
policy mu of AIPO), and the sampler returns it. So the ``generate`` side is asked for it
too: ``output_scores=True, return_dict_in_generate=True``, then the log-softmax of each
step's (processed) scores is gathered at the sampled tokens; that work is inside its
timed region. Tokens counted = generated tokens up to and including EOS (never padding),
each side counting its own output.

Both sides use the same torch threads (``--threads``, 1 unless given).
The two sides run interleaved (sampler, generate, sampler, generate, ...) with the same
seed per repeat, so noise from other processes on the machine hits both alike; medians
are reported. ``group_speedup`` is the RL shape: 8 prompts x G=4 samples (32 rows),
given to the sampler as repeated prompts and to ``generate`` as
``num_return_sequences=4``.

    python benchmarks/sampler.py --json out.json [--policy PATH] [--repeats 15]

With ``--precision`` it compares generator precisions instead (``llamarl.app.sampling.precision``):
the sampler's tokens/s at each precision, side by side (interleaved, same seeds), on the
default policy (``config`` "default") and on a larger Llama built from a config
(``LARGE_CONFIG``: hidden 512, 8 layers, ~30M parameters, random weights, where the
matmuls dominate), 8 prompts x G=4 = 32 rows by default. Rows run to
``max_new_tokens`` unless they draw EOS, so counts differ by config, not by precision
more than sampling noise. Its JSON: ``device`` and ``runs``, one flat object per
measurement (``config``, ``rows``, ``precision``, ``sampler`` "eager", ``tokens_per_s``,
plus ``params`` and the seconds one quantization of the weights took, ``quantize_s``).

    python benchmarks/sampler.py --precision fp32 int8 bf16 --json benchmarks/results/sampler_precision.json

With ``--sampler`` it compares decoders (``compare_samplers``), side by side, interleaved,
on each ``--config`` x ``--rows`` x ``--precision`` (or each ``--case CONFIG:ROWS:PRECISION``,
``CONFIG:ROWS:PRECISION:SIDE+SIDE`` for some of the sides only):

- ``captured``: ``sample(decoder="static")`` (``llamarl.app.sampling.static_decode``): captured CUDA
  graphs on CUDA, the same static steps without capture on CPU;
- ``compiled``: ``sample(decoder="compiled")``: the same static steps through
  ``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``, a bucket
  compiled at its first use (inductor's kernels, replayed as CUDA graphs on CUDA;
  inductor's C++ kernels on CPU); its ``warmup_s`` holds the compilations of the buckets
  the first call reaches (a bucket first reached later compiles inside a timed call);
- ``eager``: ``sample(decoder="eager")``, the decode loop of ``llamarl.app.sampling.decode``;
- ``generate``: ``model.generate`` with per-token log-probs, as above;
- ``generate_static``: the same with ``cache_implementation="static"`` (transformers then
  compiles the forward and replays it as CUDA graphs on CUDA; on CPU it does not compile).

Configs: ``default`` (the warm-started policy, its task prompts, fp32 only), ``60m`` and
``374m`` (random-init Llamas with a 32000-token vocabulary, ``SIZED_CONFIGS``; prompts of
``--prompt-tokens`` random tokens, rows = rows / ``--group-size`` prompts x that many
samples). Precision: the sampler sides run ``quantize_(model, precision)`` (the
generator's ``--gen-precision``); the ``generate`` sides run the model cast to that
dtype (bf16), the nearest thing ``generate`` offers. Each side's first call (capture,
compilation, allocator warm-up) is timed apart as ``warmup_s``. JSON: ``device``, then
``runs`` of flat objects (``config``, ``rows``, ``precision``, ``sampler``,
``tokens_per_s``, ``warmup_s``, ``median_tokens``, ``params``,
``weight_read_limit_tokens_per_s``: rows / (weight bytes / ``WEIGHT_READ_BYTES_PER_S``),
one read of the weights per step, on CUDA only; a side that raised has ``error`` and
no figures, and the others go on; on CUDA the two compiling sides also have
``cudagraph_skips``, how often inductor ran their compiled code without its CUDA graphs
during their calls, which must be 0 for their figures to be of graphs).
``--check-every K ...`` repeats the ``captured`` side at each
``static_decode.CHECK_EVERY`` (field ``check_every``). Between cases the models go,
dynamo's caches and cudagraph trees are reset and freed memory is given back: on CUDA a
case's two decoders hold the KV buffers of two states (19 GB each for 374M at 256 rows
and 192 positions, fp32), which with the last case's still held would not fit in 80 GB.

    python benchmarks/sampler.py --sampler captured eager generate generate_static --config default --rows 32
    python benchmarks/sampler.py --sampler compiled captured eager --config default --rows 32 64 \\
        --json benchmarks/results/sampler_compiled_cpu.json   # compile vs capture on CPU
    python benchmarks/sampler.py --device cuda --sampler captured compiled eager generate generate_static \\
        --case 374m:64:bf16 374m:256:bf16 60m:64:fp32:captured+eager+generate --max-new-tokens 128 \\
        --repeats 2 --json sampler_gpu.json     # the issue's table (benchmarks/gpu_check.py's SAMPLER_BENCH_ARGS)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from typing import Callable

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from llamarl.app.tasks import arithmetic as tasks
from llamarl.app.model.policy import encode_prompts, load_policy
from llamarl.app.sampling import GEN_PRECISIONS, SamplingParams, quantize_, sample, static_decode

LARGE_CONFIG = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=8, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, attn_implementation="sdpa")
"""The larger Llama of ``--precision``: 30.2M parameters with the default 512-token
vocabulary, ~98% of them in the decoder layers' linear layers."""


SIZED_CONFIGS = {
    "60m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8),
    "374m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16),
}
"""The random-init Llamas of ``--sampler`` (32000-token vocabulary, untied head): 60.0M
and 373.9M parameters."""
SIZED_VOCAB = 32000
SAMPLERS = ("captured", "compiled", "eager", "generate", "generate_static")
WEIGHT_READ_BYTES_PER_S = 4.3e12
"""HBM bandwidth the weight-read limit assumes: an H200's (issue 18's table)."""


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_BP, attention_mask_BP)`` of left-padded prompts, as ``generate`` wants."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


def count_tokens(tokens_BT: torch.Tensor, eos_id: int) -> int:
    """Generated tokens up to and including the first EOS of each row (all of them when
    a row has none)."""
    is_eos = tokens_BT == eos_id
    has_eos = is_eos.any(-1)
    first_eos = is_eos.int().argmax(-1)
    lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, tokens_BT.shape[1]))
    return int(lengths.sum())


def run_sampler(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
                eos_id: int, pad_id: int, seed: int, decoder: str = "auto") -> int:
    device = next(model.parameters()).device
    out = sample(model, prompts, params, eos_id=eos_id, pad_id=pad_id, decoder=decoder,
                 generator=torch.Generator(device=device).manual_seed(seed))
    return int(out.lengths_B.sum())  # a host read: the work is done when it returns


def run_generate(model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams, *,
                 eos_id: int, pad_id: int, seed: int, num_return_sequences: int = 1,
                 cache_implementation: str | None = None) -> int:
    ids, mask = left_pad(prompts, pad_id)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p, top_k=0, max_new_tokens=params.max_new_tokens,
            eos_token_id=eos_id, pad_token_id=pad_id, num_return_sequences=num_return_sequences,
            output_scores=True, return_dict_in_generate=True, **extra)
        new_BT = out.sequences[:, ids.shape[1]:]
        # What the RL generator would record: log mu(y_t) of each sampled token.
        scores_BTV = torch.stack(out.scores, dim=1)
        logp_BTV = torch.log_softmax(scores_BTV.float(), -1)
        logp_BT = logp_BTV.gather(-1, new_BT[:, :, None]).squeeze(-1)
        assert logp_BT.shape == new_BT.shape
    return count_tokens(new_BT, eos_id)


def interleaved(sides: dict[str, Callable[[int], int]], repeats: int, warmup: int = 2,
                failures: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Run the sides in turn ``repeats`` times (after ``warmup`` rounds, timed apart as
    ``warmup_s``, the first round's seconds: capture, compilation); per side: median
    seconds, median tokens and median tokens/s over the repeats. With ``failures``, a
    side that raises is recorded there (its error) and left out from then on, so that
    one broken side does not cost a one-shot GPU run the others' figures."""
    sides = dict(sides)
    warmup_s = {k: 0.0 for k in sides}
    times: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {k: [] for k in sides}
    for r in range(warmup + repeats):
        for name, fn in list(sides.items()):
            t0 = time.perf_counter()
            try:
                n = fn(10_000 + r if r < warmup else r - warmup)
            except Exception as e:
                if failures is None:
                    raise
                failures[name] = f"{type(e).__name__}: {e}"[:2000]
                print(f"side {name} failed, left out: {failures[name][:300]}", flush=True)
                del sides[name]
                continue
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(n)
            elif r == 0:
                warmup_s[name] = time.perf_counter() - t0
    return {name: {"median_s": statistics.median(times[name]), "warmup_s": warmup_s[name],
                   "median_tokens": statistics.median(tokens[name]),
                   "tokens_per_s": statistics.median(n / t for n, t in
                                                     zip(tokens[name], times[name]))}
            for name in sides}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--policy", default=None,
                        help="Hugging Face model directory (default: the warm-started policy)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (0: torch's default, one per core). "
                             "1 by default: on a small machine shared with other jobs, OpenMP "
                             "threads waiting on each other can slow either side tenfold")
    parser.add_argument("--precision", nargs="+", choices=GEN_PRECISIONS, default=None,
                        help="compare these generator precisions (see the module docstring)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32],
                        help="--precision, --sampler: decode batch sizes (prompts x G=--group-size)")
    parser.add_argument("--sampler", nargs="+", choices=SAMPLERS, default=None,
                        help="compare these decoders side by side (see the module docstring)")
    parser.add_argument("--config", nargs="+", choices=("default", *SIZED_CONFIGS), default=["default"],
                        help="--sampler: models to run (default: the warm-started policy)")
    parser.add_argument("--case", nargs="+", default=None, metavar="CONFIG:ROWS:PRECISION[:SIDE+SIDE]",
                        help="--sampler: these combinations instead of --config x --rows x --precision, "
                             "each with --sampler's sides or the ones named after a fourth colon")
    parser.add_argument("--device", default="cpu", help="--sampler: cpu or cuda")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="--sampler: prompt length of the random-init configs")
    parser.add_argument("--check-every", type=int, nargs="+", default=None,
                        help="--sampler: run the captured side at each of these CHECK_EVERY values")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sampler:
        return compare_samplers(args)
    if args.precision:
        return compare_precisions(args)

    if args.policy is None:
        from llamarl.app.rl.warmstart import ensure_warmstart
        args.policy = str(ensure_warmstart())
    model, tokenizer = load_policy(args.policy, dtype=torch.float32)
    model.eval()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    problems = tasks.make_split("eval", args.batch, seed=0)
    prompts = encode_prompts(tokenizer, [tasks.format_prompt(p.question) for p in problems])
    G = args.group_size
    group_prompts = prompts[: args.batch // G]
    repeated = [p for p in group_prompts for _ in range(G)]  # how RL asks for G samples
    common = dict(eos_id=eos_id, pad_id=pad_id)

    distinct = interleaved({
        "sampler": lambda s: run_sampler(model, prompts, params, seed=s, **common),
        "generate": lambda s: run_generate(model, prompts, params, seed=s, **common),
    }, args.repeats)
    grouped = interleaved({
        "sampler": lambda s: run_sampler(model, repeated, params, seed=s, **common),
        "generate": lambda s: run_generate(model, group_prompts, params, seed=s,
                                           num_return_sequences=G, **common),
    }, args.repeats)

    result = {
        "tokens_per_s": distinct["sampler"]["tokens_per_s"],
        "generate_tokens_per_s": distinct["generate"]["tokens_per_s"],
        "speedup": distinct["sampler"]["tokens_per_s"] / distinct["generate"]["tokens_per_s"],
        "group_tokens_per_s": grouped["sampler"]["tokens_per_s"],
        "group_generate_tokens_per_s": grouped["generate"]["tokens_per_s"],
        "group_speedup": grouped["sampler"]["tokens_per_s"] / grouped["generate"]["tokens_per_s"],
        "details": {
            "distinct": distinct, "grouped": grouped, "batch": args.batch, "group_size": G,
            "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0, "top_p": 1.0, "dtype": "float32",
            "torch_threads": torch.get_num_threads(), "policy": args.policy,
            "model_params": sum(p.numel() for p in model.parameters()),
            "model_type": model.config.model_type,
        },
    }
    print(f"policy {args.policy} ({result['details']['model_params']:,} params, "
          f"{torch.get_num_threads()} torch threads), {args.repeats} interleaved repeats, medians")
    print(f"{'case':<26}{'side':<10}{'seconds':>10}{'tokens':>9}{'tokens/s':>11}{'speedup':>9}")
    for case, res, key in ((f"{args.batch} distinct prompts", distinct, "speedup"),
                           (f"{args.batch // G} prompts x G={G}", grouped, "group_speedup")):
        for side in ("sampler", "generate"):
            r = res[side]
            sp = f"{result[key]:.2f}x" if side == "sampler" else ""
            print(f"{case:<26}{side:<10}{r['median_s']:>10.4f}{r['median_tokens']:>9.0f}"
                  f"{r['tokens_per_s']:>11.0f}{sp:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def large_model(vocab_size: int, *, pad_id: int, eos_id: int) -> PreTrainedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id, **LARGE_CONFIG)
    return LlamaForCausalLM(config).eval()


def compare_precisions(args: argparse.Namespace) -> dict:
    """Tokens/s of the sampler at each of ``args.precision``, per config and row count."""
    if args.policy is None:
        from llamarl.app.rl.warmstart import ensure_warmstart
        args.policy = str(ensure_warmstart())
    default, tokenizer = load_policy(args.policy, dtype=torch.float32)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    configs = {"default": default.eval(),
               "large": large_model(len(tokenizer), pad_id=pad_id, eos_id=eos_id)}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    G = args.group_size
    runs = []
    for config, base in configs.items():
        n_params = sum(p.numel() for p in base.parameters())
        models, quantize_s = {}, {}
        for name in args.precision:
            models[name] = copy.deepcopy(base)
            weights = quantize_(models[name], name)
            quantize_s[name] = weights.refresh() if weights is not None else 0.0
        for rows in args.rows:
            problems = tasks.make_split("eval", max(1, rows // G), seed=0)
            prompts = encode_prompts(tokenizer, [tasks.format_prompt(p.question) for p in problems])
            repeated = [p for p in prompts for _ in range(G)][:rows]
            res = interleaved({name: (lambda s, m=m: run_sampler(m, repeated, params, seed=s, eos_id=eos_id,
                                                               pad_id=pad_id))
                               for name, m in models.items()}, args.repeats)
            for name in args.precision:
                runs.append({"config": config, "rows": len(repeated), "precision": name, "sampler": "eager",
                             "tokens_per_s": res[name]["tokens_per_s"], "median_tokens": res[name]["median_tokens"],
                             "params": n_params, "quantize_s": quantize_s[name]})
                fp32 = next((r for r in runs if r["config"] == config and r["rows"] == len(repeated)
                             and r["precision"] == "fp32"), None)
                speedup = f"{runs[-1]['tokens_per_s'] / fp32['tokens_per_s']:.2f}x" if fp32 else ""
                print(f"{config:<8}{n_params / 1e6:>7.1f}M {len(repeated):>5} rows {name:<5} "
                      f"{runs[-1]['tokens_per_s']:>9.0f} tok/s {speedup:>7}  (quantize {quantize_s[name]:.3f} s, "
                      f"{res[name]['median_tokens']:.0f} tokens)", flush=True)
    result = {"device": next(default.parameters()).device.type, "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "group_size": G,
              "policy": args.policy, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _cases(args: argparse.Namespace) -> list[tuple[str, int, str, list[str]]]:
    """``(config, rows, precision, samplers)`` per case: ``--case CONFIG:ROWS:PRECISION``
    runs ``--sampler``'s sides, ``CONFIG:ROWS:PRECISION:SIDE+SIDE...`` those of them."""
    if args.case:
        out = []
        for case in args.case:
            config, rows, prec, *only = case.split(":")
            sides = only[0].split("+") if only else args.sampler
            if unknown := [s for s in sides if s not in args.sampler]:
                raise SystemExit(f"--case {case}: {', '.join(unknown)} not among --sampler {' '.join(args.sampler)}")
            out.append((config, int(rows), prec, [s for s in args.sampler if s in sides]))
        return out
    return [(c, r, p, args.sampler) for c in args.config for r in args.rows for p in (args.precision or ["fp32"])]


def sized_model(config: str, device: torch.device) -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SIZED_VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                      attn_implementation="sdpa", **SIZED_CONFIGS[config])
    return LlamaForCausalLM(cfg).to(device).eval()


def compare_samplers(args: argparse.Namespace) -> dict:
    """Tokens/s of each ``args.sampler`` side per case, interleaved (see the docstring)."""
    device = torch.device(args.device)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    G, runs = args.group_size, []
    base: dict[str, tuple] = {}
    for config, rows, prec, samplers in _cases(args):
        if config not in base:
            base.clear()  # one config's models on the device at a time
            if config == "default":
                if args.policy is None:
                    from llamarl.app.rl.warmstart import ensure_warmstart
                    args.policy = str(ensure_warmstart())
                model, tokenizer = load_policy(args.policy, device=device, dtype=torch.float32)
                ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)
            else:
                model, tokenizer, ids = sized_model(config, device), None, (2, 0)
            base[config] = (model.eval(), tokenizer, ids)
        model, tokenizer, (eos_id, pad_id) = base[config]
        if tokenizer is not None:
            problems = tasks.make_split("eval", max(1, rows // G), seed=0)
            prompts = encode_prompts(tokenizer, [tasks.format_prompt(p.question) for p in problems])
        else:
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(3, SIZED_VOCAB, (max(1, rows // G), args.prompt_tokens), generator=g).tolist()
        repeated = [p for p in prompts for _ in range(G)][:rows]
        distinct = prompts[: max(1, rows // G)]
        ours = copy.deepcopy(model)
        weights = quantize_(ours, prec)
        if weights is not None:
            weights.refresh()
        theirs = model if prec == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
        common = dict(eos_id=eos_id, pad_id=pad_id)
        sides: dict[str, Callable[[int], int]] = {}
        skips: dict[str, int] = {}
        for name in samplers:
            if name == "captured":
                for k in args.check_every or [static_decode.CHECK_EVERY]:
                    label = name if not args.check_every else f"captured@{k}"
                    sides[label] = functools.partial(_captured, ours, repeated, params, k, common)
            elif name in ("eager", "compiled"):
                sides[name] = functools.partial(_sampler_side, ours, repeated, params, name, common)
            else:
                cache = "static" if name == "generate_static" else None
                sides[name] = (lambda s, cache=cache: run_generate(
                    theirs, distinct, params, seed=s, num_return_sequences=G, cache_implementation=cache, **common))
            if name in ("compiled", "generate_static") and device.type == "cuda":
                sides[name] = functools.partial(_counting_skips, sides[name], skips, name)
        failures: dict[str, str] = {}
        res = interleaved(sides, args.repeats, failures=failures)
        n_params = sum(p.numel() for p in model.parameters())
        weight_bytes = n_params * (4 if prec == "fp32" else 2 if prec == "bf16" else 1)
        limit = rows / (weight_bytes / WEIGHT_READ_BYTES_PER_S) if device.type == "cuda" else None
        for label, error in failures.items():
            name, _, k = label.partition("@")
            runs.append({"config": config, "rows": len(repeated), "precision": prec, "sampler": name,
                         "tokens_per_s": None, "warmup_s": None, "error": error, "params": n_params,
                         "weight_read_limit_tokens_per_s": limit, **({"check_every": int(k)} if k else {})})
        for label, r in res.items():
            name, _, k = label.partition("@")
            runs.append({"config": config, "rows": len(repeated), "precision": prec, "sampler": name,
                         "tokens_per_s": r["tokens_per_s"], "warmup_s": r["warmup_s"],
                         "median_tokens": r["median_tokens"], "params": n_params,
                         "weight_read_limit_tokens_per_s": limit,
                         **({"check_every": int(k)} if k else {}),
                         **({"cudagraph_skips": skips[name]} if name in skips else {})})
            print(f"{config:<8}{n_params / 1e6:>7.1f}M {len(repeated):>5} rows {prec:<5} {label:<16}"
                  f"{r['tokens_per_s']:>10.0f} tok/s  warm-up {r['warmup_s']:.2f} s  "
                  f"({r['median_tokens']:.0f} tokens)"
                  f"{f'  CUDA GRAPHS SKIPPED {skips[name]} times' if skips.get(name) else ''}", flush=True)
        del ours, theirs, sides, weights  # GenWeights refers to its model too
        _release(device)
        result = {"device": device.type,
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "group_size": G,
                  "prompt_tokens": args.prompt_tokens, "check_every": static_decode.CHECK_EVERY,
                  "weight_read_bytes_per_s": WEIGHT_READ_BYTES_PER_S, "runs": runs}
        if args.json:  # after every case: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _counting_skips(side: Callable[[int], int], skips: dict[str, int], name: str, seed: int) -> int:
    """``side(seed)``, adding to ``skips[name]`` how often inductor ran compiled code
    without its CUDA graphs meanwhile (torch's counter, which torch logs with reasons)."""
    before = static_decode.inductor_cudagraph_skips()
    try:
        return side(seed)
    finally:
        skips[name] = skips.get(name, 0) + static_decode.inductor_cudagraph_skips() - before


def _release(device: torch.device) -> None:
    """Free what the last case held (see the module docstring): its models and decoders
    (a decoder and its model refer to each other: a cycle for ``gc``), dynamo's compiled
    code and cudagraph trees (every case compiles its own anyway), cached CUDA memory."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sampler_side(model, prompts, params, decoder: str, common: dict, seed: int) -> int:
    return run_sampler(model, prompts, params, seed=seed, decoder=decoder, **common)


def _captured(model, prompts, params, check_every: int, common: dict, seed: int) -> int:
    """The static decoder at ``check_every`` host reads (``static_decode.CHECK_EVERY``)."""
    kept = static_decode.CHECK_EVERY
    static_decode.CHECK_EVERY = check_every
    try:
        return run_sampler(model, prompts, params, seed=seed, decoder="static", **common)
    finally:
        static_decode.CHECK_EVERY = kept


if __name__ == "__main__":
    main()
