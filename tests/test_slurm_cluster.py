"""llamarl on a real SLURM cluster, through the ``torchx`` CLI as a user types it.

Needs a cluster whose partition ``debug`` has at least 4 nodes: on one machine,
``deploy/slurm/local-cluster.sh up`` (CI does this). Without one these tests skip, saying
so; with ``LLAMARL_REQUIRE_SLURM=1`` (CI) a missing cluster fails them instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.specs import AppState, is_terminal, parse_app_handle

from app_launch import SMALL
from llamarl.app.names import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
APP_TIMEOUT_S = 300.0
# After a cancel Slurm sends SIGTERM, then SIGKILL KillWait (10 s on the local cluster) later.
PROCESS_EXIT_TIMEOUT_S = 60.0
# The time-limit test's: a minute is enough for a tiny model's first steps on a quiet
# machine (the first step comes some 13 s after the submit); a loaded one needs more.
TIME_LIMIT_MIN = int(os.environ.get("LLAMARL_SLURM_TIME_LIMIT_MIN", "1"))
# A long run for the cancels, without held-out evaluations.
LONG = [*SMALL[:SMALL.index("--eval-every") + 1], "1000", *SMALL[SMALL.index("--eval-every") + 2:]]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    problem = None
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which("sbatch") is None:
        problem = "SLURM is not installed (sbatch not on PATH)"
    elif not os.path.isfile(conf):
        problem = f"no SLURM cluster is configured here ({conf} does not exist)"
    else:
        idle = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D"], capture_output=True, text=True,
                              timeout=60)
        if idle.returncode != 0 or not idle.stdout.strip():
            problem = f"no SLURM cluster with a partition debug answers: {(idle.stderr or idle.stdout).strip()}"
        elif int(idle.stdout.split()[0]) < 4:
            problem = f"partition debug has {idle.stdout.split()[0]} nodes; the app needs 4"
    if problem is None:
        return
    problem += " (start one with deploy/slurm/local-cluster.sh up)"
    if os.environ.get("LLAMARL_REQUIRE_SLURM") == "1":
        pytest.fail(f"LLAMARL_REQUIRE_SLURM=1 but {problem}")
    pytest.skip(problem)


def torchx(*args: str) -> subprocess.CompletedProcess:
    """The torchx CLI from the repository (its .torchxconfig: partition debug)."""
    return subprocess.run([sys.executable, "-m", "torchx.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def submit(policy: Path, tmp_path: Path, *, steps: int = STEPS, extra: list[str] = SMALL,
           store_port: int | None = None,
           replicas: tuple[str, ...] = ("--num_generators", "2", "--num_reward", "1"),
           cfg: tuple[str, ...] = (), options: tuple[str, ...] = ()) -> str:
    """``torchx run -s slurm_llamarl llamarl.llamarl``: the app runs in ``tmp_path`` (``--image``),
    which holds its runs directory and its logs; returns the app handle. Without
    ``store_port`` a free one; 0 is the component's default (derived from the job id by
    every role, as the README's command runs it). ``replicas``: the component options
    that size the roles (4 replicas, the cluster's nodes, by default)."""
    port = free_port() if store_port is None else store_port
    proc = torchx("run", "-s", "slurm_llamarl", *cfg, "llamarl.llamarl", "--image", str(tmp_path), "--policy",
                  str(policy), "--runs_dir", str(tmp_path / "runs"), "--store_port", str(port), "--steps", str(steps),
                  *replicas, *options, "--", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    handle = proc.stdout.strip().splitlines()[-1]
    assert handle.startswith("slurm_llamarl://"), proc.stdout
    return handle


def app_id(handle: str) -> str:
    return parse_app_handle(handle).app_id


def logs(tmp_path: Path, handle: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(tmp_path.glob(f"slurm-{app_id(handle)}*.out")))


def wait_state(handle: str, tmp_path: Path, timeout_s: float = APP_TIMEOUT_S) -> AppState:
    deadline = time.monotonic() + timeout_s
    with get_runner() as runner:
        while time.monotonic() < deadline:
            status = runner.status(handle)
            if status is not None and is_terminal(status.state):
                return status.state
            time.sleep(1.0)
    pytest.fail(f"{handle} did not end within {timeout_s:g} s\n{logs(tmp_path, handle)}")


def wait_for_text(path: Path, text: str, timeout_s: float = APP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    pytest.fail(f"{path.name} never showed {text!r}")


def job_processes(handle: str) -> list[int]:
    """Processes on this host started for the job: srun hands TORCHX_JOB_ID to every role."""
    mark = f"TORCHX_JOB_ID={handle}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def wait_no_processes(handle: str) -> None:
    deadline = time.monotonic() + PROCESS_EXIT_TIMEOUT_S
    while job_processes(handle) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(handle) == [], f"processes of {handle} outlived it"


def test_app_succeeds_and_torchx_status_and_log_show_every_role(tiny_policy, tmp_path):
    handle = submit(tiny_policy, tmp_path, store_port=0)
    assert wait_state(handle, tmp_path) == AppState.SUCCEEDED, logs(tmp_path, handle)

    status = torchx("status", handle)
    assert status.returncode == 0, status.stderr
    assert "State: SUCCEEDED" in status.stdout
    for replica in ("trainer[0]", "generator[0]", "generator[1]", "reward[0]"):
        assert f"{replica}:SUCCEEDED" in status.stdout, status.stdout

    # The run id is the job id, in the runs directory the local schedulers use too.
    db = sqlite3.connect(tmp_path / "runs" / app_id(handle) / "metrics.db")
    steps = {s for (s,) in db.execute("SELECT DISTINCT step FROM scalars WHERE role = 'trainer'")}
    assert steps == set(range(STEPS + 1))
    assert db.execute("SELECT count(*) FROM meta WHERE key = 'finished_at'").fetchone() == (1,)

    log = torchx("log", handle)
    assert log.returncode == 0, log.stderr
    assert f"trainer/0 INFO run finished: finished {STEPS} steps" in log.stdout, log.stdout[-3000:]
    for role in ("generator/0", "generator/1", "reward/0"):
        assert f"{role} INFO stopping: finished {STEPS} steps" in log.stdout, log.stdout[-3000:]


@pytest.mark.parametrize("cancel", ["torchx cancel", "scancel"])
def test_cancel_ends_every_role_and_keeps_the_database(tiny_policy, tmp_path, cancel):
    handle = submit(tiny_policy, tmp_path, steps=500, extra=LONG)
    wait_for_text(tmp_path / f"slurm-{app_id(handle)}-trainer-0.out", "step 1/500")
    assert job_processes(handle), "the roles run on this host"
    if cancel == "scancel":
        subprocess.run(["scancel", app_id(handle)], check=True)
    else:
        proc = torchx("cancel", handle)
        assert proc.returncode == 0, proc.stderr
    assert wait_state(handle, tmp_path) == AppState.CANCELLED
    status = torchx("status", handle).stdout
    assert "State: CANCELLED" in status and "the job was cancelled" in status, status
    assert "exited with code" not in status, "replicas stopped by the cancel are not named as failed"
    wait_no_processes(handle)
    # One stop, one line: torchrun's agent, signalled by slurmstepd and by the launcher,
    # stops once, and no role ends in a traceback.
    for log in tmp_path.glob(f"slurm-{app_id(handle)}-*.out"):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "Logging error" not in text, f"{log.name}:\n{text[-3000:]}"
    assert "trainer stopped: SIGTERM received" in (tmp_path / f"slurm-{app_id(handle)}-trainer-0.out").read_text()

    db = sqlite3.connect(tmp_path / "runs" / app_id(handle) / "metrics.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert db.execute("SELECT max(step) FROM scalars WHERE role = 'trainer'").fetchone()[0] >= 1


def test_a_role_with_a_bad_argument_fails_the_job_naming_it(tiny_policy, tmp_path):
    handle = submit(tiny_policy, tmp_path, extra=[*SMALL, "--no-such-flag"])
    assert wait_state(handle, tmp_path) == AppState.FAILED
    status = torchx("status", handle).stdout
    assert "State: FAILED" in status and "trainer-0 exited with code" in status, status
    wait_no_processes(handle)
    assert "--no-such-flag" in (tmp_path / f"slurm-{app_id(handle)}-trainer-0.out").read_text()


def test_a_partition_that_does_not_exist_is_a_message_not_a_traceback(tiny_policy, tmp_path):
    proc = torchx("run", "-s", "slurm_llamarl", "-cfg", "partition=no-such-partition", "llamarl.llamarl",
                  "--image", str(tmp_path), "--policy", str(tiny_policy))
    assert proc.returncode == 1
    assert "sbatch refused the job" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.glob(".llamarl/secrets/*")), "no secret is left for a job never submitted"


def test_a_trainer_of_two_nodes(tiny_policy, tmp_path):
    """trainer_nodes=2: two trainer components of the heterogeneous job on two nodes meet
    at the torchrun rendezvous on trainer-0's node, and the rank on the other node reaches
    the control store there (by node name, not 127.0.0.1); the sharded trainer trains
    every step, and both replicas succeed."""
    handle = submit(tiny_policy, tmp_path, store_port=0,
                    replicas=("--trainer_nodes", "2", "--num_generators", "1", "--num_reward", "0"))
    assert wait_state(handle, tmp_path) == AppState.SUCCEEDED, logs(tmp_path, handle)
    status = torchx("status", handle).stdout
    for replica in ("trainer[0]", "trainer[1]", "generator[0]"):
        assert f"{replica}:SUCCEEDED" in status, status
    # Each component on a node of its own: the two trainer ranks on different nodes.
    sacct = subprocess.run(["sacct", "-j", app_id(handle), "-n", "-P", "-X", "-o", "JobName,NodeList"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    nodes = dict(line.split("|") for line in sacct.split())
    assert nodes["trainer-0"] != nodes["trainer-1"], sacct

    db = sqlite3.connect(tmp_path / "runs" / app_id(handle) / "metrics.db")
    replicas = {r for (r,) in db.execute("SELECT DISTINCT replica FROM intervals WHERE role = 'trainer'")}
    assert replicas == {0, 1}, "rank 1, on the other node, trained and sent its metrics"
    assert '"trainer_ranks": 2' in db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()[0]
    steps = {s for (s,) in db.execute("SELECT DISTINCT step FROM scalars WHERE role = 'trainer'")}
    assert steps == set(range(STEPS + 1))
    assert "run finished: finished" in (tmp_path / f"slurm-{app_id(handle)}-trainer-0.out").read_text()
    rank1 = (tmp_path / f"slurm-{app_id(handle)}-trainer-1.out").read_text()
    assert f"trainer/1 INFO reached the control store at {nodes['trainer-0']}:" in rank1, rank1[-3000:]


def role_process(handle: str, module: str, replica: int) -> int:
    """The pid of one replica's Python process (``python -m <module> ... --replica K``)."""
    for pid in job_processes(handle):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python") and module.encode() in argv and b"--replica" in argv \
                and argv[argv.index(b"--replica") + 1] == str(replica).encode():
            return pid
    pytest.fail(f"no process of {module} --replica {replica} in {handle}")


def test_a_killed_generator_is_survived_restarted_and_named(tiny_policy, tmp_path):
    """One step per replica: ``kill -9`` of one of two generators at step 5 ends that
    step alone; the batch script starts it again as a new step (``--executor_retries``),
    the run finishes every step, and ``torchx status`` says SUCCEEDED naming the lost
    replica and how it was lost."""
    steps = 10
    handle = submit(tiny_policy, tmp_path, steps=steps)
    trainer_log = tmp_path / f"slurm-{app_id(handle)}-trainer-0.out"
    wait_for_text(trainer_log, f"step 5/{steps}")
    os.kill(role_process(handle, "llamarl.app.roles.generator", 1), signal.SIGKILL)
    assert wait_state(handle, tmp_path) == AppState.SUCCEEDED, logs(tmp_path, handle)

    status = torchx("status", handle).stdout
    assert "generator-1 killed by SIGKILL" in status and "restarted" in status, status
    assert "trainer[0]:SUCCEEDED" in status, status
    db = sqlite3.connect(tmp_path / "runs" / app_id(handle) / "metrics.db")
    steps_done = {s for (s,) in db.execute("SELECT DISTINCT step FROM scalars WHERE role = 'trainer'")}
    assert steps_done == set(range(steps + 1))
    batch = (tmp_path / f"slurm-{app_id(handle)}.out").read_text()
    assert "generator-1 lost (srun exit code" in batch and "restarting it as a new step" in batch, batch
    # The restart appends to the log (whether it rejoins before the run ends depends on
    # how fast it starts): the first generator's lines are kept.
    assert "generator/1 INFO generator 1 on" in (tmp_path / f"slurm-{app_id(handle)}-generator-1.out").read_text()
    wait_no_processes(handle)


def test_a_time_limit_saves_a_checkpoint_and_resume_continues_from_it(tiny_policy, tmp_path):
    """A 1-minute time limit: SLURM sends the batch script SIGUSR1 ahead of it
    (--save_before_time_limit_s), the script asks the trainer for a checkpoint, which it
    saves at the end of its step, without --save-every; the job ends TIMEOUT, named
    as such, with no traceback; --resume continues from that step."""
    replicas = ("--num_generators", "1", "--num_reward", "0")
    # More steps than any machine trains in the limit (500 took under a minute on a quiet one).
    handle = submit(tiny_policy, tmp_path, steps=100_000, extra=LONG, replicas=replicas, cfg=("-cfg", f"time={TIME_LIMIT_MIN}"),
                    options=("--save_before_time_limit_s", "30"))
    run = app_id(handle)
    assert wait_state(handle, tmp_path) == AppState.FAILED
    assert "TIMEOUT; the job reached its time limit" in torchx("status", handle).stdout
    trainer_log = (tmp_path / f"slurm-{run}-trainer-0.out").read_text(errors="replace")
    assert "a checkpoint was asked for (SLURM: the job's time limit is near): saving one at step" in trainer_log, \
        trainer_log[-3000:]
    assert "Traceback" not in trainer_log and "Logging error" not in trainer_log, trainer_log[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "runs" / run / "checkpoints").glob("step-*"))
    assert saved, "a checkpoint was saved on SIGUSR1"
    wait_no_processes(handle)

    resumed = submit(tiny_policy, tmp_path, steps=saved[-1] + 2, replicas=replicas, options=("--resume", run))
    assert wait_state(resumed, tmp_path) == AppState.SUCCEEDED, logs(tmp_path, resumed)
    log = (tmp_path / f"slurm-{app_id(resumed)}-trainer-0.out").read_text(errors="replace")
    assert f"resuming run {run} at step {saved[-1]}" in log, log[-3000:]
