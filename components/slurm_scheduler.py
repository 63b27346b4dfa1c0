"""``slurm_llamarl``: torchx 0.7.0's SlurmScheduler, with what a
user of docs/slurm.md's commands would otherwise trip over worked around.

Registered under its own name in the ``torchx.schedulers`` entry-point group
(pyproject.toml; torchx's ``slurm`` stays as it is), so ``torchx run -s slurm_llamarl``, ``torchx status``, ``torchx log`` and
``torchx cancel`` all go through it. Each change below says which torchx 0.7.0 behaviour
it works around:

- the job runs in the ``--image`` directory (``sbatch --chdir``): torchx runs it in the
  submit directory and ignores the image;
- the run's secret reaches the roles in a 0600 file, ``$LLAMARL_SECRET_FILE``: torchx puts
  every role env variable on the srun command line of a batch script run under
  ``set -x``, so the secret would be in ``slurm-<id>.out`` and in ``ps``;
- the roles find the Python (and its ``torchrun``) that submitted them: torchx relies on
  the submit shell's ``PATH``, which has no virtualenv when ``torchx`` is called by path;
- each replica writes stdout and stderr to one ``slurm-<id>-<role>-<k>.out``, found
  through the job's working directory in sacct: torchx splits them, ``torchx log``
  reads stderr by default and looks only in the current directory;
- ``describe`` knows ``CANCELLED by <uid>`` and names the replica that failed: torchx
  asserts on the former and gives every replica the job's state;
- sbatch's refusal is an error message, not a ``CalledProcessError`` traceback;
- a dry run asks sinfo about memory only where a SLURM configuration file is: torchx
  always asks, and sinfo takes seconds to fail where no cluster is configured.
"""

import csv
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Iterable, List, Optional

from torchx.schedulers.api import AppDryRunInfo, DescribeAppResponse, Stream, filter_regex, split_lines_iterator
from torchx.schedulers.local_scheduler import LogIterator
from torchx.schedulers.slurm_scheduler import SLURM_STATES, SlurmBatchRequest, SlurmOpts, SlurmScheduler
from torchx.specs import AppDef, AppState, ReplicaStatus, Role, RoleStatus
from torchx.specs.finder import ComponentValidationException

from llamarl.components.dryrun import SECRET_ENV, hide_secret

SECRET_FILE_ENV = SECRET_ENV + "_FILE"
SECRETS_DIR = os.path.join(".llamarl", "secrets")


class SbatchError(ComponentValidationException):
    """sbatch refused the job. A ComponentValidationException because torchx 0.7.0's
    ``torchx run`` prints those as a message and exits 1 (anything else: a traceback)."""


@dataclass(repr=False)  # keeps SlurmBatchRequest's repr: the script, never the secrets
class SecretBatchRequest(SlurmBatchRequest):
    """A batch request and the secret files ``schedule`` writes before it submits."""

    secret_files: Dict[str, str] = field(default_factory=dict)


class LlamarlSlurmScheduler(SlurmScheduler):
    """torchx 0.7.0's SlurmScheduler with the workarounds in this module's docstring."""

    def _submit_dryrun(self, app: AppDef, cfg: SlurmOpts) -> AppDryRunInfo[SecretBatchRequest]:
        base = super()._submit_dryrun(app, cfg).request
        workdir = cfg.get("job_dir") or _image_dir(app)
        cmd = list(base.cmd)
        if workdir and not cfg.get("job_dir"):  # with job_dir torchx adds its own --chdir
            cmd.append(f"--chdir={workdir}")
        workdir = os.path.abspath(workdir or os.getcwd())
        path_env = f"PATH={os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        secret_files: Dict[str, str] = {}
        for replica in base.replicas.values():
            secret = replica.env.pop(SECRET_ENV, None)
            if secret is not None:
                # One file per secret (an app has one): the roles of the app share it.
                path = next((p for p, s in secret_files.items() if s == secret), None)
                if path is None:
                    path = os.path.join(workdir, SECRETS_DIR, secrets.token_hex(8))
                    secret_files[path] = secret
                replica.env[SECRET_FILE_ENV] = path
            # `env PATH=... <entrypoint>`: the submitting Python's bin directory first.
            replica.args = [path_env, replica.entrypoint, *replica.args]
            replica.entrypoint = "env"
            # One log per replica, stdout and stderr together, in the job's directory.
            replica.srun_opts.pop("error", None)
        req = SecretBatchRequest(cmd=cmd, replicas=base.replicas, job_dir=base.job_dir,
                                 max_retries=base.max_retries, secret_files=secret_files)
        return hide_secret(app, AppDryRunInfo(req, repr))

    def _partition_memmb(self, partition: Optional[str]) -> Optional[int]:
        # torchx 0.7.0 asks sinfo for the partition's memory on every dry run. Where SLURM
        # is installed but no cluster is configured, sinfo looks for one in DNS and fails
        # only after seconds (a minute when $SLURM_CONF names no file): ask only where a
        # configuration file is. Without an answer torchx requests memory, its default.
        if not os.path.isfile(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")):
            return None
        return super()._partition_memmb(partition)

    def schedule(self, dryrun_info: AppDryRunInfo[SecretBatchRequest]) -> str:
        req = dryrun_info.request
        if shutil.which("sbatch") is None:
            raise SbatchError("sbatch is not on PATH: SLURM's client commands are not installed here "
                              "(deploy/slurm/local-cluster.sh up starts a cluster on this machine)")
        for path, secret in req.secret_files.items():
            _write_private(path, secret)
        try:
            return super().schedule(dryrun_info)
        except subprocess.CalledProcessError as e:
            for path in req.secret_files:
                os.remove(path)
            # torchx ran sbatch with stderr going to the terminal: it has said why already.
            raise SbatchError(f"sbatch refused the job (exit code {e.returncode}); its error is "
                              f"above. Check -cfg partition=... against `sinfo`.") from None

    def describe(self, app_id: str) -> Optional[DescribeAppResponse]:
        out = subprocess.run(["sacct", "--parsable2", "-j", app_id, "--format=JobID,JobName,State,ExitCode"],
                             capture_output=True, text=True, check=True).stdout
        return describe_from_sacct(app_id, out)

    def log_iter(self, app_id: str, role_name: str, k: int = 0, regex: Optional[str] = None,
                 since: Optional[datetime] = None, until: Optional[datetime] = None,
                 should_tail: bool = False, streams: Optional[Stream] = None) -> Iterable[str]:
        # Every stream is the one file: srun wrote stdout and stderr together.
        log_file = os.path.join(self._workdir(app_id), f"slurm-{app_id}-{role_name}-{k}.out")
        lines = split_lines_iterator(LogIterator(app_id, log_file, self, should_tail=should_tail))
        return filter_regex(regex, lines) if regex else lines

    def _workdir(self, app_id: str) -> str:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", app_id, "--format=WorkDir"],
                             capture_output=True, text=True, check=True).stdout.split()
        return out[0] if out else os.getcwd()


def create_scheduler(session_name: str, **kwargs: Any) -> LlamarlSlurmScheduler:
    return LlamarlSlurmScheduler(session_name=session_name)


def _image_dir(app: AppDef) -> Optional[str]:
    """The directory the roles' ``image`` names, None when it names none (a container
    image, as llamarl's and torchx's builtins' defaults are): then the job runs where it
    was submitted. An absolute path that is no directory is a mistake, refused."""
    images = {role.image for role in app.roles}
    if len(images) != 1:
        raise ComponentValidationException(
            f"the roles name different images {sorted(images)}: a SLURM job runs in one directory")
    (image,) = images
    if os.path.isdir(image):
        return os.path.abspath(image)
    if os.path.isabs(image):
        raise ComponentValidationException(
            f"--image {image} is not a directory: on SLURM the image is the directory holding "
            f"the code (a path every node shares)")
    return None


def _write_private(path: str, text: str) -> None:
    """``text`` in a new file only its owner can read, in directories only they can enter."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def describe_from_sacct(app_id: str, sacct_out: str) -> Optional[DescribeAppResponse]:
    """The app's state from ``sacct --parsable2 --format=JobID,JobName,State,ExitCode``.

    A heterogeneous job has a row per component (``<id>+<k>``, named ``<role>-<replica>``
    by torchx; a one-replica app is a plain ``<id>``) and a row per step of each
    (``<id>+<k>.0`` is the replica's srun step). Every component carries the job's state;
    in a failed job, the replica whose step exited with a code of its own (not killed by a
    signal, as srun's --kill-on-bad-exit ends the others) is the one that failed.
    """
    rows = list(csv.DictReader(sacct_out.splitlines(), delimiter="|"))
    components: Dict[str, Dict[str, str]] = {}
    failed_steps: Dict[str, str] = {}  # component id -> exit code
    for row in rows:
        job_id = row["JobID"]
        if job_id.split("+")[0].split(".")[0] != app_id:
            continue
        component, _, step = job_id.partition(".")
        if not step:
            components[component] = row
        elif step.isdigit():
            code, _, signal = row["ExitCode"].partition(":")
            if code not in ("", "0") and signal in ("", "0"):
                failed_steps[component] = code
    if not components:
        return None
    leader = components.get(f"{app_id}+0") or next(iter(components.values()))
    state_text = leader["State"]
    # sacct says "CANCELLED by <uid>": torchx 0.7.0 knows only the first word.
    app_state = SLURM_STATES.get(state_text.split(" ")[0], AppState.UNKNOWN)
    roles: Dict[str, Role] = {}
    statuses: Dict[str, RoleStatus] = {}
    failures: List[str] = []
    for component, row in components.items():
        role, _, replica = row["JobName"].rpartition("-")
        if not role or not replica.isdigit():
            continue  # sacct fills in the name a moment after the submit
        state = app_state
        # After a cancel, roles that exit non-zero on SIGTERM (torchrun does) failed nobody.
        if component in failed_steps and app_state == AppState.FAILED:
            state = AppState.FAILED
            failures.append(f"{row['JobName']} exited with code {failed_steps[component]}")
        if role not in roles:
            roles[role] = Role(name=role, image="", num_replicas=0)
            statuses[role] = RoleStatus(role, [])
        roles[role].num_replicas += 1
        statuses[role].replicas.append(ReplicaStatus(id=int(replica), role=role, state=state, hostname=""))
    msg = "; ".join([state_text, *failures])
    return DescribeAppResponse(app_id=app_id, roles=list(roles.values()), roles_statuses=list(statuses.values()),
                               state=app_state, msg=msg)
