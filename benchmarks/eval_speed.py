"""Held-out evaluation: batched greedy decoding through the generators' sampler against
decoding the same problems one at a time.

    python benchmarks/eval_speed.py --json out.json                      # SmolLM2-135M-Instruct, 100 problems
    python benchmarks/eval_speed.py --problems 12 --max-new-tokens 64    # the quick version

Both sides are ``llamarl.app.rl.step.eval_completions`` on the same problems and prompts
(the built-in task's held-out problems, the policy's chat template and a system prompt
that shows the answer format), greedy: ``batched`` is what the held-out evaluation runs
(all problems in one ``sample`` call, up to 128), ``one_by_one`` the reference
(``batch_size=1``). The order is batched, one by one, batched again, so the load of the
moment falls on both; the batched time reported is the mean of its two runs. Greedy
decoding should give every problem the same completion either way; the JSON counts the
problems whose completion or verdict differs (numerics of a different batch shape can
flip a near-tie) and gives both accuracies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from llamarl.app.data.sources import PromptFormat
from llamarl.app.model import gguf_policy
from llamarl.app.model.policy import load_policy
from llamarl.app.rl import step as rl
from llamarl.app.tasks import answers
from llamarl.app.tasks import arithmetic as tasks

SYSTEM_PROMPT = ("Solve the problem. End with the final answer as '#### <number>', for example '#### 42'.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--policy", default="smollm2-135m-instruct",
                   help="a --policy spec: a Hugging Face directory, smollm2-135m-instruct or gguf:<file>")
    p.add_argument("--problems", type=int, default=100, help="held-out problems of the built-in task")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--system-prompt", default=SYSTEM_PROMPT,
                   help="with the policy's chat template; empty: the built-in task's plain prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the app's roles run 1 each)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = gguf_policy.ensure_converted(args.policy) if gguf_policy.is_gguf_policy(args.policy) else args.policy
    model, tokenizer = load_policy(path, device="cpu")
    problems = tasks.make_split("eval", args.problems, seed=0)
    if args.system_prompt:
        format_prompt = PromptFormat(chat=True, system_prompt=args.system_prompt).bind(tokenizer)
    else:
        format_prompt = tasks.format_prompt

    def run(batch_size: int) -> tuple[list[str], float]:
        t0 = time.perf_counter()
        texts = rl.eval_completions(model, tokenizer, problems, max_new_tokens=args.max_new_tokens,
                                    batch_size=batch_size, format_prompt=format_prompt)
        return texts, time.perf_counter() - t0

    batched, t_batched_1 = run(128)
    alone, t_alone = run(1)
    batched_again, t_batched_2 = run(128)
    verdicts = {name: [answers.is_correct(t, p.answer) for p, t in zip(problems, texts)]
                for name, texts in (("batched", batched), ("one_by_one", alone))}
    t_batched = (t_batched_1 + t_batched_2) / 2
    result = {
        "policy": args.policy, "problems": args.problems, "max_new_tokens": args.max_new_tokens,
        "system_prompt": args.system_prompt, "threads": args.threads,
        "seconds": {"batched": [t_batched_1, t_batched_2], "one_by_one": t_alone},
        "speedup": t_alone / t_batched,
        "accuracy": {k: sum(v) / len(v) for k, v in verdicts.items()},
        "format": rl.grade(problems, batched)["format"],
        "completion_tokens": sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in batched),
        "differing_completions": sum(a != b for a, b in zip(batched, alone)),
        "differing_verdicts": sum(a != b for a, b in zip(verdicts["batched"], verdicts["one_by_one"])),
        "batched_repeatable": batched == batched_again,
        "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
    }
    print(f"{args.problems} problems, up to {args.max_new_tokens} new tokens, {args.threads} thread(s): "
          f"batched {t_batched:.1f} s (runs {t_batched_1:.1f}, {t_batched_2:.1f}), one by one {t_alone:.1f} s: "
          f"{result['speedup']:.2f}x; accuracy {result['accuracy']['batched']:.3f} vs "
          f"{result['accuracy']['one_by_one']:.3f}; completions differing {result['differing_completions']}, "
          f"verdicts differing {result['differing_verdicts']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
