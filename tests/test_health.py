"""``llamarl.app.control.health`` and the app-id check of ``llamarl.app.control.runtime`` against a real store on loopback."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llamarl.app import errors
from llamarl.app.data import sources as data
from llamarl.app.control import frames
from llamarl.app.control import health
from llamarl.app.control import membership
from llamarl.app import names
from llamarl.app.control import replica_lock
from llamarl.app.control import runtime
from llamarl.app.control import transport
from role_processes import TEST_SECRET, control as control_as, loopback_store


@pytest.fixture()
def store():
    return loopback_store(timeout_s=30)


def test_check_health_names_a_failed_member_first(store):
    control = control_as(store)
    control_as(store, "generator/0").register("generator", 0)
    health.check_health(control)  # all alive
    control_as(store, "reward/0").mark_failed("reward", 0, "ValueError: bad spec")
    with pytest.raises(health.AppFailed, match=r"^reward/0 failed: ValueError: bad spec$"):
        health.check_health(control)


def test_a_failure_the_role_logged_itself_is_not_logged_again_at_exit(store, caplog):
    """The trainer logs its failure at once (ending the app then waits for the others);
    the runtime's exit still publishes it, without a second "failed:" line."""
    for logged in (False, True):
        caplog.clear()
        with pytest.raises(errors.ConfigError), runtime.Runtime.join("reward", int(logged), store, TEST_SECRET) as rt:
            rt.failure_logged = logged
            raise errors.ConfigError("steps must be >= 1, got 0")
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("failed: ")]
        assert said == ([] if logged else ["failed: llamarl.app.errors.ConfigError: steps must be >= 1, got 0"])
        assert "steps must be >= 1, got 0" in str(control_as(store, "trainer/0").failures()), "still published"


def test_check_health_names_members_whose_heartbeat_stood_still(store):
    control = control_as(store)
    for replica in (0, 1):
        control_as(store, f"generator/{replica}").register("generator", replica)
    health.check_health(control, timeout_s=0.2)  # first sight: fresh
    time.sleep(0.3)
    control_as(store, "generator/0").heartbeat("generator", 0)
    with pytest.raises(health.AppFailed, match=r"no heartbeat for 0.2 s from generator/1: the process is gone"):
        health.check_health(control, timeout_s=0.2)


def test_waiting_for_members_names_one_that_died_while_the_others_start(store):
    """The trainer waits for every member to register (and replica 0 for their dataset
    checks) for up to 900 s; a member that registered and then went silent is named
    within the heartbeat timeout instead."""
    control = control_as(store)
    control_as(store, "generator/0").register("generator", 0)  # registered, then killed: no heartbeat ever moves
    check = functools.partial(health.check_health, control, timeout_s=0.3)
    with pytest.raises(health.AppFailed, match=r"from generator/0: the process is gone"):
        control.wait_for_members({"generator": 2}, timeout_s=30, health=check)
    rt = SimpleNamespace(store=store, control=control, signed=control.signed, should_stop=lambda: False)
    with pytest.raises(health.AppFailed, match=r"from generator/0: the process is gone"):
        data.wait_for_checks(rt, [names.member("generator", 0)], timeout_s=30, health=check)


def test_blame_peer_names_the_dead_member_behind_a_connection_error(store):
    control = control_as(store)
    control_as(store, "generator/0").register("generator", 0)
    control_as(store, "generator/0").mark_failed("generator", 0, "killed")
    blamed = health.blame_peer(control, RuntimeError("Connection reset by peer"), wait_s=1.0)
    assert isinstance(blamed, health.AppFailed) and "generator/0" in str(blamed)
    # An error of its own (no peer in its words) is not blamed on anyone, whoever failed.
    assert health.blame_peer(control, ValueError("shape mismatch"), wait_s=1.0) is None


def test_error_file_round_trip_in_torchelastic_format(tmp_path, monkeypatch):
    path = tmp_path / "replica" / "error.json"
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(path))
    health.write_error_file("trainer failed: ConfigError: steps must be >= 1, got 0", 1)
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "trainer failed: ConfigError: steps must be >= 1, got 0"
    assert data["message"]["errorCode"] == 1 and int(data["message"]["extraInfo"]["timestamp"]) > 0
    assert data["message"]["extraInfo"]["py_callstack"] == "", "no 'NoneType: None' under the cause"
    assert health.read_error_file(str(path)) == data["message"]["message"]
    assert health.read_error_file(str(tmp_path / "none.json")) is None
    try:
        raise ValueError("no such reward")
    except ValueError:
        health.write_error_file("ValueError: no such reward")
    assert "raise ValueError" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]


def test_reported_writes_the_cause_of_a_roles_own_failure_only(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(path))
    with pytest.raises(SystemExit), health.reported():
        raise SystemExit("stopping: trainer/0 failed: boom")  # a bystander of another's failure
    assert not path.exists()
    with pytest.raises(ValueError), health.reported():
        raise ValueError("no such reward")
    assert health.read_error_file(str(path)) == "ValueError: no such reward"
    with pytest.raises(SystemExit), health.reported(stops=True):  # a trainer rank: the app's voice
        raise SystemExit("stopping: generator/0 failed: boom")
    assert health.read_error_file(str(path)) == "stopping: generator/0 failed: boom"


@pytest.mark.parametrize("raised, last_line, traceback", [
    ("errors.ConfigError('llamarl.app.roles.trainer: unrecognized arguments: --learning-rate 1e-4')",
     "ConfigError: llamarl.app.roles.trainer: unrecognized arguments: --learning-rate 1e-4", False),
    ("errors.DataError('t.jsonl, line 2: not valid JSON')", "DataError: t.jsonl, line 2: not valid JSON", False),
    ("RuntimeError('a bug')", "RuntimeError: a bug", True),
])
def test_a_refused_input_ends_a_role_on_one_line_and_a_bug_with_its_traceback(tmp_path, raised, last_line, traceback):
    """What `torchx run` shows of a role: a refusal (``errors.ConfigError`` and its kinds) is
    its one line, exit code 1, no traceback burying it; any other error keeps its
    traceback. Both go to the scheduler's error file."""
    code = f"from llamarl.app import errors\nfrom llamarl.app.control import health\nwith health.reported():\n    raise {raised}\n"
    env = {**os.environ, health.ERROR_FILE_ENV: str(tmp_path / "error.json")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].endswith(last_line), done.stderr
    assert ("Traceback" in done.stderr) == traceback, done.stderr
    assert health.read_error_file(str(tmp_path / "error.json")) == last_line


def test_a_crash_report_names_the_signal_and_the_function():
    report = """Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/work/my_reward.py", line 12 in segv
  File "/work/app/rl.py", line 40 in score_groups

Extension modules: torch (total: 1)
"""
    assert health.describe_crash("trainer/0", report) == \
        "trainer/0 crashed (Segmentation fault) in segv (/work/my_reward.py:12)"
    assert health.describe_crash("trainer/1", "") == "trainer/1 crashed (a fatal signal)"


def test_store_port_is_fixed_or_derived_from_the_app_id():
    assert names.store_port(31234, "any") == 31234
    derived = names.store_port(0, "llamarl-abc123")
    assert derived == names.store_port(0, "llamarl-abc123"), "every role computes the same port"
    assert names.STORE_PORT_BASE <= derived < names.STORE_PORT_BASE + names.STORE_PORT_SPAN
    assert names.store_port(0, "llamarl-abc124") != derived
    # A role started by hand: a refusal (one line) that says how the roles are started.
    with pytest.raises(errors.ConfigError, match="needs --app-id: the roles are started together by `torchx run`"):
        names.store_port(0, "")


def test_a_role_refuses_the_control_store_of_another_app():
    store = runtime.host_app_store(0, "llamarl-first")
    addr = f"127.0.0.1:{store.port}"
    mine = runtime.connect_app_store(addr, "llamarl-first", timeout_s=10)
    assert mine.get(names.APP_ID_KEY) == b"llamarl-first"
    with pytest.raises(ConnectionError, match=r"belongs to app 'llamarl-first', not to this app "
                                              r"\('llamarl-second'\).*--store_port"):
        runtime.connect_app_store(addr, "llamarl-second", timeout_s=10, check_timeout_s=0.5)
    assert control_as(store).members() == [], "refused before registering"


def test_a_second_store_on_a_port_in_use_fails_saying_why():
    first = runtime.host_app_store(0, "llamarl-first")
    with pytest.raises(errors.ConfigError, match=rf"cannot host the control store on port {first.port}.*--store_port"):
        runtime.host_app_store(first.port, "llamarl-second")


def test_a_store_without_an_app_id_is_not_this_apps(store):
    with pytest.raises(ConnectionError, match="publishes no llamarl app id"):
        runtime.connect_app_store(f"127.0.0.1:{store.port}", "llamarl-x", timeout_s=10, check_timeout_s=0.3)


# --------------------------------------------------------------------------- siblings (local scheduler)

def replica_dirs(tmp_path, monkeypatch, own: str = "generator/0") -> dict[str, Path]:
    """TorchX local_cwd's layout, ``<app log dir>/<role>/<replica>/``, this process being ``own``."""
    dirs = {m: tmp_path / "app" / m for m in ("trainer/0", "generator/0", "generator/1", "reward/0")}
    for d in dirs.values():
        d.mkdir(parents=True)
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(dirs[own] / "error.json"))
    monkeypatch.delenv(health.REPLICA_ERROR_FILE_ENV, raising=False)
    return dirs


def write_error(path: Path, message: str) -> None:
    path.write_text(json.dumps({"message": {"message": message, "errorCode": 1}}))


def test_a_sibling_that_failed_before_reaching_the_store_is_named(tmp_path, monkeypatch):
    dirs = replica_dirs(tmp_path, monkeypatch)
    assert set(health.sibling_replica_dirs()) == {"trainer/0", "generator/1", "reward/0"}
    assert health.sibling_failure() is None
    write_error(dirs["generator/0"] / "error.json", "my own failure is not a sibling's")
    assert health.sibling_failure() is None
    write_error(dirs["trainer/0"] / "error.json", "trainer failed: ConnectionError: cannot host the store")
    assert health.sibling_failure() == "trainer/0 failed: ConnectionError: cannot host the store"
    write_error(dirs["reward/0"] / "error.json", "ValueError: unknown reward 'x'")
    (dirs["generator/0"] / "error.json").unlink()
    monkeypatch.setenv(health.REPLICA_ERROR_FILE_ENV, str(dirs["trainer/0"] / "error.json"))
    monkeypatch.setenv(health.ERROR_FILE_ENV, "/tmp/torchrun-of-the-trainer/error.json")
    assert health.sibling_failure() == "reward/0 failed: ValueError: unknown reward 'x'", \
        "a trainer rank finds its replica's directory through llamarl.app.roles.launch's variable"
    assert health.sibling_failure("trainer") is None, "only trainer replicas' failures when asked so"
    assert health.sibling_failure("reward") == "reward/0 failed: ValueError: unknown reward 'x'"


def test_siblings_outside_the_local_layout_are_none(tmp_path, monkeypatch):
    monkeypatch.delenv(health.REPLICA_ERROR_FILE_ENV, raising=False)
    monkeypatch.delenv(health.ERROR_FILE_ENV, raising=False)
    assert health.sibling_replica_dirs() == {} and health.sibling_failure() is None
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(tmp_path / "job" / "error.json"))  # not <role>/<k>/
    assert health.sibling_replica_dirs() == {}


def test_a_silent_sibling_that_crashed_is_named_with_its_function(tmp_path, monkeypatch):
    dirs = replica_dirs(tmp_path, monkeypatch, own="trainer/0")
    (dirs["generator/1"] / "stderr.log").write_text(
        "x" * (health.CRASH_LOG_TAIL_BYTES + 10) + "\nFatal Python error: Segmentation fault\n\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/work/my_policy.py", line 7 in forward\n  File "/work/app/generator.py", line 3 in run\n')
    (dirs["generator/0"] / "stderr.log").write_text("Traceback: an ordinary log\n")
    assert health.sibling_crash("generator/1") == \
        "generator/1 crashed (Segmentation fault) in forward (/work/my_policy.py:7)"
    assert health.sibling_crash("generator/0") is None and health.sibling_crash("generator/7") is None


def test_a_role_gives_up_on_the_store_once_a_sibling_says_the_app_is_gone():
    with socket.socket() as holder:  # a port that answers, but is no store
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        asked = []

        def gone() -> str | None:
            asked.append(1)
            return "trainer/0 failed: cannot host the control store" if len(asked) >= 2 else None

        with pytest.raises(transport.AppGone, match="^trainer/0 failed: cannot host"):
            transport.connect_store(f"127.0.0.1:{holder.getsockname()[1]}", timeout_s=300, give_up=gone)
        assert len(asked) == 2



def hold_lock_and_exit(replica_dir: Path) -> None:
    """A real process that takes its replica's lock on its first line, as the roles do,
    and ends: the lock is free again."""
    env = {**os.environ, health.ERROR_FILE_ENV: str(replica_dir / "error.json")}
    env.pop(health.REPLICA_ERROR_FILE_ENV, None)
    subprocess.run([sys.executable, "-c", "from llamarl.app.control import replica_lock; assert replica_lock.hold()"],
                   env=env, check=True, timeout=60)


def test_a_member_killed_before_it_registers_is_taken_out_at_once(tmp_path, monkeypatch, store, caplog):
    """A real generator process, started in its replica directory, waits for a store that
    does not answer yet (as while the trainer starts); SIGKILLed there, it leaves no error
    file and never had a heartbeat. The trainer's membership watcher finds the lock the
    generator took on its first line free: with generator/0 alive it is taken out and not
    waited for (not for 900 s); reward/0, the last of its role, fails the run, named."""
    dirs = replica_dirs(tmp_path, monkeypatch, own="trainer/0")
    control = control_as(store)
    members = membership.Membership(control.signed, {"generator": 2, "reward": 1}, watch_heartbeats=False)
    control_as(store, "generator/0").register("generator", 0)
    assert members.poll() == [] and control.failures() == {}  # the others not started: nothing to say
    with socket.socket() as unused:  # bound, never listening: no store answers there
        unused.bind(("127.0.0.1", 0))
        env = {**os.environ, health.ERROR_FILE_ENV: str(dirs["generator/1"] / "error.json"),
               frames.SECRET_ENV: TEST_SECRET.hex()}
        env.pop(health.REPLICA_ERROR_FILE_ENV, None)
        proc = subprocess.Popen([sys.executable, "-m", "llamarl.app.roles.generator", "--replica", "1", "--num-generators", "2",
                                 "--store-addr", f"127.0.0.1:{unused.getsockname()[1]}"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            lock = dirs["generator/1"] / replica_lock.LOCK_NAME
            deadline = time.monotonic() + 120
            while not lock.exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the generator never took its lock"
                time.sleep(0.05)
            assert members.poll() == []  # alive and starting
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert not (dirs["generator/1"] / "error.json").exists(), "SIGKILL: no error file to read"
    with caplog.at_level(logging.INFO, logger="llamarl"):
        assert members.poll() == ["generator/1"]
    assert ("generator/1 is gone: ended before it registered with the trainer (killed, out of memory, or its "
            "node was lost): the run goes on with generator/0") in caplog.text
    assert control.gone() == {"generator/1"} and members.alive("generator") == ["generator/0"]
    assert control.wait_for_members({"generator": 2}, timeout_s=600, health=functools.partial(
        health.check_health, control)) == ["generator/0"], "generator/1 is not waited for"
    health.check_health(control)  # a tolerated loss is no failure

    (dirs["reward/0"] / "stderr.log").write_text("llamarl.app.roles.reward: error: unrecognized arguments: --x\n\n")
    hold_lock_and_exit(dirs["reward/0"])
    assert members.poll() == []
    with pytest.raises(health.AppFailed, match=r"^reward/0 failed: gone: ended before it registered with the "
                                               r"trainer \(killed, out of memory, or its node was lost; the last "
                                               r"line of its stderr: 'llamarl.app.roles.reward: error: unrecognized arguments: "
                                               r"--x'\), and it was the last reward executor"):
        health.check_health(control)
    assert health.vanished_before_registering({"generator/1", "reward/0"}) == [], "registered: heartbeats speak"
    # Ending the app, the trainer does not wait STOP_ACK_TIMEOUT_S for their acknowledgement.
    control_as(store, "generator/0").mark_exited("generator", 0)
    rt = SimpleNamespace(role="trainer", replica=0, control=control)
    with caplog.at_level(logging.INFO, logger="llamarl"):
        runtime.end_app(rt, ["generator/0", "generator/1", "reward/0"], "reward/0 ended", failed=True)
    assert "reward/0, generator/1: no heartbeat and no stop acknowledged: the process is gone" in caplog.text
    assert "did not acknowledge" not in caplog.text
