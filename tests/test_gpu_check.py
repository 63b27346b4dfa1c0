"""benchmarks/gpu_check.py, the prepared check for CUDA machines: its dry run exercises
the same steps on the CPU (gloo), so the script is known to work before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device on this machine" in done.stderr and "--cpu-dry-run" in done.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_dry_run_passes_every_check_on_the_cpu(tiny_policy, tmp_path):
    """Every check ran (NCCL's skipped, saying why), from another working directory, on the
    session's tiny policy (the script's own is made the same way: ``_tiny_policy``)."""
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--json", str(report_path),
                           "--policy", str(tiny_policy)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert report["ok"] and report["dry_run"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "environment": "ok", "generator": "ok", "static_decoder": "ok", "trainer": "ok", "weight_plane_shared": "ok",
        "weight_plane_nccl": "skipped", "fsdp2_step": "ok", "app_run": "ok", "sampler_benchmark": "ok",
        "check_every_benchmark": "ok", "gpu_tests": "skipped"}
    assert report["finished"]
    assert checks["static_decoder"]["captured"] is False  # the same steps, no capture on CPU
    assert checks["static_decoder"]["compiled_steps"] >= 1 and checks["static_decoder"]["compile_s"] > 0
    # The benchmarks' script ran each side of the GPU run but the compiling ones (not on the CPU).
    assert set(checks["sampler_benchmark"]["tokens_per_s"]) == {
        "default fp32 8 captured", "default fp32 8 eager", "default fp32 8 generate"}
    assert set(checks["check_every_benchmark"]["tokens_per_s"]) == {
        f"default fp32 8 captured {k}" for k in (1, 4, 8, 16)}
    assert checks["weight_plane_nccl"]["reason"] == "CPU dry run: NCCL needs GPUs"
    assert checks["weight_plane_shared"]["bit_identical"] and checks["weight_plane_shared"]["backend"] == "gloo"
    trainer = checks["trainer"]
    assert trainer["precision"] == "bfloat16" and trainer["loss_rel_diff"] < 0.05  # the GPU's path, on the CPU
    fsdp = checks["fsdp2_step"]
    assert fsdp["ranks"] == 2 and fsdp["loss"] == pytest.approx(fsdp["loss_unsharded"], rel=1e-5)
    app = checks["app_run"]
    assert app["steps"] == 3 and "gloo (every member on the CPU)" in app["weight_plane"]
    assert app["trainer"] == "cpu, training in bf16 autocast over fp32 weights"


def test_the_sampler_table_survives_a_failing_side_and_takes_sides_per_case():
    """What keeps a one-shot GPU run's table: a side that raises is recorded and left out,
    the others measured (``interleaved(failures=...)``); ``--case C:R:P:SIDE+SIDE`` runs
    some of ``--sampler``'s sides only, in ``--sampler``'s order."""
    import argparse

    sys.path.insert(0, str(SCRIPT.parent))
    import sampler

    seeds, failures = [], {}
    res = sampler.interleaved({"good": lambda s: seeds.append(s) or 10, "bad": lambda s: 1 // 0},
                              repeats=2, warmup=1, failures=failures)
    assert list(res) == ["good"] and res["good"]["median_tokens"] == 10
    assert failures == {"bad": "ZeroDivisionError: integer division or modulo by zero"}
    assert seeds == [10_000, 0, 1]  # the warm-up round, then the timed ones
    with pytest.raises(ZeroDivisionError):
        sampler.interleaved({"bad": lambda s: 1 // 0}, repeats=1)
    args = argparse.Namespace(case=["374m:64:bf16", "60m:64:fp32:eager+captured"],
                              sampler=["captured", "compiled", "eager"])
    assert sampler._cases(args) == [("374m", 64, "bf16", ["captured", "compiled", "eager"]),
                                    ("60m", 64, "fp32", ["captured", "eager"])]
    with pytest.raises(SystemExit, match="generate not among"):
        sampler._cases(argparse.Namespace(case=["60m:64:fp32:generate"], sampler=["captured"]))
    # A compiling side's calls add up the CUDA graph skips torch counted during them (on
    # CUDA its figures are of graphs only when that stays 0), raising or not.
    from torch._dynamo.utils import counters

    def skipping(seed: int) -> int:
        counters["inductor"]["cudagraph_skips"] += 2
        return 1 // seed

    skips: dict[str, int] = {}
    assert sampler._counting_skips(skipping, skips, "compiled", 1) == 1
    with pytest.raises(ZeroDivisionError):
        sampler._counting_skips(skipping, skips, "compiled", 0)
    assert skips == {"compiled": 4}


def test_its_own_tiny_policy_is_a_policy_the_checks_can_load(tmp_path):
    """What a GPU session without ``--policy`` runs on (``_tiny_policy``), made and loaded."""
    from benchmarks import gpu_check
    from llamarl.app.model.policy import load_policy

    model, tokenizer = load_policy(gpu_check._tiny_policy(tmp_path))
    assert sum(p.numel() for p in model.parameters()) > 0 and tokenizer.eos_token_id is not None
