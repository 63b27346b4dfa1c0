"""benchmarks/real_model.py's arithmetic: the gain and its standard error over seeds, and
the reuse of an earlier output's runs, summarised again from their metrics databases
(written here by the run's own writer, not by hand)."""

import json
import math

import pytest

from benchmarks import real_model
from llamarl.app import names
from llamarl.app.metrics import events as metrics
from llamarl.components.llamarl import REAL_MODEL_JOB_ARGS


def test_gain_is_the_mean_over_seeds_with_the_standard_error_of_the_mean_gain():
    runs = [{"s0": 0.1, "s1": 0.2}, {"s0": 0.1, "s1": 0.3}, {"s0": 0.1, "s1": 0.1}]
    g = real_model.gain(runs, "s0", "s1")
    # gains 0.1, 0.2, 0.0: mean 0.1, sample stdev 0.1, SE 0.1 / sqrt(3)
    assert g["start"] == pytest.approx(0.1) and g["end"] == pytest.approx(0.2)
    assert g["gain"] == pytest.approx(0.1) and g["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert g["gain_in_se"] == pytest.approx(math.sqrt(3)) and g["per_seed"] == [0.2, 0.3, 0.1]
    assert math.isnan(real_model.gain(runs[:1], "s0", "s1")["se"])


def _run_dir(tmp_path, name, *, greedy, sampled, no_answer):
    """A run's metrics.db with two evaluations (step 0 and 2) and two steps."""
    run_dir = tmp_path / name
    writer = metrics.MetricsWriter(run_dir, run_id=name, config={})
    evs = []
    for step, (acc, samp) in zip((0, 2), zip(greedy, sampled)):
        evs += metrics.scalars({names.EVAL_ACCURACY: acc, names.eval_metric("sampled_accuracy"): samp},
                               role="trainer", step=step)
    for step, frac in zip((1, 2), no_answer):
        evs += metrics.scalars({names.TRAIN_STEP_S: 10.0 * step, names.FRAC_NO_ANSWER: frac},
                               role="trainer", step=step)
        evs.append(metrics.interval("busy", "train", 100.0 * step, 100.0 * step + 5, role="trainer"))
        evs.append(metrics.staleness(step, step - 1, 1, True))
    writer.write(evs)
    writer.close()
    return run_dir


def test_reuse_summarises_the_earlier_runs_again_and_refuses_other_settings(tmp_path):
    run_dir = _run_dir(tmp_path, "a", greedy=(0.13, 0.2), sampled=(0.07, 0.17), no_answer=(0.3, 0.0))
    earlier = {"steps": 2, "default_job_args": list(REAL_MODEL_JOB_ARGS), "extra": [], "eval_precision": "bf16",
               "runs": {"4": {"async": {"run_dir": str(run_dir), "minutes": 3.0}}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    args = real_model.parse_args(["--steps", "2", "--seeds", "0"])
    runs = real_model.reused([path], args)
    r = runs[4]["async"]
    assert (r["acc_start"], r["acc"], r["sampled_start"], r["sampled"]) == (0.13, 0.2, 0.07, 0.17)
    assert (r["no_answer_first"], r["no_answer_last"], r["minutes"]) == (0.3, 0.0, 3.0)
    assert r["median_step_s"] == 20.0  # step 1 (start-up) left out

    refused = "ran steps, job flags, extras and evaluation precision"
    with pytest.raises(SystemExit, match=refused):
        real_model.reused([path], real_model.parse_args(["--steps", "3"]))
    with pytest.raises(SystemExit, match=refused):
        real_model.reused([path], real_model.parse_args(["--steps", "2", "--extra", "--lr", "1e-4"]))
    # An output from before --eval-precision was evaluated in fp32: not mixed with bf16's.
    path.write_text(json.dumps({k: v for k, v in earlier.items() if k != "eval_precision"}))
    with pytest.raises(SystemExit, match=r"\(2, \[.*\], \[\], 'fp32'\), this run \(2, \[.*\], \[\], 'bf16'\)"):
        real_model.reused([path], args)
    path.write_text(json.dumps(earlier))
    earlier["runs"]["4"]["async"]["run_dir"] = str(tmp_path / "gone")
    path.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match="has no metrics.db"):
        real_model.reused([path], args)
