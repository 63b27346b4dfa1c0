"""The tiny policy's tool warm start: its demonstrations are the calculator episodes the
episode runner records (the environment's own answers, masked), and the warm start trains
on them and saves a policy whose prompt with the tool fits its context."""

from pathlib import Path

from llamarl.app.envs.builtins import Calculator, calculate
from llamarl.app.envs.chat import ChatFormat
from llamarl.app.envs.protocol import as_messages, tool_schemas
from llamarl.app.envs.spec import build_env
from llamarl.app.envs.tool_warmstart import demonstration, expression, has_calculator, tool_demonstrations
from llamarl.app.model.policy import context_length, load_policy
from llamarl.app.rl.warmstart import WarmStartConfig, warm_start
from llamarl.app.tasks import arithmetic as tasks


def test_expressions_compute_the_answer():
    problems = tasks.make_split("train", 300, seed=3)
    assert all(calculate(expression(p)) == str(p.answer) for p in problems)
    assert {p.level for p in problems} == {1, 2, 3}


def test_tool_warm_start_demonstrates_the_episode_the_environment_plays(tmp_path):
    cfg = WarmStartConfig(out=str(tmp_path / "ws"), steps=2, batch_size=4, train_size=12, eval_size=2)
    extra = tool_demonstrations(cfg)
    warm_start(cfg, log=lambda _: None, extra=extra)
    model, tokenizer = load_policy(cfg.out)
    fmt = ChatFormat(tokenizer, tool_schemas([calculate]))
    problem = tasks.make_split("train", 3, seed=1, levels=(3,))[0]
    demo = demonstration(problem, fmt)
    assert len(demo.prompt_ids) + len(demo.completion_ids) < context_length(cfg.out)

    # Replay the demonstration's policy turns against the real environment.
    env = Calculator(levels=(3,))
    row = {"question": problem.question, **problem.meta()}
    messages = as_messages(env.reset(row))
    assert fmt.prompt(messages)[1] == demo.prompt_ids.tolist()
    ids, mask = demo.completion_ids.tolist(), demo.policy_mask.tolist()
    call_end = mask.index(False)
    answer_start = call_end + mask[call_end:].index(True)
    eot = fmt.end_of_turn_id
    assert ids[call_end - 1] == eot and ids[-1] == eot
    call = tokenizer.decode(ids[:call_end - 1])
    step = env.step(call)
    assert step.tool_calls == 1 and not step.tool_errors and not step.done
    messages.append({"role": "assistant", "content": call})
    assert fmt.observation(messages, as_messages(step.observation))[1] == ids[call_end:answer_start]
    final = env.step(tokenizer.decode(ids[answer_start:-1]))
    assert final.done and final.reward == 1.0

    assert has_calculator(build_env("calculator")) and not has_calculator(build_env("guess_number"))


def test_a_cached_warm_start_of_other_steps_is_trained_again(tmp_path):
    """A cache an earlier llamarl trained with fewer steps is replaced, one with the
    steps asked for is kept, and one that does not say is kept only without ``steps``."""
    from llamarl.app.rl.warmstart import ensure_warmstart, trained_steps

    trained: list[int] = []

    def train(steps: int):
        def run(out: str) -> None:
            Path(out).mkdir(parents=True)
            (Path(out) / "config.json").write_text("{}")
            (Path(out) / "warmstart.txt").write_text(f"{ {'out': out, 'steps': steps} }\n{ {} }\n")
            trained.append(steps)
        return run

    path = tmp_path / "ws"
    ensure_warmstart(path, train=train(250), log=lambda _: None)
    ensure_warmstart(path, train=train(600), log=lambda _: None)  # no steps asked: the cache is kept
    assert trained == [250] and trained_steps(path) == 250
    said: list[str] = []
    ensure_warmstart(path, train=train(600), steps=600, log=said.append)
    assert trained == [250, 600] and trained_steps(path) == 600 and "250 steps, not 600" in said[0]
    ensure_warmstart(path, train=train(600), steps=600, log=said.append)
    assert trained == [250, 600]
