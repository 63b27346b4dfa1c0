import os
from pathlib import Path

import pytest

# Tests are CPU-only and must not reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


MAX_WORKERS = 4
"""The most pytest-xdist workers ``-n auto`` (pyproject's addopts) starts: many tests
launch a whole app (a trainer, generators, a reward executor), so a 16-core machine would
run out of memory and slow every deadline down long before it ran out of cores."""


@pytest.hookimpl(optionalhook=True)  # the suite also runs without xdist (`-p no:xdist`)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """Workers for ``-n auto``: one per two cores, at least two, at most ``MAX_WORKERS``.
    On CI's 2 cores the suite keeps about one core busy on average (its tests wait on
    processes, sockets and sleeps), so two workers fill both; ``-n N`` on the command line
    (or ``-n 0``: one process, no workers) overrides it, and so does xdist's own
    ``PYTEST_XDIST_AUTO_NUM_WORKERS``."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, max(2, min(MAX_WORKERS, cores // 2)))


ONE_WORKER = {"tests/test_slurm_cluster.py": "slurm", "tests/test_gguf_policy.py": "gguf"}
"""Test files whose tests run one after another on one xdist worker: they share one thing
of the machine (the SLURM cluster: its 4 nodes take one app at a time; a model converted
once per worker by a module fixture). Every ``slurm`` test must live in one of them."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that also keeps each ``ONE_WORKER`` file on one worker, by path:
    with pytest 9.2 xdist's own grouping by ``xdist_group`` marks silently stops working
    (it renames the nodeid, which pytest no longer reads back: pytest-xdist issue #1386).
    Groups go out first (xdist orders scopes by size), then single tests in collection
    order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = ONE_WORKER.get(nodeid.split("::", 1)[0])
            return group if group is not None else super()._split_scope(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a CUDA device. Files with slow tests come first, then those
    with other integration tests (processes, servers), then the rest, so that no worker is
    left with a long test at the end while the other idles (the order is the same in every
    worker, as xdist requires)."""
    import torch

    for item in items:
        if "slurm" in item.keywords and item.nodeid.split("::", 1)[0] not in ONE_WORKER:
            raise pytest.UsageError(f"{item.nodeid}: a slurm test outside conftest.ONE_WORKER's files "
                                    "would share the cluster with another worker's")
    def tier(item) -> int:
        return 0 if "slow" in item.keywords or "slurm" in item.keywords else 1 if "integration" in item.keywords else 2

    def path(item) -> str:
        return item.nodeid.split("::", 1)[0]

    # Whole files move, in their own order, so that module fixtures are made once.
    file_tier: dict[str, int] = {}
    for item in items:
        file_tier[path(item)] = min(file_tier.get(path(item), 2), tier(item))
    items.sort(key=lambda item: file_tier[path(item)])
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Two cores are shared by the test process and the processes it starts: one torch
    thread each avoids oversubscription, which slows small models down tenfold."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A warm-started policy directory for app launches (a few steps: the tests that use
    it check plumbing, not learning); made once per session, whichever module asks."""
    from llamarl.app.rl.warmstart import WarmStartConfig, warm_start

    out = tmp_path_factory.mktemp("policy") / "warmstart"
    warm_start(WarmStartConfig(out=str(out), steps=4, batch_size=8, train_size=64, eval_size=2),
               log=lambda _: None)
    return out
