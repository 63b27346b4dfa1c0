"""Every failure ends the whole app, non-zero, naming its cause, with no process left:
``llamarl.llamarl`` launched through TorchX's runner on local_cwd (``app_launch``), one
fault per test. How fast each ends is measured by ``benchmarks/faults.py``, not here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch
from torchx.specs import AppState

from app_launch import APP_TIMEOUT_S, SMALL, App, launch, rows
from llamarl.app.names import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A stuck app fails its test long before APP_TIMEOUT_S: these apps end in seconds.
FAIL_TIMEOUT_S = 120.0
# Processes of an app that ended: a trainer rank whose torchrun agent was killed exits on
# its own, shortly after the others (it is in a session of its own, out of the
# scheduler's reach).
LEFTOVER_TIMEOUT_S = 60.0


def app_processes(app: App) -> list[str]:
    """``pid command`` of every process whose command line carries this app's id."""
    out = subprocess.run(["pgrep", "-af", app.app_id], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if not line.startswith(f"{os.getpid()} ")]


def last_lines(text: str, n: int = 3) -> str:
    return "\n".join([line for line in text.splitlines() if line.strip()][-n:])


def assert_fails_naming(app: App, cause: str, *, stopped: tuple[tuple[str, int], ...] = (("generator", 0),),
                        trainer_cause: str | None = None) -> None:
    """The app ends FAILED; the error ``torchx run`` prints names ``cause``, and so do the
    last lines of the trainer's log and of each role in ``stopped`` (which stopped
    because of it); then no process of the app is left."""
    state = app.wait(timeout_s=FAIL_TIMEOUT_S)
    assert state == AppState.FAILED, app.logs_tail()
    status = app.runner.status(app.handle)
    assert cause in status.structured_error_msg, (status.structured_error_msg, app.logs_tail())
    trainer = last_lines(app.log("trainer"))
    assert (trainer_cause or cause) in trainer, app.logs_tail()
    assert "ChildFailedError" not in trainer
    for role, replica in stopped:
        tail = last_lines(app.log(role, replica), 1)
        assert "stopping: " in tail and cause in tail, (role, replica, app.logs_tail())
    deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
    while (left := app_processes(app)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes outlived the app: {left}"


# --------------------------------------------------------------------------- start-up typos

def test_steps_0_ends_every_role(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=0, num_generators=2, num_reward=1) as app:
        assert_fails_naming(app, "steps must be >= 1, got 0",
                            stopped=(("generator", 0), ("generator", 1), ("reward", 0)))


def test_an_unknown_reward_ends_every_role(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, num_generators=1, rewards="math_verifer") as app:
        assert_fails_naming(app, "unknown reward 'math_verifer'")


def test_a_precision_this_machine_cannot_run_ends_every_role(tiny_policy, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine may run fp8")
    with launch(tiny_policy, tmp_path, num_generators=1, extra=[*SMALL, "--gen-precision", "fp8"]) as app:
        assert_fails_naming(app, "--gen-precision 'fp8' cannot run on cpu; this machine (cpu) supports: fp32, bf16")


def test_an_unusable_runs_dir_ends_every_role(tiny_policy, tmp_path):
    runs_dir = tmp_path / "not-a-dir"
    runs_dir.write_text("a file where the runs directory should be")
    with launch(tiny_policy, tmp_path, num_generators=1, runs_dir=runs_dir) as app:
        assert_fails_naming(app, str(runs_dir))


def test_a_second_app_on_the_same_store_port_fails_and_the_first_runs_on(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path / "first", steps=10_000, num_generators=1,
                extra=[*SMALL, "--eval-every", "100000"]) as first:
        first.wait_for_log("trainer", "step 1/10000", timeout_s=APP_TIMEOUT_S)
        with launch(tiny_policy, tmp_path / "second", num_generators=1, store_port=first.store_port) as second:
            state = second.wait(timeout_s=FAIL_TIMEOUT_S)
            assert state == AppState.FAILED, second.logs_tail()
            assert f"cannot host the control store on port {first.store_port}" in last_lines(second.log("trainer"))
            # Its generator reached the first app's store and refused it, before registering.
            assert f"belongs to app '{first.app_id}', not to this app ('{second.app_id}')" in \
                last_lines(second.log("generator"))
        # The first app trains on, untouched (the test then cancels it).
        assert first.runner.status(first.handle).state == AppState.RUNNING, first.logs_tail()
        last_step = int(re.findall(r"step (\d+)/10000", first.log("trainer"))[-1])
        first.wait_for_log("trainer", f"step {last_step + 1}/10000", timeout_s=APP_TIMEOUT_S)
        assert " ERROR " not in first.log("trainer") and second.app_id not in first.log("trainer")


def test_a_store_port_held_by_another_program_ends_every_role_in_seconds(tiny_policy, tmp_path):
    """The trainer cannot host the store, so no role can hear why from it: the generator
    finds the trainer's error file beside its own (local scheduler) and gives up, naming it,
    instead of waiting ``--connect-timeout-s`` (300 s) on a port that answers nothing."""
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with launch(tiny_policy, tmp_path, num_generators=1, store_port=port) as app:
            assert_fails_naming(app, f"cannot host the control store on port {port}")
    finally:
        holder.close()


def test_a_trainer_node_that_cannot_rendezvous_ends_the_other_node_in_seconds(tiny_policy, tmp_path):
    """trainer_nodes=2 with trainer replica 0's rendezvous port (the store port + 1) held
    by another program: replica 0's torchrun fails before any rank exists, so no rank of
    the app can tell replica 1, whose torchrun waits in the rendezvous; its ``llamarl.app.roles.launch``
    finds replica 0's error file, stops it and names that cause, instead of torchrun
    waiting out its rendezvous timeout (600 s) with the app alive."""
    port = free_port()
    holder = socket.socket()
    holder.bind(("", port + 1))
    holder.listen()
    try:
        with launch(tiny_policy, tmp_path, num_generators=1, store_port=port, options=["--trainer_nodes", "2"]) as app:
            assert_fails_naming(app, "EADDRINUSE", stopped=(("generator", 0), ("trainer", 1)))
    finally:
        holder.close()


# --------------------------------------------------------------------------- a role dies

def kill(app: App, pattern: str, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to the one process of this app whose command line matches ``pattern``."""
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, f"expected one process matching {pattern!r}, found {pids}"
    os.kill(int(pids[0]), sig)


def test_a_dead_reward_executor_ends_the_app_while_the_trainer_waits(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=60, num_generators=1, num_reward=1,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", "step 1/60", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.reward .*--app-id {app.app_id} --replica 0")
        assert_fails_naming(app, "reward/0")


def test_the_dead_last_generator_ends_a_synchronous_run(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=60, num_generators=1, max_staleness=0,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", "step 1/60", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.generator .*--app-id {app.app_id} --replica 0")
        assert_fails_naming(app, "generator/0", stopped=())


def test_a_crashed_generator_is_named_with_the_function_it_crashed_in(tiny_policy, tmp_path):
    """No heartbeat says why a process vanished: its faulthandler report, in the
    ``stderr.log`` the local scheduler keeps beside the trainer's, names the crash."""
    with launch(tiny_policy, tmp_path, steps=60, num_generators=1,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", "step 1/60", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.generator .*--app-id {app.app_id} --replica 0", signal.SIGSEGV)
        assert_fails_naming(app, "generator/0 failed: crashed (Segmentation fault) in ", stopped=())


def test_a_killed_torchrun_agent_leaves_no_trainer_behind(tiny_policy, tmp_path):
    with launch(tiny_policy, tmp_path, steps=60, num_generators=1,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", "step 1/60", timeout_s=APP_TIMEOUT_S)
        kill(app, f"llamarl.app.roles.torchrun .*--app-id {app.app_id} ")
        assert_fails_naming(app, "torchrun")


def test_a_crashed_trainer_is_named_with_the_function_it_crashed_in(tiny_policy, tmp_path):
    """A fatal signal leaves no Python exception: the trainer's faulthandler report names
    the crash and the innermost function of the thread that crashed."""
    with launch(tiny_policy, tmp_path, steps=60, num_generators=1,
                extra=[*SMALL, "--eval-every", "1000"]) as app:
        app.wait_for_log("trainer", "step 1/60", timeout_s=APP_TIMEOUT_S)
        kill(app, f"python -u -m llamarl.app.roles.trainer .*--app-id {app.app_id} ", signal.SIGSEGV)
        assert_fails_naming(app, "trainer/0 crashed (Segmentation fault) in ", stopped=())
        # The generator lost the store with its host, and says so rather than "Connection reset".
        assert "stopping: the control store is gone" in last_lines(app.log("generator"), 1)


def test_a_reward_that_segfaults_in_its_worker_is_quarantined_and_the_run_goes_on(tiny_policy, tmp_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    with launch(tiny_policy, tmp_path, steps=2, num_generators=1,
                rewards="math_verifier,reward_fixtures:segv_on_every_third_length=0.1",
                env={"PYTHONPATH": tests_dir}) as app:
        assert app.wait() == AppState.SUCCEEDED, app.logs_tail()
        crashed = rows(app.db(), "SELECT max(value) FROM scalars WHERE name = 'quarantined/crashed'")[0][0]
        assert crashed and crashed > 0, app.logs_tail()
        assert "died while scoring" in app.log("trainer")
