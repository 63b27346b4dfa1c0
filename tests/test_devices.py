"""Devices: where each role computes, its precision, the weight plane's path, GPU idle time."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from llamarl.app import devices
from llamarl.app.metrics import events as metrics
from llamarl.app.rl import step as rl
from llamarl.app.devices import WeightPlanePath, weight_plane_backend
from llamarl.app.errors import DeviceError
from llamarl.app.sampling import token_logprobs
from llamarl.app.weights.group import init_weight_group
from llamarl.app.weights.receiver import WeightReceiver
from llamarl.app.weights.sender import WeightSender
from llamarl.app.weights.subscriber import swap_staged
from role_processes import loopback_store, run_roles, weight_member
from test_rl import PAD, _ragged_rollouts, tiny_model  # noqa: F401 - tiny_model is a fixture
from test_weight_sync import BUCKET_MB, flattened, model_params

NO_CUDA = not torch.cuda.is_available()

# --------------------------------------------------------------------------- the device


def test_cpu_is_chosen_when_forced_or_when_there_is_no_gpu():
    assert devices.choose_device("cpu") == torch.device("cpu")
    if NO_CUDA:
        assert devices.choose_device("auto") == torch.device("cpu")
        assert devices.trainer_backend() == "gloo"


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_asking_for_cuda_without_one_says_why_and_what_to_do():
    with pytest.raises(DeviceError, match=r"sees no CUDA device.*--device cpu"):
        devices.choose_device("cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(DeviceError, match="auto, cpu or cuda"):
        devices.choose_device("tpu")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert devices.choose_device("auto") == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    with pytest.raises(DeviceError, match="a GPU of its own"):
        devices.choose_device("cuda", rank=torch.cuda.device_count())
    assert devices.trainer_backend() == "cpu:gloo,cuda:nccl"


# --------------------------------------------------------------------------- precision


def test_precision_defaults_to_fp32_on_the_cpu_and_bf16_runs_there_when_asked():
    cpu = torch.device("cpu")
    assert devices.train_dtype("auto", cpu) == torch.float32
    assert devices.train_dtype("fp32", cpu) == torch.float32
    assert devices.train_dtype("bf16", cpu) == torch.bfloat16


def test_bf16_is_refused_where_it_cannot_run_with_the_list_of_where_it_can():
    # The meta device stands in for a GPU without bf16 (a V100): no GPU here to be one.
    with pytest.raises(DeviceError, match=r"compute capability >= 8\.0.*H100.*--train-precision fp32"):
        devices.train_dtype("bf16", torch.device("meta"))
    assert devices.train_dtype("auto", torch.device("meta")) == torch.float32


@pytest.mark.gpu
def test_bf16_is_the_default_on_a_gpu_that_runs_it():
    gpu = torch.device("cuda", 0)
    expected = torch.bfloat16 if devices.bf16_capable(gpu) else torch.float32
    assert devices.train_dtype("auto", gpu) == expected


def test_autocast_computes_in_bf16_and_leaves_fp32_alone():
    layer = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with devices.autocast(torch.device("cpu"), torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with devices.autocast(torch.device("cpu"), torch.float32):
        assert layer(x).dtype == torch.float32
    assert layer.weight.dtype == torch.float32  # the weights stay fp32


def test_log_probs_of_bf16_logits_are_computed_in_fp32():
    """The reference: log-softmax of the same (bf16-rounded) logits in fp64, at the token."""
    g = torch.Generator().manual_seed(0)
    logits_NV = (torch.randn(6, 50, generator=g) * 4).bfloat16().requires_grad_()
    tokens_N = torch.randint(0, 50, (6,), generator=g)
    for top_p in (1.0, 0.9):
        logp_N = token_logprobs(logits_NV, tokens_N, 0.7, top_p)
        assert logp_N.dtype == torch.float32
        if top_p == 1.0:
            ref_N = torch.log_softmax(logits_NV.double() / 0.7, -1).gather(-1, tokens_N[:, None])[:, 0]
            torch.testing.assert_close(logp_N.double(), ref_N, rtol=1e-6, atol=1e-6)
        logp_N.sum().backward()
        assert logits_NV.grad.dtype == torch.bfloat16 and torch.isfinite(logits_NV.grad.float()).all()
        logits_NV.grad = None


def test_a_bf16_train_step_tracks_the_fp32_one_and_keeps_fp32_weights(tiny_model):
    """The reference is the fp32 step from the same weights on the same rollouts: bf16
    autocast changes the loss and the update by bf16 rounding only (2.5e-4 of the loss
    here, update directions 0.99999 alike), and the weights stay fp32."""
    cfg = rl.StepConfig(loss="aipo", rho_max=4.0, clip_eps=0.2, normaliser="token", kl_coef=0.0,
                        temperature=1.0, top_p=1.0, micro_batch=3)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(tiny_model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient
        before = [p.detach().clone() for p in model.parameters()]
        with devices.autocast(torch.device("cpu"), dtype):
            stats = rl.train_step(model, optimizer, _ragged_rollouts(6), cfg, pad_id=PAD)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        results[dtype] = stats, torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
    (ref, step_ref), (got, step_bf16) = results[torch.float32], results[torch.bfloat16]
    assert got["loss"] == pytest.approx(ref["loss"], rel=5e-3)
    cosine = torch.nn.functional.cosine_similarity(step_ref, step_bf16, dim=0)
    assert cosine > 0.999, cosine


# --------------------------------------------------------------------------- the weight plane's path


def test_nccl_only_when_every_member_has_a_gpu_of_its_own():
    assert weight_plane_backend(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"]) == WeightPlanePath(
        "nccl", False, "every member on a GPU of its own")
    shared = weight_plane_backend(["cuda:GPU-a", "cuda:GPU-a"])  # the one-GPU workstation
    assert (shared.backend, shared.staged) == ("gloo", True) and "ranks [0, 1] share a GPU" in shared.reason
    two_on_one = weight_plane_backend(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-b"])  # generators share one
    assert (two_on_one.backend, two_on_one.staged) == ("gloo", True) and "ranks [1, 2]" in two_on_one.reason
    mixed = weight_plane_backend(["cuda:GPU-a", "cpu"])  # a CPU generator beside a GPU trainer
    assert (mixed.backend, mixed.staged) == ("gloo", True)
    assert weight_plane_backend(["cpu", "cpu", "cpu"]) == WeightPlanePath("gloo", False, "every member on the CPU")


def test_every_trainer_ranks_group_chooses_alike_from_the_trainers_joint_key():
    """Two trainer ranks on GPUs a and b, each in a group of its own with a generator on
    b: on its own key rank 0's group would pick NCCL and rank 1's gloo, and the generator
    could not hold one staging for both. With the joint key both groups pick gloo."""
    trainer = devices.joint_key(["cuda:GPU-a", "cuda:GPU-b"])
    assert trainer == "cuda:GPU-a,GPU-b"
    assert weight_plane_backend(["cuda:GPU-a", "cuda:GPU-b"]).backend == "nccl"  # the trap
    assert weight_plane_backend([trainer, "cuda:GPU-b"]).staged
    assert weight_plane_backend([trainer, "cuda:GPU-c"]).backend == "nccl"
    assert devices.joint_key(["cuda:GPU-a", "cpu"]) == "cpu"


def _sync_two_versions(store, rank: int, world_size: int, places: list[str], keys: list[str] | None) -> str:
    """Each rank's weights on ``places[rank]``; it publishes ``keys[rank]`` as its device
    (None: its real one). Two versions go through; the receivers check them exactly."""
    device = torch.device(places[rank])
    on = lambda params: [(n, p.to(device)) for n, p in params]  # noqa: E731
    group = init_weight_group(weight_member(store, rank), rank, world_size, device, timeout_s=30,
                              device_key=None if keys is None else keys[rank])
    path = f"{group.path.backend} staged={group.path.staged} on {group.device.type}"
    if rank == 0:
        live = on(model_params(0))
        sender = WeightSender(group, live, bucket_mb=BUCKET_MB)
        for version in (1, 2):
            with torch.no_grad():
                for (_, p), (_, new) in zip(live, model_params(version)):
                    p.copy_(new)
            sender.send(version)
        return path
    receiver = WeightReceiver(group, flattened(on(model_params(0, seed=rank))), bucket_mb=BUCKET_MB)
    receiver.start_background()
    deadline = time.monotonic() + 60
    while receiver.latest_version() != 2:
        assert time.monotonic() < deadline, "version 2 did not arrive"
        time.sleep(0.005)
    receiver.stop_background()
    assert swap_staged(receiver) == 2
    for (name, got), (_, want) in zip(receiver.params, model_params(2)):
        assert got.device == device and torch.equal(got.cpu(), want), f"{name} differs"
    return path


@pytest.mark.integration
@pytest.mark.parametrize("keys", [["cuda:GPU-one", "cuda:GPU-one", "cuda:GPU-one"],  # one shared GPU
                                  ["cuda:GPU-one", "cpu", "cpu"]])  # GPU trainer, CPU generators
def test_members_that_cannot_share_nccl_sync_over_gloo_bit_for_bit(keys):
    """The staged path in real processes: every rank reads the same keys and picks gloo,
    and the generators' weights equal the trainer's exactly. (On the CPU the staging
    copies are CPU to CPU; on a GPU the same code copies to and from the device: the
    ``gpu`` test below.)"""
    store = loopback_store(timeout_s=60)
    results = dict(run_roles(_sync_two_versions, 3, store.port, 120, ["cpu"] * 3, keys))
    assert results == {r: "gloo staged=True on cpu" for r in range(3)}, results


@pytest.mark.gpu
@pytest.mark.integration
def test_processes_on_one_gpu_sync_through_host_memory_and_on_two_over_nccl():
    store = loopback_store(timeout_s=60)
    results = dict(run_roles(_sync_two_versions, 2, store.port, 120, ["cuda:0", "cuda:0"], None))
    assert results == {r: "gloo staged=True on cpu" for r in range(2)}, results
    if torch.cuda.device_count() >= 2:
        store = loopback_store(timeout_s=60)
        results = dict(run_roles(_sync_two_versions, 2, store.port, 120, ["cuda:0", "cuda:1"], None))
        assert results == {r: "nccl staged=False on cuda" for r in range(2)}, results


# --------------------------------------------------------------------------- GPU idle time


def test_a_busy_interval_ends_after_the_device_is_done():
    """``busy_ends`` (a stream synchronisation on a GPU) runs at the end of every busy
    interval, before its end time is taken; idle intervals and failed blocks skip it."""
    synced: list[float] = []
    timeline = metrics.Timeline("generator", 1, busy_ends=lambda: synced.append(time.time()))
    with timeline.busy("generate"):
        pass
    with timeline.idle("wait_weights"):
        pass
    with pytest.raises(RuntimeError):
        with timeline.busy("generate"):
            raise RuntimeError("out of memory")
    events = timeline.drain()
    assert [(e["kind"], e["what"]) for e in events] == [("busy", "generate"), ("idle", "wait_weights"),
                                                       ("busy", "generate")]
    assert len(synced) == 1 and events[0]["t0"] <= synced[0] <= events[0]["t1"]


def test_cpu_roles_report_no_device_metrics():
    assert devices.device_metrics(torch.device("cpu")) == {}
    devices.synchronize(torch.device("cpu"))  # nothing to wait for


@pytest.mark.gpu
def test_a_gpu_role_reports_its_memory_and_utilisation():
    from llamarl.app import names

    gpu = devices.choose_device("cuda")
    x = torch.randn(1024, 1024, device=gpu)
    (x @ x).sum().item()
    m = devices.device_metrics(gpu)
    assert m[names.DEVICE_MAX_MEMORY_GB] >= 4 * 2**20 / 2**30
    assert 0 <= m.get(names.DEVICE_UTILIZATION, 0) <= 100
    assert devices.device_key(gpu).startswith("cuda:")
    assert weight_plane_backend([devices.device_key(gpu)] * 2).staged


def test_reward_models_run_on_the_executors_device_unless_the_spec_names_one():
    from llamarl.app.rewards import build_reward

    def devices_of(reward):
        return {c.name: getattr(c.fn, "device", None) for c in reward.components}

    # Nothing is loaded here: models load on .load(), in their worker process.
    assert devices_of(build_reward("math_verifier,semantic_similarity=0.5", device="cuda:0")) == {
        "math_verifier": None, "semantic_similarity": "cuda:0"}
    assert devices_of(build_reward("semantic_similarity(device=cpu)", device="cuda:0")) == {
        "semantic_similarity": "cpu"}
    assert devices_of(build_reward("semantic_similarity")) == {"semantic_similarity": "cpu"}
