"""llamarl's ``slurm`` TorchX scheduler without a cluster: the batch script it would submit
(dry runs), its reading of sacct's answers, and what it says when SLURM is not there.
The same scheduler against a real cluster: tests/test_slurm_cluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.schedulers import get_scheduler_factories
from torchx.specs import AppState
from torchx.specs.finder import ComponentValidationException

from llamarl.components.slurm_scheduler import (REPOSITORY, SECRET_FILE_ENV, SbatchError, LlamarlSlurmScheduler,
                                                describe_from_sacct, pending_message)

ARGS = ["--num_reward", "1", "--num_generators", "2", "--store_port", "31234"]


def dryrun(*extra: str, cfg: dict | None = None):
    return get_runner().dryrun_component("llamarl.llamarl", [*ARGS, *extra], scheduler="slurm_llamarl",
                                         cfg={"partition": "debug", **(cfg or {})})


def test_llamarls_schedulers_have_names_of_their_own_and_torchx_keeps_its_own():
    """Installing llamarl adds ``local_llamarl``, ``slurm_llamarl`` and
    ``kubernetes_llamarl``; torchx's ``local_cwd``, ``slurm``, ``kubernetes``, ... stay
    torchx's for every other project in the environment."""
    from torchx.schedulers.local_scheduler import LocalScheduler
    from torchx.schedulers.slurm_scheduler import SlurmScheduler
    from torchx.schedulers import DEFAULT_SCHEDULER_MODULES

    factories = get_scheduler_factories()
    assert isinstance(factories["slurm_llamarl"]("test"), LlamarlSlurmScheduler)
    assert type(factories["slurm"]("test")) is SlurmScheduler
    local = factories["local_cwd"]("test")
    assert type(local) is LocalScheduler
    local.close()
    assert set(DEFAULT_SCHEDULER_MODULES) <= set(factories), "every scheduler of torchx's own list stays"


SECRET = "ab" * 32


def test_the_roles_read_the_secret_from_a_file_in_the_job_directory():
    """The component names a file in the job's own directory (a relative path), which the
    first role makes (mode 600 in a 700 directory); the batch script, run under
    ``set -x``, holds its path only."""
    req = dryrun().request
    assert req.secret_files == {}
    script = req.materialize()
    assert script.count(f'{SECRET_FILE_ENV}=.llamarl/secrets/"$SLURM_JOB_ID"') == 4, "one file, every replica"
    assert "LLAMARL_SECRET=" not in script


def test_a_secret_given_in_the_environment_still_reaches_the_roles_in_a_file():
    info = dryrun("--env", f"LLAMARL_SECRET={SECRET}")
    req = info.request
    ((path, secret),) = req.secret_files.items()
    assert secret == SECRET
    script = req.materialize()
    assert secret not in script and secret not in repr(req), "the batch script runs under set -x"
    assert script.count(f"{SECRET_FILE_ENV}={path}") == 4, "every replica reads the same file"
    assert "LLAMARL_SECRET=" not in script
    assert Path(path).parent == Path.cwd() / ".llamarl" / "secrets"
    assert not Path(path).exists(), "a dry run writes nothing"


def test_the_job_runs_in_the_image_directory(tmp_path):
    req = dryrun("--image", str(tmp_path), "--env", f"LLAMARL_SECRET={SECRET}").request
    assert f"--chdir={tmp_path}" in req.cmd
    (path,) = req.secret_files
    assert Path(path).parent == tmp_path / ".llamarl" / "secrets"
    # Without an image directory (the component's default names a container image) the
    # job runs where it is submitted, as torchx's own scheduler does.
    assert not any(a.startswith("--chdir") for a in dryrun().request.cmd)


def test_an_image_path_that_is_no_directory_is_refused(tmp_path):
    with pytest.raises(ComponentValidationException, match="is not a directory"):
        dryrun("--image", str(tmp_path / "missing"))


def test_torchx_own_components_keep_running_where_submitted():
    """utils.echo's image is a container name (ghcr.io/...): no directory, no refusal."""
    info = get_runner().dryrun_component("utils.echo", ["--msg", "hi"], scheduler="slurm_llamarl", cfg={})
    assert not any(a.startswith("--chdir") for a in info.request.cmd)
    assert info.request.secret_files == {}


def test_each_replica_runs_with_the_submitting_python_first_on_path():
    req = dryrun().request
    for name, replica in req.replicas.items():
        assert replica.entrypoint == "env", name
        assert replica.args[0].startswith(f"PATH={os.path.dirname(sys.executable)}:"), name
        assert replica.args[1:3] == ["bash", "-c"], name


def test_each_replica_logs_stdout_and_stderr_to_one_file():
    script = dryrun().request.materialize()
    for name in ("trainer-0", "generator-0", "generator-1", "reward-0"):
        assert f'--output=slurm-"$SLURM_JOB_ID"-{name}.out' in script
    assert "--error=" not in script


def test_each_replica_is_a_step_of_its_own_and_the_trainer_holds_the_job():
    """No heterogeneous srun with --kill-on-bad-exit (a lost generator ended every
    component): a step per replica on its component, restarts for the executors only
    (--executor_retries), the job's requeues the trainer's (--max_retries)."""
    req = dryrun("--executor_retries", "2", "--max_retries", "1").request
    script = req.materialize()
    assert "--kill-on-bad-exit" not in script and "--wait=" not in script
    for k, name in enumerate(["trainer-0", "generator-0", "generator-1", "reward-0"]):
        line = next(line for line in script.splitlines() if line.startswith(f"start_{k}() {{ srun "))
        assert f"--het-group={k} " in line and f"-{name}.out" in line and "--open-mode=append" in line, line
    assert "holders=(0)" in script and "declare -A left=([0]=0 [1]=2 [2]=2 [3]=2)" in script
    assert "TORCHX_MAX_RETRIES=1" in script
    # SIGUSR1 ahead of the time limit to the batch shell, which passes it to the trainer alone.
    assert req.replicas["trainer-0"].sbatch_opts["signal"] == "B:USR1@90"
    assert all("signal" not in r.sbatch_opts for name, r in req.replicas.items() if name != "trainer-0")
    assert "trap save_soon USR1" in script and 'export LLAMARL_SAVE_REQUEST="$PWD/.llamarl/save-request-' in script
    assert "signal" not in dryrun("--save_before_time_limit_s", "0").request.replicas["trainer-0"].sbatch_opts
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0, "valid bash"


def test_without_sbatch_the_submit_says_slurm_is_missing(tmp_path, monkeypatch):
    info = dryrun("--image", str(tmp_path), "--env", f"LLAMARL_SECRET={SECRET}")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    with pytest.raises(SbatchError, match="sbatch is not on PATH"):
        LlamarlSlurmScheduler("test").schedule(info)
    assert not (tmp_path / ".llamarl").exists(), "no secret file is left for a job never submitted"


# sacct --parsable2 --format=JobID,JobName,State,ExitCode,End, as Slurm 22.05 wrote it for
# llamarl apps on deploy/slurm/local-cluster.sh (one srun step per replica), recorded in
# tests/data/sacct/: a cancelled job (41); kill -9 of generator-1 at step 5, its step ended
# alone, the batch script started it again, the trainer finished, and the restart, too late
# to rejoin, was ended with the job (45); the last generator killed, the trainer failing on
# it a few seconds later and the job's end stopping the reward executor (42); a time limit
# after a component was cancelled (44).
SACCT = Path(__file__).resolve().parent / "data" / "sacct"
HEADER = "JobID|JobName|State|ExitCode|End\n"


def sacct(name: str) -> str:
    return (SACCT / f"{name}.txt").read_text()


def replica_states(desc):
    return {(s.role, r.id): r.state for s in desc.roles_statuses for r in s.replicas}


def test_describe_knows_cancelled_by_a_user():
    desc = describe_from_sacct("41", sacct("cancelled"))
    assert desc.state == AppState.CANCELLED and desc.msg == "CANCELLED by 0; the job was cancelled"
    # The replicas were stopped (SIGTERM; the trainer's launcher ends by it): nobody failed.
    assert set(replica_states(desc).values()) == {AppState.CANCELLED}
    assert {r.name: r.num_replicas for r in desc.roles} == {"trainer": 1, "generator": 1}


def test_a_lost_and_restarted_generator_is_named_in_a_run_that_succeeded():
    desc = describe_from_sacct("45", sacct("killed_and_restarted"))
    assert desc.state == AppState.SUCCEEDED
    assert desc.msg == ("COMPLETED; the trainer finished the run; lost on the way and survived: "
                        "generator-1 killed by SIGKILL (restarted)")
    assert set(replica_states(desc).values()) == {AppState.SUCCEEDED}


def test_describe_names_the_replica_lost_first_not_the_trainer_it_stopped():
    desc = describe_from_sacct("42", sacct("trainer_failed_after_a_loss"))
    assert desc.state == AppState.FAILED
    assert desc.msg == "FAILED; lost first: generator-0 killed by SIGKILL; then: trainer-0 exited with code 1"
    assert replica_states(desc) == {("trainer", 0): AppState.FAILED, ("generator", 0): AppState.FAILED,
                                    ("reward", 0): AppState.FAILED}


def test_a_time_limit_is_the_cause_and_a_cancelled_component_before_it_is_named():
    desc = describe_from_sacct("44", sacct("timeout"))
    assert desc.state == AppState.FAILED
    assert desc.msg == ("TIMEOUT; the job reached its time limit; lost before: "
                        "generator-1 cancelled (CANCELLED by 0: scancel of its component)")
    assert replica_states(desc)[("generator", 1)] == AppState.FAILED


def test_a_pending_app_says_why_from_squeue():
    assert pending_message("PENDING", ["None", "None"], 2) == "PENDING"
    msg = pending_message("PENDING", ["PartitionNodeLimit"] * 5, 5)
    assert msg.startswith("PENDING; waiting: PartitionNodeLimit (the app needs 5 nodes, one per replica;"), msg
    msg = pending_message("PENDING", ["Resources"] * 5, 5, nodes=4)
    assert msg.startswith("PENDING; waiting: Resources (the app needs 5 nodes, one per replica, and the partition "
                          "has 4: it cannot start;"), msg


def test_a_submit_from_outside_the_repository_without_an_image_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    dryrun()
    assert f"the job runs in the submit directory {tmp_path}, not in the repository {REPOSITORY}" in caplog.text
    assert "trains a warm start there" in caplog.text and f"--image {REPOSITORY}" in caplog.text
    assert "the default policy is converted there" in caplog.text
    caplog.clear()
    dryrun("--image", str(tmp_path))
    monkeypatch.chdir(REPOSITORY)
    dryrun()
    assert "no --image" not in caplog.text


def test_describe_of_an_unknown_job_is_none():
    assert describe_from_sacct("43", sacct("cancelled")) is None
    assert describe_from_sacct("43", HEADER) is None


def test_the_local_clusters_daemons_start_without_the_callers_descriptors(tmp_path):
    """deploy/slurm/local-cluster.sh starts every daemon through ``detached``: a lock or pipe
    the caller holds around ``up`` (descriptor 7 here) is not inherited, so it is released
    when the caller lets go, not at ``down``."""
    script = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "local-cluster.sh"
    text = script.read_text()
    function = text[text.index("detached() {"):text.index("\n}\n", text.index("detached() {")) + 3]
    started = ["munged", "mariadbd", "slurmdbd -D", "slurmctld -D", "slurmd -D"]
    for daemon in started:
        line = next(line for line in text.splitlines() if daemon in line and ">>" in line)
        assert line.strip().startswith("detached "), line
    probe = (f"{function}\nexec 7>{tmp_path / 'held'}\ndetached sleep 30 >/dev/null 2>&1\n"
             "pid=$!\nfor _ in $(seq 100); do [ \"$(cat /proc/$pid/comm)\" = sleep ] && break; sleep 0.05; done\n"
             "ls /proc/$pid/fd; kill $pid\n")
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["0", "1", "2"], done.stdout
