"""Helpers for tests that run roles in real processes against a store on loopback."""

import contextlib
import multiprocessing as mp
import time
import traceback

from llamarl.app.control.signed import CONTROLLER, SignedStore
from llamarl.app.control.transport import Control, connect_store, host_store

TEST_SECRET = bytes(range(32))
"""The app secret of tests that run roles by hand."""


def signed(store, writer: str = CONTROLLER, secret: bytes = TEST_SECRET) -> SignedStore:
    """Signed control-store access as member ``writer`` (``llamarl.app.control.signed``)."""
    return SignedStore(store, secret, writer)


def weight_member(store, rank: int) -> SignedStore:
    """Rank ``rank`` of a test's weight group as the member it stands for (trainer/0 for
    rank 0, generator/<rank - 1> after it), for ``init_weight_group``."""
    return signed(store, "trainer/0" if rank == 0 else f"generator/{rank - 1}")


def control(store, writer: str = CONTROLLER) -> Control:
    """The control keys as member ``writer``: a member registers and beats as itself."""
    return Control(signed(store, writer))


@contextlib.contextmanager
def subscribed(store, replica: int, model, timeout_s: float = 30.0):
    """Generator ``replica``'s ``Subscriber`` of ``model`` (fp32, no digest), in a runtime of
    its own, receiving; closed on the way out."""
    from llamarl.app.control.runtime import Runtime
    from llamarl.app.metrics.events import Timeline
    from llamarl.app.weights.subscriber import Subscriber

    with Runtime.join("generator", replica, store, TEST_SECRET) as rt:
        subscriber = Subscriber(rt, model, precision="fp32", timeout_s=timeout_s, digest=False,
                                timeline=Timeline("generator", replica))
        subscriber.start()
        try:
            yield subscriber
        finally:
            subscriber.close(timeout_s=30.0)


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Polls ``condition()`` until it holds; fails the test, naming ``what``, after
    ``timeout_s`` (a bound for a hung role, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def forkserver_context():
    """A forkserver that has imported torch once: each role process then starts in a
    fraction of a second instead of importing torch again (2 cores). One preload list for
    every test file, since the first file to start the forkserver fixes it for the session."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "llamarl.app.control.transport", "llamarl.app.weights.epochs",
                                   "llamarl.app.weights.subscriber"])
    return ctx


def loopback_store(timeout_s: float):
    """A fresh store server on a free loopback port (``.port`` says which)."""
    return host_store(0, None, timeout_s=timeout_s, bind="127.0.0.1")


def run_roles(role_fn, world_size: int, port: int, timeout_s: float, *args) -> list[tuple[int, str]]:
    """Run ``role_fn(store, rank, world_size, *args)`` in ``world_size`` processes, each
    with its own client of the store at ``port``; their outcomes by rank (a string that
    starts with ``ERROR`` for an exception, with its traceback)."""
    ctx = forkserver_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=role_entry, args=(role_fn, rank, world_size, port, results, *args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in procs:
            out.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return sorted(out)


def role_entry(role_fn, rank, world_size, port, results, *args) -> None:
    try:
        store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
        results.put((rank, role_fn(store, rank, world_size, *args)))
    except BaseException as e:
        results.put((rank, f"ERROR {type(e).__name__}: {e}\n{traceback.format_exc()}"))
