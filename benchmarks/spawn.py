"""Spawned role processes for the benchmarks that time the weight plane (weight_sync,
sharded_sync, security): each role runs in a process of its own (spawned: CUDA cannot be
forked), puts one ``(key, report)`` on a queue, and the caller collects the reports by key.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable, Sequence

JOIN_S = 60.0
"""How long a role may take to exit after its report; then it is killed."""


def run_roles(roles: Sequence[tuple[Callable[..., None], tuple]], timeout_s: float) -> dict[Any, Any]:
    """Runs each ``target(*args, out)`` of ``roles`` in a spawned process; the ``(key,
    report)`` each puts on ``out``, as one dict. ``queue.Empty`` when a report takes
    longer than ``timeout_s``; no process outlives the call."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for target, args in roles]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
