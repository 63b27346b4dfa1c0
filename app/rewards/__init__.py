"""Swappable reward components.

``build_reward("math_verifier,format=0.2")`` returns a ``CompositeReward``;
``composite.score(samples)`` returns one ``RewardResult`` per ``Sample``, quarantining the
samples whose reward raised, timed out, crashed its worker process or was not a finite
number; ``reward_events`` turns results into metrics events. See ``docs/rewards.md``.
"""

from app.rewards.builtins import LengthPenalty, format_reward
from app.rewards.composite import CompositeReward
from app.rewards.core import (
    BatchedReward,
    Component,
    RewardFn,
    RewardResult,
    Sample,
    check_score,
    quarantine_counts,
    reward_events,
)
from app.rewards.models import HFClassifier, SemanticSimilarity
from app.rewards.spec import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    INLINE_BUILTINS,
    ComponentSpec,
    available,
    build_reward,
    installed_plugins,
    parse_spec,
)
from app.rewards.verifiers import boxed_verifier, gsm8k_verifier, math_verifier
from app.rewards.worker import RewardWorkerError

__all__ = [
    "BUILTINS", "ENTRY_POINT_GROUP", "INLINE_BUILTINS", "BatchedReward", "Component", "ComponentSpec",
    "CompositeReward", "HFClassifier", "LengthPenalty", "RewardFn", "RewardResult", "RewardWorkerError",
    "Sample", "SemanticSimilarity", "available", "boxed_verifier", "build_reward", "check_score",
    "format_reward", "gsm8k_verifier", "installed_plugins", "math_verifier", "parse_spec",
    "quarantine_counts", "reward_events",
]
