"""Control/data plane: authenticated frames, store queues with backpressure, control keys."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time

import pytest
import torch

from llamarl.app.control.frames import (MAX_FRAME_BYTES, SECRET_ENV, SECRET_FILE_ENV, AuthenticationError, decode, encode,
                        new_secret, read_secret)
from llamarl.app.control.transport import Stopped, StoreQueue, connect_store
from llamarl.app.errors import ConfigError
from role_processes import control, forkserver_context, loopback_store

SECRET = bytes(range(32))


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def client(store):
    return connect_store(f"127.0.0.1:{store.port}", timeout_s=10)


# --------------------------------------------------------------------------- encoding

ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.complex64, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_roundtrip_every_dtype(dtype):
    base = torch.randn(5, 7) * 50
    x = (base > 0) if dtype == torch.bool else base.abs().to(dtype)
    msg = {"x": x, "scalar": x[0, 0].clone(), "empty": torch.empty(0, 3, dtype=dtype)}
    out = decode(encode(msg, SECRET), SECRET)
    for key in msg:
        assert out[key].dtype == dtype and out[key].shape == msg[key].shape
        assert torch.equal(out[key].reshape(-1).view(torch.uint8), msg[key].reshape(-1).view(torch.uint8))


def test_roundtrip_values_nested_and_writable():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    msg = {"s": "héllo", "i": -3, "f": 1.5, "b": True, "n": None, "l": [1, [2, "x"]],
           "d": {"logp_T": t, "deep": [{"ids": torch.tensor([1, 2, 3])}]}, "t": t}
    out = decode(encode(msg, SECRET), SECRET)
    assert {k: out[k] for k in "sifbnl"} == {k: msg[k] for k in "sifbnl"}
    assert torch.equal(out["t"], t) and torch.equal(out["d"]["logp_T"], t)
    assert torch.equal(out["d"]["deep"][0]["ids"], torch.tensor([1, 2, 3]))
    out["t"].add_(1)  # a writable tensor the caller owns
    assert out["t"].device.type == "cpu"


def test_encode_rejects_unencodable():
    with pytest.raises(TypeError):
        encode({"x": object()}, SECRET)
    with pytest.raises(TypeError):
        encode({1: "int key"}, SECRET)
    with pytest.raises(ValueError):
        encode({"__tensor__": 0}, SECRET)


def test_tampering_and_wrong_secret_are_rejected():
    frame = encode({"x": torch.arange(100), "who": "generator"}, SECRET)
    with pytest.raises(AuthenticationError):
        decode(frame, new_secret())
    for pos in (4, 40, len(frame) // 2, len(frame) - 1):  # version, header, payload, last byte
        bad = bytearray(frame)
        bad[pos] ^= 0x01
        with pytest.raises((AuthenticationError, ValueError)):
            decode(bytes(bad), SECRET)
    bad = bytearray(frame)
    bad[len(frame) - 1] ^= 0x01  # payload bytes are covered by the tag
    with pytest.raises(AuthenticationError):
        decode(bytes(bad), SECRET)
    no_tag = bytearray(frame)
    no_tag[5:37] = bytes(32)
    with pytest.raises(AuthenticationError):
        decode(bytes(no_tag), SECRET)
    with pytest.raises(AuthenticationError):
        decode(frame[:-10], SECRET)  # truncated
    with pytest.raises(ValueError):
        decode(frame[:20], SECRET)


PWNED: list[str] = []


def _pwn(who: str) -> None:
    PWNED.append(who)


class _Exploit:
    def __reduce__(self):
        return (_pwn, ("unpickled!",))


def _sign(body: bytes) -> bytes:
    """A frame whose header is ``body`` and whose tag is valid: the attacker knows the secret."""
    import hashlib
    import hmac

    prefix = b"LRL\x00" + bytes([1])
    length = struct.pack("<I", len(body))
    tag = hmac.new(SECRET, prefix + length + body, hashlib.sha256).digest()
    return prefix + tag + length + body


def test_pickle_payload_is_never_unpickled():
    payload = pickle.dumps(_Exploit())
    pickle.loads(payload)  # the exploit works when unpickled...
    assert PWNED == ["unpickled!"]
    PWNED.clear()
    with pytest.raises(ValueError):  # raw pickle: bad magic
        decode(payload, SECRET)
    with pytest.raises(ValueError):  # signed frame with a pickle as its header
        decode(_sign(payload), SECRET)
    # A pickle smuggled as tensor bytes comes back as inert bytes.
    frame = encode({"blob": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, SECRET)
    out = decode(frame, SECRET)
    assert bytes(out["blob"].numpy()) == payload
    assert PWNED == []  # ...and decode never did


def test_malformed_but_signed_frames_raise_value_error():
    for body in [b'{"msg": {"x": {"__tensor__": 3}}, "tensors": []}',
                 b'{"msg": {}, "tensors": [{"dtype": "object", "shape": [], "offset": 0, "nbytes": 8}]}',
                 b'{"msg": {}, "tensors": [{"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}]}',
                 b'{"msg": [1, 2], "tensors": []}', b"not json"]:
        with pytest.raises(ValueError):
            decode(_sign(body), SECRET)


def test_secret_from_env(monkeypatch):
    secret = new_secret()
    assert len(secret) == 32 and secret != new_secret()
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, secret.hex())
    assert read_secret() == secret
    monkeypatch.setenv(SECRET_ENV, "zz-not-hex")
    with pytest.raises(RuntimeError, match="hex"):
        read_secret()
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(RuntimeError, match=SECRET_ENV):
        read_secret()


def test_app_stop_with_a_misspelt_app_id_makes_no_secret_and_says_so_in_one_line(tmp_path, monkeypatch):
    """A secret file that does not exist names no app that ran: ``llamarl.app.roles.stop`` ends at once
    on one line, and leaves no fresh secret behind (the roles' ``read_secret`` makes one)."""
    from llamarl.app.roles import stop

    missing = tmp_path / "secrets" / "llamarl-nope"
    with pytest.raises(SystemExit) as ended:
        stop.main(["--store-addr", "localhost:0", "--app-id", "llamarl-nope", "--secret-file", str(missing)])
    assert str(ended.value.code).startswith(f"llamarl.app.roles.stop: cannot stop llamarl-nope: --secret-file names {missing}, "
                                            "which does not exist")
    assert not missing.exists()
    assert len(read_secret(str(missing))) == 32 and missing.exists(), "a role still makes it"


# --------------------------------------------------------------------------- store


def test_connect_store_unreachable_names_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"llamarl control store at 127.0.0.1:{port}"):
        connect_store(f"127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(ValueError):
        connect_store("no-port", timeout_s=1)


def test_a_role_waiting_for_the_store_says_what_it_waits_for_and_where(monkeypatch):
    """Started alone (no trainer), a role does not stay silent until its timeout: it says
    what it waits for, where, and for which app, first after a few seconds, then at intervals."""
    from llamarl.app.control import transport

    monkeypatch.setattr(transport, "FIRST_WAIT_NOTE_S", 0.5)
    monkeypatch.setattr(transport, "WAIT_NOTE_EVERY_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said: list[str] = []
    with pytest.raises(ConnectionError):
        connect_store(f"127.0.0.1:{port}", timeout_s=3.2, app_id="llamarl-abc", say=said.append)
    assert 2 <= len(said) <= 4, said
    assert said[0].startswith("waiting ") and f"the control store at 127.0.0.1:{port} of app llamarl-abc" in said[0]
    assert "giving up after 3.2 s" in said[0]


def test_queue_pop_timeout_pop_many_and_depth(store):
    q = StoreQueue(client(store), "rollouts", SECRET, maxlen=10)
    t0 = time.monotonic()
    assert q.pop(timeout_s=0.2) is None
    assert time.monotonic() - t0 >= 0.2
    assert q.pop_many(5, timeout_s=0.05) == []
    for i in range(4):
        q.push({"i": i}, timeout_s=1)
    assert q.depth() == 4
    assert [m["i"] for m in q.pop_many(3, timeout_s=1)] == [0, 1, 2]
    assert [m["i"] for m in q.pop_many(3, timeout_s=1)] == [3]


def test_queue_rejects_foreign_and_oversized_messages(store):
    q = StoreQueue(store, "q", SECRET, maxlen=4)
    StoreQueue(store, "q", new_secret(), maxlen=4).push({"x": 1}, timeout_s=1)
    with pytest.raises(AuthenticationError):
        q.pop(timeout_s=1)
    with pytest.raises(ValueError, match="limit"):
        q.push({"x": torch.zeros(MAX_FRAME_BYTES // 4 + 1)}, timeout_s=1)


def test_queue_backpressure_blocks_then_times_out_naming_queue(store):
    q = StoreQueue(client(store), "prompts", SECRET, maxlen=2)
    q.push({"i": 0}, timeout_s=1)
    q.push({"i": 1}, timeout_s=1)
    with pytest.raises(TimeoutError, match=r"queue 'prompts'.*full"):
        q.push({"i": 2}, timeout_s=0.2)
    assert q.depth() == 2

    # A push blocked on a full queue goes through as soon as a consumer makes room.
    done = threading.Event()

    def producer():
        q2 = StoreQueue(client(store), "prompts", SECRET, maxlen=2)
        q2.push({"i": 2}, timeout_s=10)
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.3)
    assert not done.is_set()
    assert q.pop(timeout_s=1)["i"] == 0
    th.join(10)
    assert done.is_set()
    assert [q.pop(timeout_s=1)["i"] for _ in range(2)] == [1, 2]


def test_should_stop_interrupts_waits(store):
    q = StoreQueue(store, "events", SECRET, maxlen=1)
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    with pytest.raises(Stopped):
        q.pop(timeout_s=30, should_stop=flag.is_set)
    q.push({"x": 1}, timeout_s=1)
    with pytest.raises(Stopped):
        q.push({"x": 2}, timeout_s=30, should_stop=lambda: True)
    control_ = control(store)
    with pytest.raises(Stopped):
        q.push({"x": 2}, timeout_s=30, should_stop=lambda: control_.stopped() or
               control_.request_stop("test") is None)


def _produce(port: int, n: int, maxlen: int) -> None:
    store = connect_store(f"127.0.0.1:{port}", timeout_s=30)
    q = StoreQueue(store, "fifo", SECRET, maxlen=maxlen)
    for i in range(n):
        q.push({"i": i, "logp_T": torch.full((i + 1,), float(i))}, timeout_s=30)
    control(store, "producer/0").register("producer", 0)


def test_queue_fifo_and_backpressure_across_processes(store):
    n, maxlen = 40, 4
    ctx = forkserver_context()
    proc = ctx.Process(target=_produce, args=(store.port, n, maxlen))
    proc.start()
    q = StoreQueue(store, "fifo", SECRET, maxlen=maxlen)
    got, max_depth = [], 0
    try:
        while len(got) < n:
            max_depth = max(max_depth, q.depth())
            msg = q.pop(timeout_s=60)
            assert msg is not None, "producer process sent nothing"
            got.append(msg)
            time.sleep(0.005)  # a slow consumer, so the producer hits the bound
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert [m["i"] for m in got] == list(range(n))
    assert all(torch.equal(m["logp_T"], torch.full((m["i"] + 1,), float(m["i"]))) for m in got)
    assert max_depth <= maxlen
    assert control(store).members() == ["producer/0"]


# --------------------------------------------------------------------------- control


def test_control_version_and_stop(store):
    trainer, gen = control(store), control(client(store), "generator/0")
    assert gen.version() == 0
    trainer.set_version(7)
    # TCPStore's SET gets no reply, so another connection may read before the server has
    # applied it: readers poll (as the roles do); the value must show up.
    deadline = time.monotonic() + 10.0
    while gen.version() != 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gen.version() == 7
    assert trainer.stop_reason() is None and not gen.stopped()
    gen.request_stop("reward model diverged")
    trainer.request_stop("second reason loses")
    assert trainer.stopped()
    assert trainer.stop_reason() == "reward model diverged"


def test_control_members_heartbeats_and_failures(store):
    trainer = control(store)
    with pytest.raises(TimeoutError, match="generator/1"):
        trainer.wait_for_members({"generator": 2, "reward": 1}, timeout_s=0.1)
    peers = {m: control(client(store), m) for m in ("generator/0", "generator/1", "reward/0")}
    peers["generator/0"].register("generator", 0)
    peers["reward/0"].register("reward", 0)
    with pytest.raises(TimeoutError) as err:
        trainer.wait_for_members({"generator": 2, "reward": 1}, timeout_s=0.1)
    assert "generator/1" in str(err.value) and "reward/0" not in str(err.value).split("(")[0]
    threading.Timer(0.1, peers["generator/1"].register, args=("generator", 1)).start()
    assert trainer.wait_for_members({"generator": 2, "reward": 1}, timeout_s=5) == [
        "generator/0", "generator/1", "reward/0"]

    assert set(trainer.last_heartbeats()) == {"generator/0", "generator/1", "reward/0"}
    time.sleep(0.3)
    peers["generator/0"].heartbeat("generator", 0)
    peers["reward/0"].heartbeat("reward", 0)
    ages = trainer.last_heartbeats()
    assert ages["generator/0"] < 0.2 and ages["generator/1"] >= 0.3
    assert trainer.dead_members(max_age_s=0.25) == ["generator/1"]

    assert trainer.failures() == {} and trainer.stop_reason() is None
    peers["reward/0"].mark_failed("reward", 0, "CUDA error: out of memory")
    assert trainer.failures() == {"reward/0": "CUDA error: out of memory"}
    assert "reward/0 failed" in trainer.stop_reason()
    assert "reward/0" in trainer.dead_members(max_age_s=60)
    with pytest.raises(ValueError):
        peers["reward/0"].register("bad/role", 0)


def test_runtime_should_stop_sees_a_stop_and_spares_the_store(store, monkeypatch):
    """Every poll loop of every thread asks should_stop: the answer comes from the store
    at most every STOP_CHECK_S, and a stop is seen within that time and then for good."""
    from llamarl.app.control import runtime

    rt = runtime.Runtime(role="generator", replica=0, store=store, control=control(store, "generator/0"),
                         secret=SECRET)
    round_trips = []
    real_stopped = rt.control.stopped
    monkeypatch.setattr(rt.control, "stopped", lambda: round_trips.append(1) or real_stopped())

    t0 = time.monotonic()
    for _ in range(2000):
        assert rt.should_stop() is False
    elapsed = time.monotonic() - t0
    assert len(round_trips) <= 2 + elapsed / runtime.STOP_CHECK_S

    control(store).request_stop("finished", finished=True)
    time.sleep(runtime.STOP_CHECK_S)
    assert rt.should_stop() is True
    calls = len(round_trips)
    assert all(rt.should_stop() for _ in range(100)) and len(round_trips) == calls


def test_secret_from_a_private_file(tmp_path, monkeypatch):
    """The SLURM scheduler's way: $LLAMARL_SECRET_FILE names a file only its owner reads."""
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret.hex())
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 644 lets other users read"):
        read_secret()
    path.chmod(0o600)
    assert read_secret() == secret
    # A file that is not there yet is made by the first role that looks: the component's
    # default (under the runs directory) needs no setup, and every role reads the same.
    path.unlink()
    made = read_secret()
    assert made != secret and read_secret() == made and read_secret(str(path)) == made
    assert path.stat().st_mode & 0o777 == 0o600
    deeper = tmp_path / "private" / "secret"
    assert len(read_secret(str(deeper))) == 32
    assert deeper.parent.stat().st_mode & 0o777 == 0o700
    # Every directory it makes is private, not only the last (os.makedirs' mode is the leaf's).
    nested = tmp_path / "a" / "b" / "c" / "secret"
    assert len(read_secret(str(nested))) == 32
    for made_dir in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert made_dir.stat().st_mode & 0o777 == 0o700, made_dir
