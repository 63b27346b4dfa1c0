import os
from pathlib import Path

import pytest

# Tests are CPU-only and must not reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

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
