"""llamarl.app.roles.launch's torchrun command: standalone on one node; on several, a static
rendezvous at trainer replica 0 whose node rank is the replica index, and every rank
pointed at replica 0's host for the control store; the cause of a rank a signal killed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from llamarl.app.control import health
from llamarl.app.roles import launch
from llamarl.app import names
from llamarl.app.roles import torchrun
from llamarl.app.roles.launch import Nodes, torchrun_command

TRAINER_ARGS = ["--store-port", "0", "--app-id", "llamarl-abc", "--steps", "3"]


def test_one_node_is_a_standalone_torchrun():
    cmd = torchrun_command(2, TRAINER_ARGS)
    assert cmd == [sys.executable, "-m", "llamarl.app.roles.torchrun", "--nproc_per_node", "2", "--standalone",
                   "--nnodes", "1", "-m", "llamarl.app.roles.trainer", *TRAINER_ARGS]


def test_several_nodes_meet_at_replica_0_and_reach_its_store():
    cmd = torchrun_command(2, TRAINER_ARGS, Nodes(nnodes=3, node_rank=1, rdzv_host="node0"))
    port = names.rendezvous_port(0, "llamarl-abc")
    assert cmd == [sys.executable, "-m", "llamarl.app.roles.torchrun", "--nproc_per_node", "2", "--nnodes", "3",
                   "--node_rank", "1", "--rdzv_backend", "static", "--rdzv_endpoint", f"node0:{port}",
                   "-m", "llamarl.app.roles.trainer", *TRAINER_ARGS, "--store-host", "node0"]
    with_port = torchrun_command(1, ["--store-port", "29700"], Nodes(nnodes=2, node_rank=0, rdzv_host="h"))
    assert "h:29701" in with_port, "a fixed store port: the rendezvous is the next one (map both)"


def test_derived_rendezvous_ports_never_meet_derived_store_ports():
    ids = [f"llamarl-{i}" for i in range(500)]
    stores = {names.store_port(0, a) for a in ids}
    rendezvous = {names.rendezvous_port(0, a) for a in ids}
    assert not stores & rendezvous
    assert max(rendezvous) < names.RENDEZVOUS_PORT_BASE + names.STORE_PORT_SPAN


@pytest.mark.parametrize("nnodes,node_rank", [(0, 0), (2, 2), (2, -1)])
def test_a_node_rank_outside_the_nodes_is_refused(nnodes, node_rank):
    with pytest.raises(ValueError, match="--node-rank"):
        Nodes(nnodes=nnodes, node_rank=node_rank)


def test_a_rank_killed_by_a_signal_is_named_from_torchruns_last_line(tmp_path, monkeypatch, capfd):
    """A real torchrun (``llamarl.app.roles.torchrun``) whose one rank SIGKILLs itself (as the
    out-of-memory killer would): no error file, no faulthandler report; the launcher names
    the rank and the signal, not "torchrun ended without a worker's cause"; the terminal
    shows no traceback of torchrun's agent and no ``ChildFailedError`` banner above it."""
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    command = [sys.executable, "-m", "llamarl.app.roles.torchrun", "--standalone", "--nproc_per_node", "1",
               "--no-python", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert launch.supervise(command) == 1
    cause = ("trainer failed: trainer/0 was killed by SIGKILL with no Python error (killed by hand or by the "
             "out-of-memory killer, or its node was lost)")
    assert health.read_error_file(str(tmp_path / "error.json")) == cause
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert err.strip().splitlines()[-2:] == [torchrun.FAILED_RANK_LINE.format(rank=0, exitcode=-9), cause]


def test_torchruns_last_line_without_a_signal_names_nothing():
    assert launch.killed_rank_cause("x\n" + torchrun.FAILED_RANK_LINE.format(rank=1, exitcode=1) + "\n") is None
    assert launch.killed_rank_cause(torchrun.FAILED_RANK_LINE.format(rank=1, exitcode=-6)).startswith(
        "trainer/1 was killed by SIGABRT with no Python error")


def test_a_stop_signal_is_named_as_a_stop_not_as_torchruns_signal_exception(tmp_path, monkeypatch, capfd):
    """SIGTERM to the launcher (what the local scheduler sends every role when `torchx run`
    gets Ctrl-C, and what `torchx cancel` or SLURM sends): a real torchrun stops its rank;
    the cause says the run was told to stop, not "trainer failed: SignalException: Process
    N got signal: 15" (torchrun's own error file); torchrun, signalled twice as under SLURM
    (by slurmstepd and by the launcher), stops once, without its agent's "--- Logging
    error ---" or warnings; the launcher's handlers are put back."""
    monkeypatch.setenv(health.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    started = tmp_path / "started"
    command = [sys.executable, "-m", "llamarl.app.roles.torchrun", "--standalone", "--nproc_per_node", "1",
               "--no-python", sys.executable, "-c",
               f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(600)"]

    def stop_once_started() -> None:
        deadline = time.monotonic() + 120.0  # torchrun's start on a loaded machine
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # As slurmstepd does on a cancel: every process of the step, torchrun's agent too,
        # which the launcher then signals a second time.
        for child in Path("/proc").glob("[0-9]*"):
            try:
                if int((child / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    os.kill(int(child.name), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_once_started, daemon=True).start()
    assert launch.supervise(command) != 0
    cause = health.read_error_file(str(tmp_path / "error.json"))
    assert cause is not None and cause.startswith("trainer stopped: SIGTERM received (Ctrl-C to `torchx run`"), cause
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1] == cause
    assert "Traceback" not in err, "no traceback of torchrun's agent around its SignalException"
    assert "death signal" not in err and "closing signal" not in err, "one stop, one line"
    assert "Logging error" not in err
    assert signal.getsignal(signal.SIGTERM) is handler
