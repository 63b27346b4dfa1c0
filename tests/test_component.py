"""The TorchX component ``llamarl.llamarl``: its AppDef, its specs for each scheduler
(dry runs only), its registration beside torchx's builtins, and the repo's .torchxconfig."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torchx.specs as specs
from torchx.specs.finder import ComponentValidationException
from torchx.runner import get_runner
from torchx.specs.file_linter import validate

import llamarl.components.llamarl as component_module
from llamarl.components.llamarl import llamarl

REPO = Path(__file__).resolve().parents[1]
PORT = 31234

# `torchx` CLI calls, run once for the module and concurrently (each imports torchx).
# The CLI treats the cwd as a workspace to build into an image for kubernetes (which
# needs a docker daemon); `--workspace ""` asks for the spec alone.
CLI_CALLS = {
    "builtins": ["builtins"],
    "default": ["run", "--dryrun"],  # everything from .torchxconfig
    "slurm": ["run", "--dryrun", "-s", "slurm_llamarl", "llamarl.llamarl", "--num_reward", "1", "--num_generators", "2",
              "--store_port", str(PORT)],
    "kubernetes": ["run", "--dryrun", "--workspace", "", "-s", "kubernetes_llamarl", "llamarl.llamarl",
                   "--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT),
                   "--k8s_secret", "llamarl-run"],
}
# A secret given on the command line (`--env LLAMARL_SECRET=<hex>`), dry-run on each scheduler.
ENV_SECRET = "5ec7e7" * 10
for _scheduler, _cfg in [("local_llamarl", []), ("slurm_llamarl", []), ("kubernetes_llamarl", ["-cfg", "queue=default"])]:
    CLI_CALLS[f"secret-{_scheduler}"] = ["run", "--dryrun", "--workspace", "", "-s", _scheduler, *_cfg, "llamarl.llamarl",
                                         "--image", str(REPO), "--env", f"LLAMARL_SECRET={ENV_SECRET}"]


@pytest.fixture(scope="module")
def cli() -> dict[str, subprocess.CompletedProcess]:
    def call(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torchx.cli.main", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(len(CLI_CALLS)) as pool:
        done = dict(zip(CLI_CALLS, pool.map(call, CLI_CALLS.values())))
    for name, proc in done.items():
        assert proc.returncode == 0, f"torchx {' '.join(CLI_CALLS[name])} failed:\n{proc.stderr[-3000:]}"
    return done


def roles(app: specs.AppDef) -> dict[str, specs.Role]:
    return {r.name: r for r in app.roles}


# --------------------------------------------------------------------------- the AppDef

def test_appdef_has_trainer_first_then_generators_and_reward():
    app = llamarl("--lr", "3e-4", num_generators=3, num_reward=2, nproc_per_node=2, steps=7,
                  max_staleness=0, store_port=PORT)
    assert [r.name for r in app.roles] == ["trainer", "generator", "reward"]
    trainer, generator, reward = app.roles
    assert trainer.num_replicas == 1 and generator.num_replicas == 3 and reward.num_replicas == 2
    cmd = trainer.args[-1]
    assert "-m llamarl.app.roles.launch --nproc-per-node 2" in cmd, "llamarl.app.roles.launch runs torchrun and names a failure's cause"
    for flag in ("--num-generators 3", "--num-reward 2", "--steps 7", "--max-staleness 0",
                 f"--store-port {PORT}", f"--run-id {specs.macros.app_id}", f"--app-id {specs.macros.app_id}"):
        assert flag in cmd
    assert cmd.endswith("--lr 3e-4"), "trainer_args are passed through last"
    assert trainer.port_map == {"store": PORT, "c10d": PORT + 1}, "the store, and a multi-node trainer's rendezvous"
    assert "-m llamarl.app.roles.generator" in generator.args[-1] and "--num-generators 3" in generator.args[-1]
    assert f"--replica {specs.macros.replica_id}" in generator.args[-1]
    assert "-m llamarl.app.roles.reward" in reward.args[-1]
    for role in (generator, reward):
        assert f"--app-id {specs.macros.app_id}" in role.args[-1], "every role checks its store's app"


def test_max_staleness_takes_auto_and_refuses_other_words():
    assert "--max-staleness auto " in llamarl(max_staleness="auto").roles[0].args[-1]
    assert "--max-staleness 3 " in llamarl(max_staleness="3").roles[0].args[-1]
    with pytest.raises(ComponentValidationException, match="--max_staleness must be an int >= 0 or 'auto', got 'often'"):
        llamarl(max_staleness="often")


def _trainer_config(app: specs.AppDef):
    """The trainer's and generators' configs as the trainer parses the app's command line
    (its flags from the first trainer flag after the launcher's own on)."""
    import shlex

    from llamarl.app import cli
    from llamarl.app.config import GeneratorConfig, TrainerConfig

    cmd = roles(app)["trainer"].args[-1].replace(specs.macros.app_id, "app")
    tokens = shlex.split(cmd)
    return cli.parse(tokens[tokens.index("--steps"):], TrainerConfig, GeneratorConfig)


def test_the_default_job_is_the_real_model_with_its_flags_and_tiny_gets_none():
    """``torchx run`` with no options trains SmolLM2-135M-Instruct for 15 steps on the
    shipped GSM8K-format sample with its chat template, the shipped system prompt (newlines
    and all, through bash) and bf16, evaluated at the start and the end; the user's trainer
    flags and --dataset override the job's; ``--policy tiny`` gets none of them."""
    cfg, gen = _trainer_config(llamarl())
    assert (cfg.policy, cfg.dataset, cfg.chat_template) == ("smollm2-135m-instruct", "gsm8k-sample", True)
    assert cfg.system_prompt == component_module.DEFAULT_SYSTEM_PROMPT.replace("\\n", "\n")
    assert "\n#### 12" in cfg.system_prompt and gen.max_new_tokens == component_module.DEFAULT_MAX_NEW_TOKENS
    assert (gen.temperature, cfg.steps, cfg.eval_every, cfg.eval_size) == (0.7, 15, 15, 100)
    assert (cfg.train_precision, gen.gen_precision) == ("bf16", "bf16")
    cfg, gen = _trainer_config(llamarl("--lr", "1e-6", "--no-chat-template", "--system-prompt", "",
                                       "--train-precision", "fp32", dataset="mine.jsonl"))
    assert (cfg.lr, cfg.chat_template, cfg.dataset, cfg.train_precision) == (1e-6, False, "mine.jsonl", "fp32")
    cfg, gen = _trainer_config(llamarl(policy="tiny", steps=30))
    assert (cfg.policy, cfg.dataset, cfg.chat_template, gen.max_new_tokens) == ("tiny", "", False, 48)
    assert (cfg.steps, cfg.train_precision, gen.gen_precision) == (30, "auto", "fp32")


def test_default_store_port_is_derived_by_each_role_from_the_app_id():
    app = llamarl(num_reward=1)
    assert "--store-port 0 " in app.roles[0].args[-1]
    assert app.roles[0].port_map == {}, "no fixed port to map (kubernetes needs --store_port)"
    for role in app.roles[1:]:
        assert f"--store-addr $${{{specs.macros.rank0_env}}}:0 " in role.args[-1]


def test_dataset_option_reaches_the_trainer_quoted():
    path = "/data/my gsm8k/train.jsonl"
    cmd = llamarl("--answer-format", "gsm8k", dataset=path).roles[0].args[-1]
    assert "--dataset '/data/my gsm8k/train.jsonl' --answer-format gsm8k" in cmd
    assert "--dataset gsm8k-sample" in llamarl().roles[0].args[-1]  # the default real-model job's sample
    assert "--dataset" not in llamarl(policy="tiny").roles[0].args[-1]  # empty, the tiny policy: the built-in task
    assert "--dataset" not in llamarl(dataset=path).roles[1].args[-1]  # generators read the trainer's


def test_trainer_args_survive_bash_whole():
    prompt = r"Solve it. Put the answer in \boxed{}, then stop; it's $5?"
    cmd = llamarl("--chat-template", "--system-prompt", prompt, policy="tiny").roles[0].args[-1]
    echoed = subprocess.run(["bash", "-c", "printf '%s\\n' " + cmd.split("--gen-threads 1 ", 1)[1]],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert echoed == ["--chat-template", "--system-prompt", prompt]


def test_no_reward_role_when_scoring_inline():
    app = llamarl(num_generators=1, num_reward=0)
    assert [r.name for r in app.roles] == ["trainer", "generator"]
    assert "--num-reward 0" in app.roles[0].args[-1]


def test_other_roles_reach_the_store_through_the_rank0_macro():
    app = llamarl(num_reward=1, store_port=PORT)
    for role in app.roles[1:]:
        # `$$` escapes the first `$` from torchx's own substitution: `${<rank0_env>}` remains
        # for the shell, with the variable that names replica 0's host on each scheduler.
        assert f"--store-addr $${{{specs.macros.rank0_env}}}:{PORT}" in role.args[-1]


def test_the_secret_is_never_in_the_appdef_only_the_path_of_its_file():
    """A dry run, a job spec and ``ps`` show the AppDef to others: it names the file the
    roles read the secret from (made by the first role, per app), never the secret."""
    default = llamarl(num_reward=1)
    paths = {r.env["LLAMARL_SECRET_FILE"] for r in default.roles}
    assert paths == {f".llamarl/secrets/{specs.macros.app_id}"}, "one file per app, every role"
    assert all("LLAMARL_SECRET" not in r.env for r in default.roles)
    given = llamarl(num_reward=1, secret_file="/home/me/.llamarl/run.secret")
    assert {r.env["LLAMARL_SECRET_FILE"] for r in given.roles} == {"/home/me/.llamarl/run.secret"}
    k8s = llamarl(num_reward=1, k8s_secret="llamarl-run", secret_file="/ignored")
    assert {r.env["LLAMARL_SECRET_FILE"] for r in k8s.roles} == {"/etc/llamarl/secret/secret"}
    assert {r.metadata["llamarl/k8s_secret"] for r in k8s.roles} == {"llamarl-run"}


@pytest.mark.parametrize("scheduler", ["local_llamarl", "slurm_llamarl", "kubernetes_llamarl"])
def test_a_dry_run_never_prints_a_secret_given_on_the_command_line(cli, scheduler):
    out = cli[f"secret-{scheduler}"].stdout + cli[f"secret-{scheduler}"].stderr
    assert "=== SCHEDULER REQUEST ===" in out
    assert ENV_SECRET not in out
    assert "<hidden: the app's secret>" in out


def test_a_real_run_still_hands_the_secret_to_its_roles():
    """Hiding it from the dry run's print leaves the request the roles start from whole."""
    args = ["--num_generators", "1", "--store_port", str(PORT), "--env", f"LLAMARL_SECRET={ENV_SECRET}"]
    local = get_runner().dryrun_component("llamarl.llamarl", args, scheduler="local_llamarl", cfg={})
    assert ENV_SECRET not in str(local) and ENV_SECRET in repr(local.request)
    k8s = get_runner().dryrun_component("llamarl.llamarl", [*args, "--image", "x:y"], scheduler="kubernetes_llamarl",
                                        cfg={"queue": "default"})
    assert ENV_SECRET not in str(k8s) and ENV_SECRET in repr(k8s.request.resource)
    slurm = get_runner().dryrun_component("llamarl.llamarl", args, scheduler="slurm_llamarl", cfg={})
    assert ENV_SECRET not in str(slurm) and list(slurm.request.secret_files.values()) == [ENV_SECRET]


def test_the_store_listens_where_the_other_roles_are_told_to_connect():
    trainer = llamarl(store_port=PORT).roles[0].args[-1]
    assert f"--store-port {PORT} --store-bind $${{LLAMARL_STORE_BIND:-$${{{specs.macros.rank0_env}:=localhost}}}}" \
        in trainer
    assert "--store-bind 0.0.0.0" in llamarl(store_bind="0.0.0.0").roles[0].args[-1]


def test_roles_do_not_share_their_env_dict():
    """Schedulers edit role.env in place (local_cwd prepends the cwd to PATH)."""
    app = llamarl(num_reward=1, env={"EXTRA": "1"})
    envs = [r.env for r in app.roles]
    assert len({id(e) for e in envs}) == len(envs)
    assert all(e["EXTRA"] == "1" for e in envs)


def test_the_default_scheduler_is_one_torchx_run_waits_for():
    """``torchx run`` (the README's first command) waits for the app only when the
    scheduler's name starts with ``local`` (torchx 0.7.0's cmd_run.py); otherwise it returns
    at once and its runner stops the app it started. So llamarl's local scheduler is
    ``local_llamarl``, and .torchxconfig names it."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / ".torchxconfig")
    assert config["cli:run"]["scheduler"] == "local_llamarl"
    assert config["cli:run"]["scheduler"].startswith("local")


def test_component_file_is_a_valid_torchx_component():
    path = component_module.__file__
    tree = ast.parse(Path(path).read_text())
    futures = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    # torchx reads the annotations to build the CLI; postponed (string) annotations break it.
    assert not futures, "components/llamarl.py must not use `from __future__ import annotations`"
    assert validate(path, "llamarl") == []


# --------------------------------------------------------------------------- scheduler specs

def test_slurm_dryrun_is_one_het_job_with_every_role():
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT)], scheduler="slurm_llamarl", cfg={})
    req = info.request
    assert list(req.replicas) == ["trainer-0", "generator-0", "generator-1", "reward-0"]
    script = req.materialize()
    assert script.count("#SBATCH hetjob") == 3, "one heterogeneous group per replica"
    gen = req.replicas["generator-1"]
    assert f"--store-addr ${{SLURM_JOB_NODELIST_HET_GROUP_0}}:{PORT}" in gen.args[-1]
    assert "--replica 1" in gen.args[-1]
    assert "--nproc-per-node 1" in req.replicas["trainer-0"].args[-1]
    assert "-m llamarl.app.roles.reward" in req.replicas["reward-0"].args[-1]


def test_kubernetes_dryrun_is_one_volcano_job_with_every_role():
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT)], scheduler="kubernetes_llamarl",
        cfg={"queue": "default"})
    job = info.request.resource
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh")
    tasks = {t["name"]: t["template"].spec.containers[0] for t in job["spec"]["tasks"]}
    assert list(tasks) == ["trainer-0", "generator-0", "generator-1", "reward-0"]
    assert f"--store-addr ${{VC_TRAINER_0_HOSTS}}:{PORT}" in tasks["generator-0"].command[-1]
    assert f"--store-addr ${{VC_TRAINER_0_HOSTS}}:{PORT}" in tasks["reward-0"].command[-1]
    assert [p.container_port for p in tasks["trainer-0"].ports] == [PORT, PORT + 1]
    assert all("LLAMARL_SECRET" not in {e.name for e in c.env} for c in tasks.values())
    assert {next(e.value for e in c.env if e.name == "LLAMARL_SECRET_FILE") for c in tasks.values()} == {
        f".llamarl/secrets/{job['metadata']['name']}"}


def test_kubernetes_dryrun_mounts_the_named_secret_in_every_pod():
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT),
                            "--k8s_secret", "llamarl-run"], scheduler="kubernetes_llamarl", cfg={"queue": "default"})
    pods = [t["template"] for t in info.request.resource["spec"]["tasks"]]
    assert len(pods) == 4
    for pod in pods:
        (volume,) = [v for v in pod.spec.volumes if v.secret is not None]
        assert volume.secret.secret_name == "llamarl-run" and volume.secret.default_mode == 0o400
        (container,) = pod.spec.containers
        (mount,) = [m for m in container.volume_mounts if m.name == volume.name]
        assert mount.mount_path == "/etc/llamarl/secret" and mount.read_only
        env = {e.name: e.value for e in container.env}
        assert env["LLAMARL_SECRET_FILE"] == "/etc/llamarl/secret/secret" and "LLAMARL_SECRET" not in env


def test_kubernetes_trainer_listens_on_its_pod_ip_not_on_localhost():
    """torchx names trainer-0's own host ``localhost`` to trainer-0: the store would listen
    on loopback; llamarl's scheduler gives every pod its IP, which the trainer prefers."""
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_generators", "1", "--store_port", str(PORT)], scheduler="kubernetes_llamarl",
        cfg={"queue": "default"})
    (trainer, *_) = [t["template"].spec.containers[0] for t in info.request.resource["spec"]["tasks"]]
    (pod_ip,) = [e for e in trainer.env if e.name == "LLAMARL_STORE_BIND"]
    assert pod_ip.value_from.field_ref.field_path == "status.podIP"
    assert "--store-bind ${LLAMARL_STORE_BIND:-${TORCHX_RANK0_HOST:=localhost}}" in trainer.command[-1]


def test_a_trainer_of_two_nodes_meets_at_replica_0_on_slurm_and_kubernetes():
    """trainer_nodes=2: two trainer replicas, replica k with node rank k of 2, both
    pointed at replica 0's host (the torchrun rendezvous and the control store)."""
    args = ["--trainer_nodes", "2", "--nproc_per_node", "2", "--store_port", str(PORT)]
    slurm = get_runner().dryrun_component("llamarl.llamarl", args, scheduler="slurm_llamarl", cfg={}).request
    assert list(slurm.replicas) == ["trainer-0", "trainer-1", "generator-0"]
    assert slurm.materialize().count("#SBATCH hetjob") == 2, "a node per trainer replica"
    for k in (0, 1):
        cmd = slurm.replicas[f"trainer-{k}"].args[-1]
        assert (f"-m llamarl.app.roles.launch --nproc-per-node 2 --nnodes 2 --node-rank {k} "
                "--rdzv-host ${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}") in cmd, cmd
    k8s = get_runner().dryrun_component("llamarl.llamarl", args, scheduler="kubernetes_llamarl",
                                        cfg={"queue": "default"}).request.resource
    tasks = {t["name"]: t["template"].spec.containers[0] for t in k8s["spec"]["tasks"]}
    assert list(tasks) == ["trainer-0", "trainer-1", "generator-0"]
    # torchx's kubernetes scheduler names replica 0's host for replica 0 itself
    # TORCHX_RANK0_HOST (localhost), for the others the Volcano task's host.
    assert "--node-rank 0 --rdzv-host ${TORCHX_RANK0_HOST:=localhost}" in tasks["trainer-0"].command[-1]
    assert "--node-rank 1 --rdzv-host ${VC_TRAINER_0_HOSTS:=localhost}" in tasks["trainer-1"].command[-1]
    for k in (0, 1):
        assert [p.container_port for p in tasks[f"trainer-{k}"].ports] == [PORT, PORT + 1]


def test_local_dryrun_resolves_the_rank0_host():
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT)], scheduler="local_llamarl",
        cfg={})
    params = info.request.role_params
    assert sorted(params) == ["generator", "reward", "trainer"] and len(params["generator"]) == 2
    for p in params["generator"] + params["reward"]:
        assert f"--store-addr ${{TORCHX_RANK0_HOST}}:{PORT}" in p.args[-1]
        assert p.env["TORCHX_RANK0_HOST"] == "localhost"


def test_on_local_cwd_every_role_runs_with_the_submitting_python_first_on_path():
    """components/local_scheduler.py: the roles start ``python -m ...`` by name, and find
    this interpreter first, activated virtualenv or not (the integration tests start their
    apps with nothing else on PATH: tests/app_launch.py)."""
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--num_reward", "1", "--num_generators", "2", "--store_port", str(PORT)],
        scheduler="local_llamarl", cfg={})
    replicas = [p for params in info.request.role_params.values() for p in params]
    assert len(replicas) == 4
    for p in replicas:
        assert p.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable), p.env["PATH"]


@pytest.mark.parametrize("options, error", [
    (["--num_generators", "0"], "--num_generators must be >= 1, got 0"),
    (["--num_reward", "-1", "--nproc_per_node", "0"], "--num_reward must be >= 0, got -1; --nproc_per_node must be >= 1"),
])
def test_counts_the_app_cannot_run_with_are_refused_while_the_job_is_built(options, error):
    """torchx's own check of a role of 0 replicas is a ValueError, which `torchx run`
    prints as a traceback; a ComponentValidationException it prints as one error."""
    with pytest.raises(ComponentValidationException, match=re.escape(error)):
        get_runner().dryrun_component("llamarl.llamarl", options, scheduler="local_llamarl", cfg={})


@pytest.mark.parametrize("raised, stderr", [
    ("SignalException('Process 1 got signal: 2', sigval=signal.SIGINT)",
     "torchx run: SIGINT received: every role of the app was stopped (its run directory keeps what it recorded)"),
    ("RuntimeError('a bug')", "Traceback"),
])
def test_torchx_run_stopped_by_ctrl_c_ends_on_one_line(raised, stderr):
    """Ctrl-C to `torchx run` (local_cwd): torchx's SignalException, which its CLI does not
    catch, ends the process with one line, not its traceback; other errors keep theirs."""
    code = ("import signal\nfrom llamarl.components.local_scheduler import create_scheduler\n"
            "from torchx.schedulers.local_scheduler import SignalException\n"
            f"create_scheduler('test')\nraise {raised}\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 1
    if stderr == "Traceback":
        assert done.stderr.startswith("Traceback") and "RuntimeError: a bug" in done.stderr, done.stderr
    else:
        assert done.stderr.strip() == stderr, done.stderr


def test_cli_dryrun_for_slurm_and_kubernetes(cli):
    slurm = cli["slurm"].stdout
    assert slurm.count("#SBATCH hetjob") == 3
    for job in ("trainer-0", "generator-0", "generator-1", "reward-0"):
        assert f"--job-name={job}" in slurm
    assert f"${{SLURM_JOB_NODELIST_HET_GROUP_0}}:{PORT}" in slurm
    k8s = cli["kubernetes"].stdout
    assert "batch.volcano.sh" in k8s and "queue: default" in k8s  # queue from .torchxconfig
    for task in ("trainer-0", "generator-0", "generator-1", "reward-0"):
        assert f"name: {task}\n" in k8s
    assert k8s.count("maxRetry: 3") == 3  # each executor replica restarts alone
    assert f"${{VC_TRAINER_0_HOSTS}}:{PORT}" in k8s
    assert "secretName: llamarl-run" in k8s and "mountPath: /etc/llamarl/secret" in k8s


def test_no_dry_run_prints_a_secret(cli):
    """Every role's command line and environment, as each scheduler would submit them: the
    file's path at most, never a value (a secret is 64 hex digits)."""
    for name, proc in cli.items():
        out = proc.stdout + proc.stderr
        assert "LLAMARL_SECRET=" not in out and "LLAMARL_SECRET:" not in out, name
        assert not re.search(r"(?<![0-9a-fA-F])[0-9a-fA-F]{64}(?![0-9a-fA-F])", out), name


def test_builtins_lists_llamarl_and_torchx_own_components(cli):
    out = cli["builtins"].stdout
    for name in ("llamarl.llamarl", "dist.ddp", "dist.spmd", "utils.echo", "utils.python"):
        assert f" {name}\n" in out, f"{name} missing from `torchx builtins`:\n{out}"


def test_plain_dryrun_uses_the_repo_torchxconfig(cli):
    proc = cli["default"]
    out = proc.stdout + proc.stderr
    assert "loaded configs from" in out and ".torchxconfig" in out
    assert "local_llamarl://" in out, "scheduler local_cwd from [cli:run]"
    assert "'name': 'llamarl'" in out and "-m llamarl.app.roles.launch" in out, "component llamarl.llamarl"
    assert "runs/torchx-logs" in out, "log_dir from [local_cwd]"


def test_resume_and_application_retries_reach_the_trainer_and_every_role():
    plain = llamarl()
    assert "--resume" not in roles(plain)["trainer"].args[-1]
    assert roles(plain)["trainer"].max_retries == 0
    named = llamarl(resume="llamarl-abc")
    assert "--resume llamarl-abc" in roles(named)["trainer"].args[-1]
    # Retries restart the whole app, which then resumes its own run by itself.
    retried = llamarl(max_retries=3, num_reward=1)
    assert "--resume auto" in roles(retried)["trainer"].args[-1]
    assert f"--run-id {specs.macros.app_id}" in roles(retried)["trainer"].args[-1]
    trainer = roles(retried)["trainer"]
    assert (trainer.max_retries, trainer.retry_policy) == (3, specs.RetryPolicy.APPLICATION)
    assert "--resume llamarl-abc" in roles(llamarl(max_retries=1, resume="llamarl-abc"))["trainer"].args[-1]


def test_slurm_requeues_a_retried_app():
    info = get_runner().dryrun_component(
        "llamarl.llamarl", ["--max_retries", "2", "--store_port", str(PORT)], scheduler="slurm_llamarl", cfg={})
    script = info.request.materialize()
    assert "TORCHX_MAX_RETRIES=2" in script and "scontrol requeue" in script
    assert "--resume auto" in info.request.replicas["trainer-0"].args[-1]


def test_a_lost_executor_replica_restarts_alone():
    app = roles(llamarl(num_generators=2, num_reward=1, executor_retries=5))
    for role in ("generator", "reward"):
        assert (app[role].max_retries, app[role].retry_policy) == (5, specs.RetryPolicy.REPLICA)
    assert roles(llamarl())["generator"].max_retries == 3  # the default


def test_each_role_computes_where_it_was_given_gpus():
    """A role without GPUs stays on the CPU even on a machine that has some (they are
    another role's); a role with GPUs takes cuda:<LOCAL_RANK> of those it sees."""
    cpu_only = llamarl(num_reward=1)
    assert "--device cpu " in cpu_only.roles[0].args[-1]
    assert cpu_only.roles[1].args[-1].endswith("--device cpu") and cpu_only.roles[2].args[-1].endswith("--device cpu")
    assert llamarl(num_reward=1, reward_gpu=1).roles[2].args[-1].endswith("--device auto")
    gpus = llamarl(nproc_per_node=2, trainer_gpu=2, generator_gpu=1)
    assert "--device auto " in gpus.roles[0].args[-1] and gpus.roles[1].args[-1].endswith("--device auto")
    assert gpus.roles[0].resource.gpu == 2 and gpus.roles[1].resource.gpu == 1
    # The user's trainer flags come after the component's: --device cpu forces the CPU.
    forced = llamarl("--device", "cpu", trainer_gpu=1).roles[0].args[-1]
    assert forced.index("--device auto") < forced.index("--device cpu")
