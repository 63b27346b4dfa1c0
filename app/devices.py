"""Where each role computes, in which precision, and how its process groups talk.

One place decides, for every executor:

- **the device** (``choose_device``): ``--device auto`` is ``cuda:<LOCAL_RANK>`` when CUDA
  is available (torchrun sets ``LOCAL_RANK`` per trainer rank; a generator, one process
  per replica, uses GPU 0 of what it sees), else the CPU; ``--device cpu`` forces the
  CPU, ``--device cuda`` insists on a GPU and says why there is none. Which GPUs a role
  sees is the scheduler's business (``CUDA_VISIBLE_DEVICES``): the TorchX component asks
  for the role's ``*_gpu`` and passes ``--device cpu`` to a role given none, so a role
  without GPUs never lands on one that another role was given.
- **the trainer's precision** (``train_dtype``): fp32, or bf16 autocast over fp32 master
  weights (the optimizer, the gradients and the weights the generators receive stay
  fp32; log-probs are computed from logits upcast to fp32, ``llamarl.app.sampling.logits``).
- **the backends**: the trainer's torchrun group is ``cpu:gloo,cuda:nccl`` where NCCL
  exists (each collective goes by its tensors' device), gloo otherwise; the weight
  plane's group is chosen by ``weight_plane_backend`` from every member's device.

Two processes on one GPU (a single-GPU workstation running trainer and generator) cannot
share an NCCL group: NCCL refuses two ranks on one device. The weight plane then runs on
gloo and stages the weights through host memory (the sender copies each bucket to the
host, the receivers copy the staged version onto their device when they swap it in).
Chosen over CUDA IPC handles because it is the same code path as CPU runs (tested in
real processes here), works for any mix of devices and hosts (a CPU generator beside a
GPU trainer, generators sharing a GPU), needs no handle exchange (IPC handles would need
unpickling or private storage constructors, and the trainer to keep a snapshot alive
until every generator copied it); its price, two host copies and a loopback transfer
per sync, is paid only where NCCL cannot run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from llamarl.app import names
from llamarl.app.errors import DeviceError

log = logging.getLogger("llamarl")

DeviceChoice = Literal["auto", "cpu", "cuda"]
TrainPrecision = Literal["auto", "fp32", "bf16"]

BF16_MIN_CAPABILITY = (8, 0)
"""CUDA compute capability from which bf16 runs natively (Ampere and newer)."""
BF16_DEVICES = ("the CPU", "NVIDIA GPUs of compute capability >= 8.0 (A100, A10, A30, L4, L40, "
                "H100, H200, B200, RTX 30xx/40xx/50xx)")
"""Where ``--train-precision bf16`` runs: named in the error that refuses it elsewhere."""


HOST = torch.device("cpu")
"""The CPU: where gloo's collectives run and where GPU weights are staged."""



def local_rank() -> int:
    """This process's index among the trainer ranks of its node (torchrun's ``LOCAL_RANK``);
    0 for a role started without torchrun (a generator, one process per replica)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def choose_device(choice: DeviceChoice = "auto", *, rank: int | None = None) -> torch.device:
    """The device of this process, made current for CUDA (NCCL and the CUDA caching
    allocator use the current device). ``rank`` defaults to ``local_rank()``."""
    if choice not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"device must be auto, cpu or cuda, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return HOST
    rank = local_rank() if rank is None else rank
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device cuda, but this process sees no CUDA device (torch {torch.__version__}, built "
            f"for CUDA {torch.version.cuda or 'none: a CPU-only build'}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): give the role GPUs "
            "(--trainer_gpu / --generator_gpu) or run it with --device cpu")
    count = torch.cuda.device_count()
    if rank >= count:
        raise DeviceError(
            f"local rank {rank} needs cuda:{rank}, but this process sees {count} CUDA device(s): "
            "give each trainer rank a GPU of its own (--trainer_gpu N with --nproc_per_node N; "
            "two ranks on one GPU cannot share an NCCL group)")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def describe(device: torch.device) -> str:
    """The device for a log line: ``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


# --------------------------------------------------------------------------- precision


def bf16_capable(device: torch.device) -> bool:
    """Whether bf16 runs natively on ``device`` (the CPU always can: autocast emulates
    what the hardware lacks; a GPU from compute capability 8.0)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY
    return False


def train_dtype(precision: TrainPrecision, device: torch.device) -> torch.dtype:
    """The trainer's compute dtype: ``auto`` is bf16 on a GPU that runs it, fp32 on the
    CPU (where bf16 is slower, and the reference numbers are fp32); ``bf16`` on a device
    that cannot run it is refused with the list of those that can."""
    if precision == "fp32":
        return torch.float32
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_capable(device) else torch.float32
    if precision != "bf16":
        raise DeviceError(f"train_precision must be auto, fp32 or bf16, got {precision!r}")
    if not bf16_capable(device):
        detail = (f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                  if device.type == "cuda" else "no bf16 support")
        raise DeviceError(f"--train-precision bf16: {describe(device)} has {detail}; bf16 runs on "
                          f"{' and on '.join(BF16_DEVICES)}. Use --train-precision fp32 here")
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device`` for the forward and backward passes; nothing
    for fp32. Weights, gradients and optimizer state stay in their own dtype (fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# --------------------------------------------------------------------------- process groups


def trainer_backend() -> str:
    """The trainer ranks' torchrun group: gloo for CPU tensors and NCCL for CUDA ones
    where NCCL exists (a CUDA build with a GPU), so one group serves whatever device
    ``--device`` picks (it is made before the flags are read)."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def device_key(device: torch.device) -> str:
    """What the weight plane's members publish to choose its backend: ``cpu``, or
    ``cuda:<uuid>`` of the physical GPU (the same on every process that uses it, whatever
    ``CUDA_VISIBLE_DEVICES`` numbered it, and unique across hosts)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    return device.type


def joint_key(keys: Sequence[str]) -> str:
    """One member standing for several processes (the trainer ranks, each in a weight
    group of its own with every generator): ``cuda:<uuid>,<uuid>...`` of all their GPUs,
    so that every group sees every GPU the trainer holds and all groups choose alike;
    ``cpu`` when any of them is on the CPU."""
    if not keys or any(not k.startswith("cuda:") for k in keys):
        return "cpu"
    return "cuda:" + ",".join(sorted({g for k in keys for g in _gpus(k)}))


def _gpus(key: str) -> list[str]:
    return key.removeprefix("cuda:").split(",") if key.startswith("cuda:") else []


@dataclass(frozen=True)
class WeightPlanePath:
    """How the weight plane's members talk, decided alike on every member."""

    backend: Literal["nccl", "gloo"]
    staged: bool
    """True when a member's weights live on a GPU but the transfer runs on gloo: they go
    through host memory."""
    reason: str


def weight_plane_backend(keys: Sequence[str]) -> WeightPlanePath:
    """NCCL when every member (``device_key`` each, rank order) is on a GPU of its own;
    otherwise gloo, staging GPU weights through host memory. A pure function of the keys,
    so every member reaches the same answer from the same published list."""
    on_gpu = [k.startswith("cuda:") for k in keys]
    if all(on_gpu):
        gpus = [set(_gpus(k)) for k in keys]  # a joint key holds several
        ranks = sorted({r for r, mine in enumerate(gpus) for s, theirs in enumerate(gpus)
                        if r != s and mine & theirs})
        if not ranks:
            return WeightPlanePath("nccl", False, "every member on a GPU of its own")
        return WeightPlanePath("gloo", True, f"ranks {ranks} share a GPU (NCCL refuses two ranks on one "
                                             "device): staged through host memory")
    if any(on_gpu):
        return WeightPlanePath("gloo", True, "some members are on the CPU: GPU weights staged through "
                                             "host memory")
    return WeightPlanePath("gloo", False, "every member on the CPU")


# --------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued on its current stream (a stream
    synchronisation point; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def device_metrics(device: torch.device) -> dict[str, float]:
    """The GPU's utilisation (percent of the last sample period with a kernel running,
    from NVML: the whole device's, every process on it included) and this process's peak
    and current allocated memory in GiB; empty on the CPU. Utilisation is left out where
    NVML cannot be read (no ``nvidia-ml-py``, or a driver that does not answer)."""
    if device.type != "cuda":
        return {}
    out = {names.DEVICE_MAX_MEMORY_GB: torch.cuda.max_memory_allocated(device) / 2**30,
           names.DEVICE_MEMORY_GB: torch.cuda.memory_allocated(device) / 2**30}
    try:
        out[names.DEVICE_UTILIZATION] = float(torch.cuda.utilization(device))
    except Exception as e:  # noqa: BLE001 - NVML's errors are its own classes, or ModuleNotFoundError
        _warn_once(f"GPU utilisation not recorded: {type(e).__name__}: {e}")
    return out


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A random generator on ``device`` (sampling draws on the model's device, and a CPU
    generator cannot drive a CUDA draw); CUDA and CPU streams differ for one seed."""
    return torch.Generator(device=device).manual_seed(seed)
