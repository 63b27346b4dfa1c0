"""Reward components that tests/test_rewards.py runs in worker processes.

Module level, so they pickle by reference, and importable by a worker: it gets the test
process's ``sys.path``, where pytest put this directory. A component that hangs or dies
first writes its worker's pid as a file name into ``meta["pid_dir"]`` (when given), so a
test can check that the process is gone afterwards.
"""

import ctypes
import math
import os
import time
from pathlib import Path


def _note_pid(meta: dict) -> None:
    if "pid_dir" in meta:
        Path(meta["pid_dir"], str(os.getpid())).touch()


def one(prompt, completion, meta):
    return 1.0


def pid(prompt, completion, meta):
    """The worker's process id as the score: tells which worker scored a sample."""
    return float(os.getpid())


BAD_VALUES = {"nan": math.nan, "inf": math.inf, "neg_inf": -math.inf, "huge_int": 10 ** 400,
              "str": "1.0", "none": None, "list": [1.0], "complex": 1 + 2j}


def bad_on_request(prompt, completion, meta):
    """``BAD_VALUES[meta["bad"]]`` for the completion " bad", else 0.5."""
    return BAD_VALUES[meta["bad"]] if completion == " bad" else 0.5


def inverse_level(prompt, completion, meta):
    return 1 / meta["level"]


def raises_key_error(prompt, completion, meta):
    raise KeyError("x")


def nan(prompt, completion, meta):
    return math.nan


def hangs_on_long(prompt, completion, meta):
    if "long" in completion:
        _note_pid(meta)
        time.sleep(3600)
    return 1.0


def dies_on_request(prompt, completion, meta):
    """Segfaults on " segv", aborts on " abort"; else the worker's pid."""
    if completion in (" segv", " abort"):
        _note_pid(meta)
        if completion == " segv":
            ctypes.string_at(0)
        os.abort()
    return float(os.getpid())


def chatty(prompt, completion, meta):
    """Prints to stdout, the child's protocol channel if it were not redirected."""
    print("chatty reward: hello from print")
    os.write(1, b"chatty reward: hello from fd 1\n")
    return 1.0


class Batched:
    """One ``score_batch`` call per batch. ``mode``: ``lengths`` (len of each completion),
    ``calls`` (how many calls this worker's instance has had), ``raise``, ``short`` (one
    score too few), ``scalar`` (not a sequence), ``nan_middle``. Any mode hangs on a batch
    holding the completion " hang"."""

    def __init__(self, mode: str = "lengths") -> None:
        self.mode, self.calls = mode, 0

    def score_batch(self, samples):
        self.calls += 1
        if any(s.completion == " hang" for s in samples):
            _note_pid(samples[0].meta)
            time.sleep(3600)
        n = len(samples)
        if self.mode == "raise":
            raise RuntimeError("model crashed")
        return {"lengths": lambda: [len(s.completion) for s in samples], "calls": lambda: [self.calls] * n,
                "short": lambda: [1.0] * (n - 1), "scalar": lambda: 1.0,
                "nan_middle": lambda: [0.5, math.nan, 0.25]}[self.mode]()


class FailsToLoad:
    def load(self):
        raise RuntimeError("no model at /nowhere")

    def __call__(self, prompt, completion, meta):
        return 1.0


class AbortsOnLoad:
    def load(self):
        os.abort()

    def __call__(self, prompt, completion, meta):
        return 1.0


class SpinsInTorch:
    """Loads torch in ``load()`` (outside any deadline); each call then multiplies
    matrices forever after noting its pid: a call that hangs inside torch."""

    def load(self):
        import torch

        self.a = torch.randn(128, 128)

    def __call__(self, prompt, completion, meta):
        import torch

        _note_pid(meta)
        while True:
            torch.mm(self.a, self.a)


def level(prompt, completion, meta):
    return float(meta["level"])


class TorchThreads:
    """The worker's torch intra-op thread count as the score."""

    def load(self):
        import torch

        self.torch = torch

    def __call__(self, prompt, completion, meta):
        return float(self.torch.get_num_threads())

    def __getstate__(self):
        return {}  # the module is imported again in the worker, by load()


def segv_on_every_third_length(prompt, completion, meta):
    """Segfaults its worker on a completion whose length is a multiple of 3; else 0.0:
    a run scoring with it sees some crashes and many scores."""
    if len(completion) % 3 == 0:
        ctypes.string_at(0)
    return 0.0


def forks_a_sleeper(prompt, completion, meta):
    """Starts a child that outlives the call (a server, a sandbox), its pid noted in
    ``meta["pid_dir"]``, and scores 1; on a completion with "hang" in it, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    Path(meta["pid_dir"], str(child.pid)).touch()
    if "hang" in completion:
        time.sleep(3600)
    return 1.0
