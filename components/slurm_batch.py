"""The batch script of a ``slurm_llamarl`` job: one ``srun`` step per role replica.

torchx 0.7.0 starts every replica in one heterogeneous ``srun`` with
``--kill-on-bad-exit=1``: one lost generator (``scancel <job>+2``, a ``kill -9``, a crash)
ends every component, though a llamarl run survives losing a generator or a reward
executor. Here each replica is a step of its own on its own component
(``srun --het-group=K``), started in the background, and the script watches them:

- the trainer's steps hold the job: when every trainer replica has exited 0 the run is
  finished, the other replicas get ``EXECUTOR_STOP_S`` to stop on their own (they do,
  on the trainer's end) and the script exits 0, which ends any left; a trainer replica
  that fails ends the job at once with its exit code (a trainer cannot lose a node);
- a generator or reward replica whose step ends non-zero ends alone; while the trainer
  runs it is started again as a new step on its component, up to the role's
  ``max_retries`` (the component's ``--executor_retries``), appending to its log. A
  replica whose component was cancelled (``scancel <job>+K``) has no allocation left,
  so its restart fails at once and uses up its retries: the run goes on without it.

SIGUSR1 to the script (``sbatch --signal=B:USR1@<s>`` ahead of the time limit) creates the
file ``$LLAMARL_SAVE_REQUEST`` names, on which the trainer saves a checkpoint. The script says each of these
in the job's ``slurm-<job id>.out``; ``torchx status``
reads the same from sacct (``slurm_scheduler.describe_from_sacct``).
"""

import shlex
from typing import Dict, List, Sequence

from torchx.schedulers.slurm_scheduler import SlurmReplicaRequest

SAVE_REQUEST_ENV = "LLAMARL_SAVE_REQUEST"  # llamarl.app.roles.trainer.SAVE_REQUEST_ENV
EXECUTOR_STOP_S = 15
"""After the trainer finished, how long the other replicas get to stop by themselves
before the job ends them. Those still connected stop within seconds of the trainer's end
(most before its step has ended); one restarted too late to rejoin would wait out its
``--connect-timeout-s`` for a store that is gone."""
POLL_S = 1
"""How often the script looks for an ended step."""


def replica_step(replica: SlurmReplicaRequest, group: int) -> List[str]:
    """The ``srun`` command line (quoted) of one replica: a step on its own component;
    appending to its log, so that a restarted replica's output follows its first's."""
    replica.srun_opts.pop("wait", None)
    replica.srun_opts.pop("kill-on-bad-exit", None)
    replica.srun_opts["het-group"] = str(group)
    replica.srun_opts["open-mode"] = "append"
    return ["srun", *replica.materialize()[1]]


def batch_script(header: str, replicas: Dict[str, SlurmReplicaRequest], holders: Sequence[str],
                 retries: Dict[str, int], max_retries: int) -> str:
    """The whole script: ``header`` (the ``#SBATCH`` lines), a function per replica
    starting its step, and the watch described in the module docstring. ``holders``: the
    trainer's replicas; ``retries``: restarts per other replica; ``max_retries``: requeues
    of the whole job after a failure (torchx's ``TORCHX_MAX_RETRIES``)."""
    names = list(replicas)
    functions = "\n".join(f"start_{k}() {{ {' '.join(replica_step(replicas[name], k))} & pid[{k}]=$!; }}"
                          for k, name in enumerate(names))
    holder_ids = " ".join(str(names.index(n)) for n in holders)
    name_list = " ".join(shlex.quote(n) for n in names)
    left = " ".join(f"[{k}]={retries.get(name, 0)}" for k, name in enumerate(names))
    return f"""{header}
export PYTHONUNBUFFERED=1
export SLURM_UNBUFFEREDIO=1
export TORCHX_MAX_RETRIES={max_retries}

# One step per replica (llamarl.components.slurm_batch): a lost generator or reward
# executor ends alone and is restarted while retries are left; the trainer holds the job.
names=({name_list})
holders=({holder_ids})
declare -A pid
declare -A left=({left})
{functions}
say() {{ echo "llamarl-slurm: $*"; }}
# SIGUSR1 (sbatch --signal=B:USR1@<s>, ahead of the time limit): the trainer saves a
# checkpoint at the end of its step when it finds this file, also if it comes before the
# trainer has started (a signal to its processes would then be lost).
export {SAVE_REQUEST_ENV}="$PWD/.llamarl/save-request-$SLURM_JOB_ID"
save_soon() {{
    say "SIGUSR1: the time limit is near; asking the trainer for a checkpoint"
    mkdir -p "$PWD/.llamarl" && touch "${SAVE_REQUEST_ENV}"
}}
trap save_soon USR1
for k in "${{!names[@]}}"; do "start_$k"; done

exitcode=0
running_holders=${{#holders[@]}}
while ((running_holders > 0)); do
    sleep {POLL_S}
    for k in "${{!pid[@]}}"; do
        kill -0 "${{pid[$k]}}" 2>/dev/null && continue
        wait "${{pid[$k]}}"
        rc=$?
        unset "pid[$k]"
        if [[ " ${{holders[*]}} " == *" $k "* ]]; then
            running_holders=$((running_holders - 1))
            if ((rc != 0)); then
                say "${{names[$k]}} ended with srun exit code $rc: ending the job"
                exitcode=$rc
                running_holders=0
                break
            fi
            say "${{names[$k]}} finished"
        elif ((rc != 0 && ${{left[$k]}} > 0)); then
            left[$k]=$((${{left[$k]}} - 1))
            say "${{names[$k]}} lost (srun exit code $rc): restarting it as a new step, ${{left[$k]}} restarts left"
            "start_$k"
        else
            say "${{names[$k]}} ended (srun exit code $rc)"
        fi
    done
done

if ((exitcode == 0)); then
    for ((waited = 0; waited < {EXECUTOR_STOP_S} && ${{#pid[@]}} > 0; waited += {POLL_S})); do
        for k in "${{!pid[@]}}"; do kill -0 "${{pid[$k]}}" 2>/dev/null || unset "pid[$k]"; done
        sleep {POLL_S}
    done
    for k in "${{!pid[@]}}"; do say "${{names[$k]}} still running {EXECUTOR_STOP_S} s after the trainer finished: ended"; done
fi
say "job exited with code $exitcode"
if ((exitcode != 0)); then
    if [ "$TORCHX_MAX_RETRIES" -gt "${{SLURM_RESTART_COUNT:-0}}" ]; then
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit $exitcode
fi
"""
