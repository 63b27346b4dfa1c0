"""The episode runner: multi-turn episodes batched per turn, environment tokens masked,
each turn's weight version recorded, and a hung or crashing environment step ending only
its own episode, counted by reason."""

import threading

import pytest
import torch

from llamarl.app.envs import Step
from llamarl.app.config import GeneratorConfig
from llamarl.app.envs.episodes import (DONE, ENV_ERROR, MAX_TURNS, STEP_TIMEOUT, EpisodeRunner)
from llamarl.app.model.policy import create_default_policy
from llamarl.app.rl.contract import from_message, policy_segments, to_message


class Chatty:
    """Answers every turn with "ok"; done after ``turns`` turns when row["stop"] says so."""

    tools = ()

    def __init__(self):
        self.n = 0

    def rows(self, split, n, seed):
        return [{"question": f"{split} {i}"} for i in range(n)]

    def reset(self, row):
        self.row = row
        return f"Q: {row['question']}\nA:"

    def step(self, turn):
        self.n += 1
        if self.row.get("hang"):
            threading.Event().wait(30)
        if self.row.get("crash"):
            raise RuntimeError("env bug")
        done = self.n >= self.row.get("stop", 99)
        return Step(observation="ok", reward=1.0 if done else 0.5, done=done)


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = create_default_policy()
    return model, tokenizer


def runner(policy, workers=8, **gen):
    model, tokenizer = policy
    return EpisodeRunner(model, tokenizer, Chatty, GeneratorConfig(max_new_tokens=4, **gen), workers=workers)


def test_turns_are_segments_with_their_versions_and_the_environment_is_masked(policy):
    r = runner(policy, max_turns=3, max_episode_tokens=200)
    versions = iter(range(10, 100))
    swaps = []
    groups = r.groups([{"question": "a"}, {"question": "b", "stop": 2}], group_size=2,
                      version=lambda: swaps[-1], between_turns=lambda: swaps.append(next(versions)),
                      rng=torch.Generator().manual_seed(0), generator_id=3, first_seq=7)
    r.close()
    assert [g.group_id for g in groups] == [(3, 7), (3, 8)]
    # A round samples whichever episodes are ready: all four at first; later rounds may
    # split when some steps finish after others (decoding goes on beside them).
    assert swaps[0] == 10 and 3 <= len(swaps) <= 10
    ends = [[rr.task["episode_end"] for rr in g.rollouts] for g in groups]
    assert ends == [[MAX_TURNS] * 2, [DONE] * 2]
    assert r.stats.ends == {MAX_TURNS: 2, DONE: 2} and r.stats.turns == 3 * 2 + 2 * 2
    ok_ids = policy[1]("\nok\n", add_special_tokens=False)["input_ids"]
    for g, turns in zip(groups, (3, 2)):
        assert g.version == max(int(ro.segment_versions.max()) for ro in g.rollouts)
        for ro in g.rollouts:
            assert ro.task["turns"] == turns and policy_segments(ro.policy_mask) == turns
            v = ro.segment_versions.tolist()  # each turn its round's version, in order
            assert len(v) == turns and v == sorted(set(v)) and set(v) <= set(swaps) and ro.oldest_version == 10
            env = ~ro.policy_mask
            assert int(env.sum()) == (turns - 1) * len(ok_ids)
            assert bool((ro.behaviour_logprobs[env] == 0).all()) and bool((ro.behaviour_logprobs[~env] < 0).all())
            assert ro.task["env_reward"] == 1.5  # summed: 0.5 * 3, or 0.5 + 1.0
    again = from_message(to_message(groups[0]))  # the episode survives the wire
    assert torch.equal(again.rollouts[0].policy_mask, groups[0].rollouts[0].policy_mask)
    assert torch.equal(again.rollouts[1].segment_versions, groups[0].rollouts[1].segment_versions)


def test_kept_keys_and_values_sample_what_whole_prefills_do_until_the_weights_change(policy):
    """A 3-turn episode prefilled after its kept keys and values at turns 2 and 3 draws
    the tokens, and records the log-probs, of one prefilled whole at every turn (same
    seed); a weight change between turns (the generator's swap) drops them, and none are
    kept past ``episode_kv_cache_mb``."""
    model = policy[0]

    @torch.no_grad()
    def swap_in_place():  # the weight receiver's way: copied into the parameters
        model.lm_head.weight.mul_(1.0)

    played = {}
    for mb, swap in ((0.0, False), (64.0, False), (64.0, True), (1e-3, False)):
        r = runner(policy, max_turns=3, max_episode_tokens=200, episode_kv_cache_mb=mb)
        (g,) = r.groups([{"question": "a"}], group_size=1, version=lambda: 0, rng=torch.Generator().manual_seed(0),
                        between_turns=swap_in_place if swap else (lambda: None))
        r.close()
        played[mb, swap] = g.rollouts[0], r.stats.kv_cached_turns
    (whole, n_whole), (kept, n_kept), (swapped, n_swapped), (over, n_over) = played.values()
    assert (n_whole, n_kept, n_swapped, n_over) == (0, 2, 0, 0) and kept.task["turns"] == 3
    for ro in (kept, swapped, over):
        assert torch.equal(ro.completion_ids, whole.completion_ids) and torch.equal(ro.policy_mask, whole.policy_mask)
        torch.testing.assert_close(ro.behaviour_logprobs, whole.behaviour_logprobs, rtol=0, atol=1e-5)


def test_a_hung_or_crashing_step_ends_only_its_episode(policy):
    r = runner(policy, max_turns=2, env_step_timeout_s=0.5, workers=4)
    groups = r.groups([{"question": "x", "hang": True}, {"question": "y", "crash": True},
                       {"question": "z", "stop": 1}], group_size=1, version=lambda: 0)
    r.close()
    assert r.stats.ends == {STEP_TIMEOUT: 1, ENV_ERROR: 1, DONE: 1}
    assert [g.rollouts[0].task["episode_end"] for g in groups] == [STEP_TIMEOUT, ENV_ERROR, DONE]


def test_the_generator_plays_a_slot_s_row_and_reports_episode_metrics(policy):
    from llamarl.app.config import TrainerConfig
    from llamarl.app.envs.slots import SlotEpisodes

    gen = GeneratorConfig(env="guess_number(high=5)", max_new_tokens=3, max_turns=2)
    episodes = SlotEpisodes(*policy, TrainerConfig(group_size=2, seed=1), gen)
    groups = episodes.groups([4, 1004], version=7, rng=torch.Generator().manual_seed(0), generator_id=0,
                             first_seq=0, stop=lambda: False)
    episodes.close()
    # Slots 4 and 1004 play the same row (slots cycle through ROWS = 1000 rows).
    assert [g.rollouts[0].task["secret"] for g in groups] == [episodes.rows[4]["secret"]] * 2
    m = episodes.metrics()
    assert m["env/episodes"] == 4 and m["env/episode_turns"] >= 4
    assert sum(v for k, v in m.items() if k.startswith("env/episode_end/")) == 4


class SlowAndFast:
    """Row "slow": its first step waits until the row "fast" episode has played all its
    turns (or 20 s). A runner that waited for every step before sampling again would never
    let it: the fast episode's later turns must be sampled while the slow step runs."""

    tools = ()
    fast_done = threading.Event()

    def rows(self, split, n, seed):
        return []

    def reset(self, row):
        self.row, self.n = row, 0
        return "Q: go\nA:"

    def step(self, turn):
        self.n += 1
        if self.row["kind"] == "slow":
            return Step(reward=float(self.fast_done.wait(20)), done=True)
        if self.n == 3:
            self.fast_done.set()
        return Step(observation="ok", reward=0.0, done=self.n == 3)


def test_a_slow_step_does_not_stall_the_other_episodes(policy):
    r = EpisodeRunner(*policy, SlowAndFast, GeneratorConfig(max_new_tokens=2, max_turns=3, env_step_timeout_s=60))
    groups = r.groups([{"kind": "slow"}, {"kind": "fast"}], group_size=1, version=lambda: 0)
    r.close()
    assert groups[0].rollouts[0].task["env_reward"] == 1.0  # the fast one finished first
    assert groups[1].rollouts[0].task["turns"] == 3


class Gated(SlowAndFast):
    """Row "slow": its one step waits until the test opens ``gate`` (or 20 s); row "fast":
    three quick turns."""

    gate = threading.Event()

    def step(self, turn):
        self.n += 1
        if self.row["kind"] == "slow":
            return Step(reward=float(self.gate.wait(20)), done=True)
        return Step(observation="ok", reward=0.0, done=self.n == 3)


def test_a_group_goes_out_as_its_episodes_end_and_new_ones_join_in_flight(policy):
    """What a streaming generator relies on (``InFlight``): the fast group comes back while
    the slow one's step still runs, and a group admitted then is played beside it, its
    turns recorded with the version of the round that sampled them."""
    from llamarl.app.envs.episodes import InFlight

    r = EpisodeRunner(*policy, Gated, GeneratorConfig(max_new_tokens=2, max_turns=3, env_step_timeout_s=60))
    Gated.gate.clear()
    flight = InFlight(r, rng=torch.Generator().manual_seed(0))
    flight.admit("slow", {"kind": "slow"}, 1)
    flight.admit("fast", {"kind": "fast"}, 1)
    out: dict = {}
    for _ in range(100):
        out.update(flight.advance(version=1, max_wait_s=0.05))
        if "fast" in out:
            break
    assert set(out) == {"fast"} and set(flight.groups) == {"slow"}  # its step still runs
    flight.admit("late", {"kind": "fast"}, 1)  # a new slot's group, while the slow one is out
    with pytest.raises(ValueError, match="already in flight"):
        flight.admit("late", {"kind": "fast"}, 1)
    for _ in range(100):
        out.update(flight.advance(version=2, max_wait_s=0.05))
        if "late" in out:
            break
    assert set(flight.groups) == {"slow"}  # the late group went out past the slow one
    Gated.gate.set()
    while len(flight):
        out.update(flight.advance(version=3, max_wait_s=0.05))
    r.close()
    assert [ep.turns for ep in out["fast"]] == [3] and set(out["fast"][0].versions) == {1}
    assert [ep.turns for ep in out["late"]] == [3] and set(out["late"][0].versions) == {2}
    assert sum(out["slow"][0].rewards) == 1.0 and out["slow"][0].versions == [1]


class HalfGated(Gated):
    """Every other episode started is row "slow" whatever its row says: one group holds a
    slow episode and a fast one."""

    started = 0

    def reset(self, row):
        HalfGated.started += 1
        return super().reset({"kind": "slow" if HalfGated.started % 2 else "fast"})


def test_an_ended_episode_waiting_for_its_group_holds_no_place(policy):
    """A streaming generator admits by ``playing``: a group's ended episodes, waiting for
    its slowest, are not counted, so the decode batch can be refilled beside it."""
    from llamarl.app.envs.episodes import InFlight

    r = EpisodeRunner(*policy, HalfGated, GeneratorConfig(max_new_tokens=2, max_turns=3, env_step_timeout_s=60))
    Gated.gate.clear()
    HalfGated.started = 0
    flight = InFlight(r, rng=torch.Generator().manual_seed(0))
    flight.admit("mixed", {"kind": "any"}, 2)
    assert flight.playing() == 2
    for _ in range(100):
        assert not flight.advance(version=1, max_wait_s=0.05)  # its slow episode holds the group
        if flight.playing() == 1:
            break
    assert flight.playing() == 1 and len(flight) == 1  # the fast one ended; the group is still out
    Gated.gate.set()
    out: dict = {}
    while len(flight):
        out.update(flight.advance(version=2, max_wait_s=0.05))
    r.close()
    assert flight.playing() == 0 and sorted(ep.turns for ep in out["mixed"]) == [1, 3]


def test_a_round_samples_the_earliest_steps_episodes_only(policy):
    """A streaming generator's next-step groups wait while the current step's episodes
    are ready: a round samples the lowest priority that has a ready episode."""
    from llamarl.app.envs.episodes import InFlight

    r = runner(policy, max_turns=3, max_episode_tokens=200)
    flight = InFlight(r, rng=torch.Generator().manual_seed(0))
    flight.admit("next step", {"question": "b"}, 2, priority=6)
    flight.admit("this step", {"question": "a"}, 2, priority=5)
    flight.advance(version=1)
    r.close()
    assert [ep.turns for ep in flight.groups["this step"]] == [1, 1]
    assert [ep.turns for ep in flight.groups["next step"]] == [0, 0]


class Graded:
    """Two turns per episode, then the row's own reward; a training row scores -1, so a
    held-out evaluation that played one would show it."""

    tools = ()

    def rows(self, split, n, seed):
        return [{"split": split, "reward": float(i % 3 == 0)} for i in range(n)]

    def reset(self, row):
        self.row, self.n = row, 0
        return "Q: go\nA:"

    def step(self, turn):
        self.n += 1
        if self.n < 2:
            return Step(observation="again")
        return Step(reward=self.row["reward"] if self.row["split"] == "test" else -1.0, done=True)


def test_held_out_evaluation_plays_the_environment_s_test_rows_with_its_reward(policy):
    from llamarl.app.config import TrainerConfig
    from llamarl.app.envs.slots import evaluate

    gen = GeneratorConfig(env="test_episodes:Graded", max_new_tokens=3, max_turns=3, max_episode_tokens=32)
    m = evaluate(*policy, TrainerConfig(eval_size=6), gen, step=2)
    # Rows 0 and 3 of six score 1, whatever the policy wrote (the math verifier would give 0).
    assert m == {"accuracy": 2 / 6, "sampled_accuracy": 2 / 6, "episode_turns": 2.0, "tool_calls": 0.0}


class GradedOnce(Graded):
    """Graded, but a test row scores only the first time it is played (a class-wide
    count): the sampled accuracy's mean over ``--eval-samples`` shows in the result."""

    played: dict[int, int] = {}

    def rows(self, split, n, *, seed):
        return [{**r, "i": i} for i, r in enumerate(super().rows(split, n, seed=seed))]

    def step(self, turn):
        out = super().step(turn)
        if out.done and self.row["split"] == "test":
            k = GradedOnce.played[self.row["i"]] = GradedOnce.played.get(self.row["i"], 0) + 1
            return Step(reward=out.reward if k == 1 else 0.0, done=True)
        return out


def test_the_sampled_evaluation_plays_each_test_row_eval_samples_times(policy):
    from llamarl.app.config import TrainerConfig
    from llamarl.app.envs.slots import evaluate

    gen = GeneratorConfig(env="test_episodes:GradedOnce", max_new_tokens=3, max_turns=3, max_episode_tokens=32)
    GradedOnce.played.clear()
    m = evaluate(*policy, TrainerConfig(eval_size=6, eval_samples=3), gen, step=2)
    # Greedy plays each row once (rows 0 and 3 score); sampled plays each 3 times more,
    # scoring none of them again: 0 of 18.
    assert (m["accuracy"], m["sampled_accuracy"]) == (2 / 6, 0.0)
    assert GradedOnce.played == {i: 4 for i in range(6)}
