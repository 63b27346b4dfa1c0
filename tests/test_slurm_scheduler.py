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

from llamarl.components.slurm_scheduler import (SECRET_FILE_ENV, SbatchError, LlamarlSlurmScheduler, describe_from_sacct)

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


def test_without_sbatch_the_submit_says_slurm_is_missing(tmp_path, monkeypatch):
    info = dryrun("--image", str(tmp_path), "--env", f"LLAMARL_SECRET={SECRET}")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    with pytest.raises(SbatchError, match="sbatch is not on PATH"):
        LlamarlSlurmScheduler("test").schedule(info)
    assert not (tmp_path / ".llamarl").exists(), "no secret file is left for a job never submitted"


# sacct --parsable2 --format=JobID,JobName,State,ExitCode, as Slurm 22.05 wrote it for
# llamarl apps on deploy/slurm/local-cluster.sh.
HEADER = "JobID|JobName|State|ExitCode\n"
CANCELLED = HEADER + """\
41+0|trainer-0|CANCELLED by 0|0:0
41+0.batch|batch|CANCELLED|0:15
41+0.0|env|FAILED|1:0
41+1|generator-0|CANCELLED by 0|0:0
41+1.0|env|CANCELLED|0:15
"""
ONE_ROLE_FAILED = HEADER + """\
42+0|trainer-0|FAILED|15:0
42+0.batch|batch|FAILED|15:0
42+0.0|env|FAILED|1:0
42+1|generator-0|FAILED|15:0
42+1.0|env|CANCELLED|0:15
42+2|generator-1|FAILED|15:0
42+2.0|env|CANCELLED|0:15
"""


def test_describe_knows_cancelled_by_a_user():
    desc = describe_from_sacct("41", CANCELLED)
    assert desc.state == AppState.CANCELLED and desc.msg == "CANCELLED by 0"
    # torchrun exits 1 on the cancel's SIGTERM: that is no failure of the trainer's.
    assert {r.state for s in desc.roles_statuses for r in s.replicas} == {AppState.CANCELLED}
    assert {r.name: r.num_replicas for r in desc.roles} == {"trainer": 1, "generator": 1}


def test_describe_names_the_replica_that_failed():
    desc = describe_from_sacct("42", ONE_ROLE_FAILED)
    assert desc.state == AppState.FAILED
    assert desc.msg == "FAILED; trainer-0 exited with code 1"
    states = {(s.role, r.id): r.state for s in desc.roles_statuses for r in s.replicas}
    assert states == {("trainer", 0): AppState.FAILED, ("generator", 0): AppState.FAILED,
                      ("generator", 1): AppState.FAILED}


def test_describe_of_an_unknown_job_is_none():
    assert describe_from_sacct("43", CANCELLED) is None
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
