"""Signed control-store reads and writes (``llamarl.app.control.signed``) against plain ones.

    python benchmarks/control_auth.py                     # writes benchmarks/results/control_auth.json
    python benchmarks/control_auth.py --repeats 5000 --members 8

On a real TCPStore on loopback, in one process, side by side: what each control
operation cost before (a bare ``set``/``get``/``check``/``add``) and what it costs signed:

- ``write``: ``store.set`` of a small value vs ``SignedStore.put`` (seal + set);
- ``read_same``: reading a value that did not change (every poll loop's case: the stop
  flag, the epoch), ``get`` vs ``SignedStore.get`` (the bytes equal the last accepted
  record's: no HMAC);
- ``read_new``: reading a value that changed each time (a heartbeat moving), ``get`` vs
  ``SignedStore.get`` (HMAC check and JSON parse);
- ``stop_check``: ``Control.stopped`` with no stop set (``check`` before; ``check`` and
  nothing else now, the key being absent);
- ``heartbeats``: the controller's look at ``--members`` heartbeats
  (``Control.last_heartbeats``), a ``multi_get`` of counters before, one record per member now;
- ``announce``: one weight sync's announcement, sender and one receiver (``llamarl.app.weights.group``):
  ``set`` + ``check`` before; now a kept record (``put``), the one four syncs back
  forgotten, and the receiver's ``settled`` (``check``, ``multi_get``, HMAC) and ``forget``;
- ``seal``/``open``: the CPU part alone, no store.

Median microseconds per operation over ``--repeats`` (after a warm-up; plain and signed
in alternating batches), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from llamarl.app.control import frames
from llamarl.app import names
from llamarl.app.control.signed import SignedStore
from llamarl.app.control.transport import Control, host_store

RESULTS = Path(__file__).resolve().parent / "results" / "control_auth.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=RESULTS, help="write the results here")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--members", type=int, default=4, help="members whose heartbeats the controller reads")
    return p.parse_args(argv)


WARMUP = 200


def median_us(plain: Callable[[int], object], signed: Callable[[int], object],
              repeats: int) -> tuple[float, float]:
    """Median wall time in microseconds of ``plain(i)`` and of ``signed(i)``, timed in
    alternating batches of 20 calls (the machine's load drifts alike for both); ``i``
    counts each op's calls, warm-up included (``i < WARMUP + repeats``)."""
    for i in range(WARMUP):
        plain(i)
        signed(i)
    batch, samples = 20, ([], [])
    for start in range(WARMUP, WARMUP + repeats, batch):
        for op, out in ((plain, samples[0]), (signed, samples[1])):
            t0 = time.perf_counter()
            for i in range(start, start + batch):
                op(i)
            out.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    store = host_store(0, bind="127.0.0.1")
    secret = frames.new_secret()
    signed = SignedStore(store, secret, "trainer/0")
    reader = SignedStore(store, secret, "generator/0")
    value = {"reason": "finished 30 steps", "finished": True}
    plain_value = json.dumps(value)
    key, plain_key, moving = "bench/signed", "bench/plain", "bench/moving"
    store.set(plain_key, plain_value)
    signed.put(key, value)
    # A value that changes before every read: records the writer made, newest last.
    fresh = [signed.seal(moving, {"i": i}) for i in range(WARMUP + args.repeats + 20)]

    def read_new_signed(i: int) -> None:
        store.set(moving, fresh[i])  # what the writer did meanwhile (also in the plain case)
        reader.get(moving)

    def read_new_plain(i: int) -> None:
        store.set(plain_key, plain_value)
        json.loads(store.get(plain_key))

    members = [names.member("generator", i) for i in range(args.members)]
    for m in members:  # signed heartbeats, each member as itself
        Control(SignedStore(store, secret, m)).register("generator", int(m.split("/")[1]))
        store.add(f"bench/heartbeat/{m}", 1)
    controller = Control(signed)
    beat_keys = [f"bench/heartbeat/{m}" for m in members]
    opener = SignedStore(store, secret, "generator/1")
    announcer = signed.prefixed("bench/weights")
    receiver = SignedStore(store, secret, "generator/0").prefixed("bench/weights")

    def announce_signed(i: int) -> None:
        key = names.weight_sync_announce_key(i + 1)
        announcer.put(key, i, keep=True)
        announcer.forget(names.weight_sync_announce_key(i - 3))
        assert receiver.settled([key], [("trainer/0",)]) is not None
        receiver.forget(key)

    def announce_plain(i: int) -> None:
        key = f"bench/plain_weights/{names.weight_sync_announce_key(i + 1)}"
        store.set(key, str(i))
        assert store.check([key])

    ops = {
        "write": (lambda i: store.set(plain_key, plain_value), lambda i: signed.put(key, value)),
        "read_same": (lambda i: json.loads(store.get(plain_key)), lambda i: reader.get(key)),
        "read_new": (read_new_plain, read_new_signed),
        "stop_check": (lambda i: store.check(["bench/no-stop"]), lambda i: controller.stopped()),
        "heartbeats": (lambda i: store.multi_get(beat_keys), lambda i: controller.last_heartbeats()),
        "announce": (announce_plain, announce_signed),
        "seal": (lambda i: json.dumps(value).encode(), lambda i: signed.seal(key, value)),
        "open": (lambda i: json.loads(plain_value), lambda i: opener.open(moving, fresh[i])),
    }
    results = {}
    for name, (plain_op, signed_op) in ops.items():
        plain_us, signed_us = median_us(plain_op, signed_op, args.repeats)
        results[name] = {"plain_us": round(plain_us, 2), "signed_us": round(signed_us, 2),
                         "ratio": round(signed_us / plain_us, 2)}
        print(f"{name:11s} plain {plain_us:8.2f} us   signed {signed_us:8.2f} us   x{signed_us / plain_us:5.2f}")
    out = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "repeats": args.repeats, "members": args.members, "store": "TCPStore on loopback, one process",
           "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
