"""Which system prompt makes SmolLM2-135M-Instruct answer the shipped GSM8K sample in a
form the verifier reads? Held-out greedy accuracy and parsable share per candidate.

    python benchmarks/system_prompts.py --json benchmarks/results/system_prompts.json

Each candidate formats the held-out split of the shipped sample (``--dataset
gsm8k-sample``) with the model's chat template and the candidate as the system message,
then decodes greedily (``llamarl.app.rl.step.evaluate``, ``math_verifier``'s verdict) with the
real-model job's ``--max-new-tokens``. ``format`` is the share of completions with a final
answer the verifier can read (``####`` or ``\\boxed{}``): a prompt the model misreads shows
there first. The shipped prompt is ``components.llamarl.DEFAULT_SYSTEM_PROMPT``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llamarl.app.config import TrainerConfig
from llamarl.app.data import sources as data
from llamarl.app.model.policy import load_policy
from llamarl.app.rl import step as rl
from llamarl.components.llamarl import DEFAULT_MAX_NEW_TOKENS, REAL_MODEL_POLICY, DEFAULT_SYSTEM_PROMPT

CANDIDATES = {
    "none": "",
    "terse": "Solve the problem. Give the final answer as '#### N'.",
    "example_marker": "Solve the math problem step by step. At the end, write the final answer after '####', "
                      "for example: #### 42",
    "shipped": DEFAULT_SYSTEM_PROMPT,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--eval-size", type=int, default=100, help="held-out problems (the sample has 100)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 keeps torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = data.resolve_policy(REAL_MODEL_POLICY)
    model, tokenizer = load_policy(policy)
    results = {}
    for name in args.candidates:
        cfg = TrainerConfig(policy=REAL_MODEL_POLICY, dataset="gsm8k-sample", chat_template=True,
                            system_prompt=CANDIDATES[name], eval_size=args.eval_size)
        prompts = data.prepare(data.read(cfg, log=lambda _: None), cfg, tokenizer, log=lambda _: None)
        t0 = time.time()
        m = rl.evaluate(model, tokenizer, prompts.held_out, max_new_tokens=args.max_new_tokens,
                        format_prompt=prompts.format_prompt, batch_size=50)
        results[name] = {"system_prompt": CANDIDATES[name], "accuracy": m["accuracy"], "format": m["format"],
                         "problems": len(prompts.held_out), "seconds": round(time.time() - t0, 1)}
        print(f"{name:16s} accuracy {m['accuracy']:.3f}  format {m['format']:.3f}  ({results[name]['seconds']} s)",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"policy": REAL_MODEL_POLICY, "max_new_tokens": args.max_new_tokens,
                                         "greedy": True, "candidates": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
