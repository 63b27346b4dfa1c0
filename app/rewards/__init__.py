"""Swappable reward components.

``build_reward("math_verifier,format=0.2")`` returns a ``CompositeReward``;
``composite.score(samples)`` returns one ``RewardResult`` per ``Sample``, quarantining the
samples whose reward raised, timed out or was not a finite number; ``reward_events`` turns
results into metrics events. See ``docs/rewards.md``.
"""

from app.rewards.builtins import LengthPenalty, format_reward
from app.rewards.core import (
    BatchedReward,
    Component,
    CompositeReward,
    RewardFn,
    RewardResult,
    Sample,
    abandoned_calls_running,
    check_score,
    exit_without_teardown_if_calls_hang,
    quarantine_counts,
    reward_events,
)
from app.rewards.models import HFClassifier, SemanticSimilarity
from app.rewards.spec import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    ComponentSpec,
    available,
    build_reward,
    installed_plugins,
    parse_spec,
)
from app.rewards.verifiers import boxed_verifier, gsm8k_verifier, math_verifier

__all__ = [
    "BUILTINS", "ENTRY_POINT_GROUP", "BatchedReward", "Component", "ComponentSpec", "CompositeReward",
    "HFClassifier", "LengthPenalty", "RewardFn", "RewardResult", "Sample", "SemanticSimilarity",
    "abandoned_calls_running", "available", "boxed_verifier", "build_reward", "check_score",
    "exit_without_teardown_if_calls_hang", "format_reward", "gsm8k_verifier", "installed_plugins", "math_verifier",
    "parse_spec", "quarantine_counts", "reward_events",
]
