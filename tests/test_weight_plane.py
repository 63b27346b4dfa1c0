"""The weight plane across epochs, in real gloo processes on loopback: a generator that
dies is regrouped out and the survivors get the version that failed; a generator
restarted for the same replica rejoins at the next version."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch import nn

from llamarl.app import names
from llamarl.app.control.transport import connect_store
from llamarl.app.weights.epochs import ElasticSender, NoGeneratorsLeft
from role_processes import forkserver_context, loopback_store, signed, subscribed, wait_until

pytestmark = pytest.mark.integration

DIED, RESTART, RESTARTED, DONE = "test/died", "test/restart", "test/restarted", "test/done"


def params_at(version: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((3000,), float(version))), ("b", torch.full((7,), -float(version)))]


def _trainer(store) -> str:
    # What llamarl.app.control.membership decides, played by the test: generator 1 is gone from when it
    # died until its restarted process is up.
    gone = lambda: {"generator/1"} if store.check([DIED]) and not store.check([RESTARTED]) else set()  # noqa: E731
    live = params_at(0)
    sender = ElasticSender(signed(store), live, num_generators=2, timeout_s=20.0, gone=gone,
                           should_stop=lambda: False, gone_wait_s=20.0)
    sender.start()

    def send(version: int) -> None:
        with torch.no_grad():
            for (_, p), (_, new) in zip(live, params_at(version)):
                p.copy_(new)
        sender.send(version)

    send(1)
    wait_until(lambda: store.check([DIED]), "generator 1 to die")
    send(2)  # fails on the dead generator, regroups, sends version 2 again
    after_loss = (sender.epoch, list(sender.roster))
    store.set(RESTART, "1")
    wait_until(lambda: 1 in sender.joiners(), "the restarted generator 1 to ask to join")
    send(3)  # takes it in first
    store.set(DONE, "1")
    # The current group's presence, overwritten, is published again; the first epoch's
    # records are no longer kept (the heartbeat's checks stay bounded across epochs).
    for epoch in (1, sender.epoch):
        store.set(f"{names.weight_epoch_prefix(epoch)}/{names.weight_rank_present_key(0)}", b"forged")
    republished = sender.signed.reassert()
    assert republished == [f"{names.weight_epoch_prefix(sender.epoch)}/{names.weight_rank_present_key(0)}"], \
        republished
    return f"epochs {after_loss} then {(sender.epoch, sender.roster)} regroups {sender.regroups}"


def _generator(store, replica: int, until: int, die: bool = False) -> str:
    model = nn.Module()
    for name, value in params_at(-1):
        model.register_parameter(name, nn.Parameter(value, requires_grad=False))
    seen: list[int] = []
    with subscribed(store, replica, model, timeout_s=20.0) as subscriber:
        def applied_until() -> bool:
            if (v := subscriber.swap_into(model)) is not None:
                seen.append(v)
            return bool(seen) and seen[-1] >= until

        wait_until(applied_until, f"generator {replica} to apply version {until}")
        assert model.w[0].item() == until and model.b[0].item() == -until, "wrong weights applied"
        if die:
            store.set(DIED, "1")
            os._exit(0)  # no goodbye: a killed process
    return f"applied {seen}"


def _entry(role: str, port: int, results) -> None:
    try:
        store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
        if role == "trainer":
            out = _trainer(store)
        elif role == "gen0":
            out = _generator(store, 0, until=3)
        elif role == "gen1":
            out = _generator(store, 1, until=1, die=True)
        else:
            wait_until(lambda: store.check([RESTART]), "the restart")
            store.set(RESTARTED, "1")
            out = _generator(store, 1, until=3)
        results.put((role, out))
    except BaseException as e:
        results.put((role, f"ERROR {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_a_lost_generator_is_regrouped_out_and_a_restarted_one_rejoins():
    store = loopback_store(timeout_s=120)
    ctx = forkserver_context()
    results = ctx.Queue()
    roles = ["trainer", "gen0", "gen1", "gen1_restarted"]
    procs = [ctx.Process(target=_entry, args=(r, store.port, results)) for r in roles]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in ("trainer", "gen0", "gen1_restarted"):
            role, text = results.get(timeout=120)
            out[role] = text
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not any(t.startswith("ERROR") for t in out.values()), out
    # Epoch 2 holds the survivor only, epoch 3 both again: two regroups.
    assert out["trainer"] == "epochs (2, [0]) then (3, [0, 1]) regroups 2", out
    assert out["gen1_restarted"].endswith("3]"), out  # it rejoined at version 3
    assert "2" in out["gen0"], out  # the survivor got the version whose send failed


def test_no_generator_left_is_a_clear_error():
    store = loopback_store(timeout_s=30)
    sender = ElasticSender(signed(store), params_at(0), num_generators=1, timeout_s=5.0,
                           gone=lambda: {"generator/0"}, should_stop=lambda: False)
    with pytest.raises(NoGeneratorsLeft, match="every generator is gone"):
        sender._regroup([0])
