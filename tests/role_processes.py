"""Helpers for tests that run roles in real processes against a store on loopback."""

import multiprocessing as mp

from app.transport import host_store


def forkserver_context():
    """A forkserver that has imported torch once: each role process then starts in a
    fraction of a second instead of importing torch again (2 cores). One preload list for
    every test file, since the first file to start the forkserver fixes it for the session."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "app.transport", "app.weight_sync"])
    return ctx


def loopback_store(timeout_s: float):
    """A fresh store server on a free loopback port (``.port`` says which)."""
    return host_store(0, None, timeout_s=timeout_s, host="127.0.0.1")
