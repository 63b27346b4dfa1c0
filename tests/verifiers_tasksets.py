"""A small verifiers taskset for tests/test_verifiers_env.py: echo a number back, scored by
the task's own ``@vf.reward`` (exact answer, weight 1) and a weighted format reward."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply) <= 4)


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self):
        for i in range(12):
            yield EchoTask(EchoData(prompt=f"Write the number {i}.", answer=str(i)))


def load_environment() -> EchoTaskset:
    """A loader, as verifiers environments ship them."""
    return EchoTaskset(vf.TasksetConfig())
