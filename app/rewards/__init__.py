"""Swappable reward components.

``build_reward("math_verifier,format=0.2")`` returns a ``CompositeReward``;
``composite.score(samples)`` returns one ``RewardResult`` per ``Sample``, quarantining the
samples whose reward raised, timed out, crashed its worker process or was not a finite
number; ``reward_events`` turns results into metrics events. See ``docs/rewards.md``.
"""

from llamarl.app.rewards.builtins import LengthPenalty, format_reward
from llamarl.app.rewards.composite import CompositeReward
from llamarl.app.rewards.core import (
    BatchedReward,
    Component,
    RewardFn,
    RewardResult,
    Sample,
    check_score,
    quarantine_counts,
    reward_events,
)
from llamarl.app.rewards.models import HFClassifier, SemanticSimilarity
from llamarl.app.rewards.spec import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    INLINE_BUILTINS,
    ComponentSpec,
    available,
    build_reward,
    installed_plugins,
    parse_spec,
)
from llamarl.app.rewards.verifiers import boxed_verifier, gsm8k_verifier, math_verifier
from llamarl.app.rewards.worker import RewardWorkerError

__all__ = [
    "BUILTINS", "ENTRY_POINT_GROUP", "INLINE_BUILTINS", "BatchedReward", "Component", "ComponentSpec",
    "CompositeReward", "HFClassifier", "LengthPenalty", "RewardFn", "RewardResult", "RewardWorkerError",
    "Sample", "SemanticSimilarity", "available", "boxed_verifier", "build_reward", "check_score",
    "format_reward", "gsm8k_verifier", "installed_plugins", "math_verifier", "parse_spec",
    "quarantine_counts", "reward_events",
]
