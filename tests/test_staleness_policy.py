"""``--max-staleness auto``'s policy on hand-built observation sequences: raise, hold,
lower, cap, floor; its config and flag; the generators' share of time blocked."""

from __future__ import annotations

import pytest

from llamarl.app import cli
from llamarl.app.config import TrainerConfig
from llamarl.app.errors import ConfigError
from llamarl.app.rl.staleness import BoundPolicy, Observation, blocked_share
from llamarl.app.roles.trainer import _parse, trainer_parser

TAME = dict(ess=0.99, frac_truncated=0.0, kl=0.001)
BLOCKED = Observation(blocked=0.5, **TAME)


def run(policy: BoundPolicy, observations: list[Observation]) -> list[int]:
    return [policy.observe(o).bound for o in observations]


def test_raises_while_blocked_and_tame_one_step_at_a_time_up_to_the_cap():
    p = BoundPolicy(bound=1, cap=3, patience=2, settle_steps=1)
    decisions = [p.observe(BLOCKED) for _ in range(8)]
    assert [d.bound for d in decisions] == [1, 2, 2, 3, 3, 3, 3, 3]
    assert [d.action for d in decisions[:4]] == ["hold", "raise", "hold", "raise"]
    assert "blocked 50%" in decisions[1].reason and "ESS 0.990" in decisions[1].reason
    assert "at the cap 3" in decisions[-1].reason


def test_holds_when_the_generators_do_not_wait_or_nothing_was_measured():
    p = BoundPolicy(bound=2, patience=1, settle_steps=0)
    assert run(p, [Observation(blocked=0.05, **TAME)] * 3) == [2, 2, 2]
    assert p.observe(Observation(blocked=0.9)).reason == "no ratio measured this step"
    assert p.bound == 2


def test_blocking_is_averaged_over_patience_steps():
    """Generators report a wait when their next batch is done: one step may carry it all."""
    p = BoundPolicy(bound=1, patience=3, settle_steps=0, blocked_min=0.1)
    little = Observation(blocked=0.05, **TAME)
    assert run(p, [little] * 4) == [1, 1, 1, 1]
    p = BoundPolicy(bound=1, patience=3, settle_steps=0, blocked_min=0.1)
    lumpy = [Observation(blocked=b, **TAME) for b in (0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0)]
    assert run(p, lumpy) == [1, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("wild", [dict(ess=0.5, frac_truncated=0.0, kl=0.0),
                                  dict(ess=0.99, frac_truncated=0.2, kl=0.0),
                                  dict(ess=0.99, frac_truncated=0.0, kl=0.5)])
def test_lowers_when_any_ratio_statistic_is_wild_even_while_blocked(wild):
    p = BoundPolicy(bound=4, floor=1, cap=4, settle_steps=0)
    d = p.observe(Observation(blocked=0.9, **wild))
    assert (d.bound, d.action) == (3, "lower")
    assert any(word in d.reason for word in ("ESS", "truncated", "KL"))


def test_lowers_to_the_floor_and_stays_there():
    p = BoundPolicy(bound=3, floor=1, settle_steps=0)
    wild = Observation(blocked=0.0, ess=0.3, frac_truncated=0.0, kl=0.0)
    decisions = [p.observe(wild) for _ in range(4)]
    assert [d.bound for d in decisions] == [2, 1, 1, 1]
    assert "at the floor 1" in decisions[-1].reason


def test_floor_zero_is_the_synchronous_bound():
    p = BoundPolicy(bound=1, floor=0, settle_steps=0)
    assert p.observe(Observation(blocked=0.0, ess=0.1)).bound == 0


def test_waits_after_a_change_for_the_new_bounds_rollouts():
    p = BoundPolicy(bound=3, settle_steps=2)
    wild = Observation(blocked=0.0, ess=0.3)
    assert [p.observe(wild).action for _ in range(4)] == ["lower", "hold", "hold", "lower"]


def test_then_recovers_once_the_ratios_are_tame_again():
    p = BoundPolicy(bound=2, patience=1, settle_steps=0)
    seq = [Observation(blocked=0.5, ess=0.5)] + [BLOCKED] * 2
    assert run(p, seq) == [1, 2, 3]


def test_a_raise_that_does_not_make_steps_faster_is_undone_and_raising_backs_off():
    """Generators waiting on the bound on a host whose cores they share with the trainer:
    letting them run ahead does not make steps faster, so the raise is taken back."""
    p = BoundPolicy(bound=1, cap=4, patience=1, settle_steps=0, trial_steps=2, backoff_steps=3)
    same = Observation(blocked=0.5, step_s=1.0, **TAME)
    decisions = [p.observe(same) for _ in range(10)]
    assert [d.bound for d in decisions] == [2, 2, 1, 1, 1, 2, 2, 1, 1, 1]
    assert "did not make steps faster (median 1.00 s before, 1.00 s after): no raise for 3 steps" in decisions[2].reason
    assert "a raise on trial" in decisions[1].reason and "none tried for 2 more steps" in decisions[3].reason
    assert "no raise for 6 steps" in decisions[7].reason  # twice as long after a second failure in a row


def test_a_raise_that_makes_steps_faster_is_kept():
    p = BoundPolicy(bound=1, cap=4, patience=1, settle_steps=0, trial_steps=2, backoff_steps=3)
    slow, fast = (Observation(blocked=0.5, step_s=s, **TAME) for s in (2.0, 1.0))
    assert run(p, [slow, fast, fast]) == [2, 2, 3]


def test_a_resumed_policy_decides_as_the_uninterrupted_one():
    """The checkpoint's state (``state_dict``): bound, blocked window and settling carry over."""
    timed = [Observation(blocked=b, step_s=s, **TAME) for b, s in [(0.5, 2.0), (0.5, 2.0), (0.5, 1.0), (0.0, 1.0)]]
    seq = [BLOCKED, *timed, BLOCKED, BLOCKED, Observation(blocked=0.5, step_s=1.0, **TAME), BLOCKED]
    whole = BoundPolicy(bound=1, cap=4, patience=2, settle_steps=1)
    expected = run(whole, seq)
    for cut in range(1, len(seq)):
        first = BoundPolicy(bound=1, cap=4, patience=2, settle_steps=1)
        head = run(first, seq[:cut])
        resumed = BoundPolicy(bound=1, cap=4, patience=2, settle_steps=1)
        resumed.load_state_dict(first.state_dict())
        assert head + run(resumed, seq[cut:]) == expected, f"resumed after observation {cut}"
    lower_cap = BoundPolicy(bound=1, cap=2)
    lower_cap.load_state_dict({**BoundPolicy(bound=1).state_dict(), "bound": 4})
    assert lower_cap.bound == 2
    with pytest.raises(ValueError, match="not a staleness bound state"):
        lower_cap.load_state_dict({"bound": 2})


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="floor"):
        BoundPolicy(bound=1, floor=3, cap=2)
    with pytest.raises(ValueError, match="outside"):
        BoundPolicy(bound=5, cap=4)


def test_blocked_share_counts_only_generators_waiting_on_the_bound():
    def iv(role, what, t0, t1):
        return {"type": "interval", "role": role, "replica": 0, "kind": "idle", "what": what, "t0": t0, "t1": t1}
    events = [iv("generator", "staleness_bound", 0.0, 1.0), iv("generator", "staleness_bound", 2.0, 2.5),
              iv("generator", "wait_weights", 0.0, 3.0), iv("trainer", "staleness_bound", 0.0, 9.0),
              {"type": "scalar", "name": "x", "value": 1.0}]
    assert blocked_share(events, generators=2, window_s=1.5) == pytest.approx(0.5)
    assert blocked_share(events, generators=1, window_s=1.0) == 1.0
    assert blocked_share(events, generators=1, window_s=0.0) == 0.0


def test_config_takes_auto_or_a_bound():
    assert TrainerConfig(max_staleness="auto").start_bound == 1
    assert TrainerConfig(max_staleness="auto", staleness_cap=4).auto
    assert TrainerConfig(max_staleness=0).start_bound == 0 and not TrainerConfig(max_staleness=0).auto
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0 or 'auto'"):
        TrainerConfig(max_staleness="sometimes")
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0 or 'auto'"):
        TrainerConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="staleness_cap"):
        TrainerConfig(max_staleness="auto", staleness_cap=0)


def test_the_flag_takes_auto_and_names_a_bad_value():
    _, cfg, _ = _parse(trainer_parser(), ["--num-generators", "1", "--max-staleness", "auto"], 1)
    assert cfg.max_staleness == "auto"
    _, cfg, _ = _parse(trainer_parser(), ["--num-generators", "1", "--max-staleness", "3"], 1)
    assert cfg.max_staleness == 3
    with pytest.raises(ConfigError, match="--max-staleness: an int or 'auto', got 'often'"):
        _parse(trainer_parser(), ["--num-generators", "1", "--max-staleness", "often"], 1)
    # Read back from the published JSON config the same way.
    assert TrainerConfig(**{**cli.to_dict(TrainerConfig(max_staleness="auto"))}).auto
