"""The environments: reasoning-gym tasks scored by their own score_answer, the
calculator task with tools, the guess-the-number game, ``--env`` specs, and an OpenEnv
environment run unchanged through the adapter (2 steps of an episode)."""

import pytest
import torch

pytest.importorskip("reasoning_gym")
pytest.importorskip("openenv")

from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from llamarl.app.envs import UNKNOWN_TOOL  # noqa: E402
from llamarl.app.envs.builtins import Calculator, GuessNumber, calculate  # noqa: E402
from llamarl.app.config import GeneratorConfig  # noqa: E402
from llamarl.app.envs.episodes import DONE, MAX_TURNS, EpisodeRunner  # noqa: E402
from llamarl.app.envs.spec import build_env  # noqa: E402
from llamarl.app.errors import ConfigError  # noqa: E402
from llamarl.app.model.policy import create_default_policy  # noqa: E402
from llamarl.app.rl.contract import from_message, to_message  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    return create_default_policy()


def test_reasoning_gym_rows_and_its_own_score(policy):
    make = build_env("reasoning_gym:basic_arithmetic(min_terms=2,max_terms=3)")
    env = make()
    train, test = env.rows("train", 4, seed=0), env.rows("test", 4, seed=0)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    row = train[0]
    env.reset(row)
    assert env.step(f"I think\n#### {row['answer']}").reward == 1.0
    env.reset(row)
    assert env.step("#### 123456789").reward == 0.0
    words = build_env("reasoning_gym:spell_backward")()  # answers that are words, not numbers
    word = words.rows("test", 1, seed=0)[0]
    words.reset(word)
    assert words.step(f"<answer>{word['answer']}</answer>").reward == 1.0
    runner = EpisodeRunner(*policy, make, GeneratorConfig(max_new_tokens=4))
    groups = runner.groups(train[:2], group_size=2, version=lambda: 0, rng=torch.Generator().manual_seed(0))
    runner.close()
    assert runner.stats.ends == {DONE: 4}
    again = from_message(to_message(groups[0]))  # the row travels as the rollouts' task
    assert again.rollouts[0].task["question"] == train[0]["question"] and "env_reward" in again.rollouts[0].task


def test_calculator_tools_and_answer():
    env = Calculator()
    row = env.rows("train", 1, seed=0)[0]
    assert row["question"] in env.reset(row)
    step = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "(12 + 5) * 3"}}</tool_call>')
    assert step.observation[0]["content"] == "51" and not step.done and step.tool_errors == ()
    bad = env.step('<tool_call>{"name": "eval", "arguments": {}}</tool_call>')
    assert bad.tool_errors == (UNKNOWN_TOOL,)
    assert env.step(f"#### {row['answer']}").reward == 1.0
    with pytest.raises(ValueError):
        calculate("__import__('os')")
    assert calculate("7 / 2") == "3.5"


def test_guess_number_is_a_multi_turn_game():
    env = GuessNumber(high=20)
    row = env.rows("train", 1, seed=3)[0]
    env.reset(row)
    low, high, steps = 1, 20, 0
    while True:
        guess = (low + high) // 2
        step = env.step(f"{guess}")
        steps += 1
        if step.done:
            break
        low, high = (guess + 1, high) if step.observation == "higher" else (low, guess - 1)
    assert step.reward == 1.0 and guess == row["secret"] and steps <= 5


def test_env_specs():
    assert isinstance(build_env("guess_number(high=7)")(), GuessNumber)
    assert isinstance(build_env("llamarl.app.envs.builtins:Calculator")(), Calculator)
    with pytest.raises(ConfigError, match="unknown env 'nope'"):
        build_env("nope")
    with pytest.raises(ConfigError, match="no task 'nope'"):
        build_env("reasoning_gym:nope")


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class EchoEnv(OpenEnvEnvironment[EchoAction, EchoObservation, State]):
    """An OpenEnv environment as its template writes one: echoes, done after 2 steps,
    rewarded by the length of what it echoed."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: the G episodes run at once

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return EchoObservation(echoed=f"ready {seed}")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= 2
        return EchoObservation(echoed=action.message, done=done, reward=float(len(action.message)) if done else None)

    @property
    def state(self):
        return self._state


def test_an_openenv_environment_runs_unchanged(policy):
    make = build_env(f"openenv:{__name__}:EchoEnv")
    rows = make().rows("train", 2, seed=0)
    runner = EpisodeRunner(*policy, make, GeneratorConfig(max_new_tokens=3, max_turns=3))
    groups = runner.groups(rows, group_size=1, version=lambda: 0, rng=torch.Generator().manual_seed(0))
    runner.close()
    assert runner.stats.ends == {DONE: 2} and runner.stats.turns == 4  # 2 steps each, then done
    tokenizer = policy[1]
    for g in groups:
        r = g.rollouts[0]
        assert r.prompt.endswith(f"ready {r.task['seed']}") and r.task["turns"] == 2
        # The reward of the second step: the length of the second turn, as OpenEnv got it.
        m = r.policy_mask.tolist()
        start = [i for i in range(1, len(m)) if m[i] and not m[i - 1]][0]
        second = r.completion_ids[start:]
        text = tokenizer.decode([t for t in second.tolist() if t != tokenizer.eos_token_id])
        assert r.task["env_reward"] == len(text)


def test_an_openenv_app_served_over_http_runs_through_its_client(policy):
    """The same environment served as OpenEnv serves one (its FastAPI app, over a
    WebSocket), reached by OpenEnv's own client: 2 steps of each episode."""
    import socket
    import threading
    import time

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.generic_client import GenericEnvClient

    from llamarl.app.envs.adapters import OpenEnv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_fastapi_app(EchoEnv, EchoAction, EchoObservation,
                                                              max_concurrent_envs=4),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        def make():
            client = GenericEnvClient(base_url=f"http://127.0.0.1:{port}").sync()
            return OpenEnv(client, action=lambda turn: {"message": turn})

        runner = EpisodeRunner(*policy, make, GeneratorConfig(max_new_tokens=3, max_turns=3))
        groups = runner.groups([{"seed": 11}], group_size=2, version=lambda: 0,
                               rng=torch.Generator().manual_seed(0))
        runner.close()
    finally:
        server.should_exit = True
        thread.join(10)
    assert runner.stats.ends == {DONE: 2} and runner.stats.turns == 4
    assert all(r.prompt.endswith("ready 11") and r.task["turns"] == 2 for r in groups[0].rollouts)
