"""A user reward: short answers that are also right."""

from llamarl.app.tasks.arithmetic import is_correct


def brevity(prompt: str, completion: str, meta: dict) -> float:
    """1.0 for a correct answer in at most 20 words, less the longer it gets, 0 if wrong."""
    if not is_correct(completion, meta["answer"]):
        return 0.0
    words = len(completion.split())
    return min(1.0, 20 / max(words, 1))
