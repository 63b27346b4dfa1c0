"""The simulator (``llamarl.app.sim``): the event engine against cases worked out by hand,
the fits against a metrics database written with known costs, the spec files, the CLI."""

from __future__ import annotations

import json
import os
import random
import statistics
from dataclasses import fields, replace

import pytest

from llamarl.app import names
from llamarl.app.metrics import events
from llamarl.app.sim import __main__ as sim_cli
from llamarl.app.sim import calibrate, engine, spec
from llamarl.app.sim.costs import GenCost, Lengths, Loop, RewardCost, SyncCost, TrainCost


def fixed_loop(gen: float, reward: float, train: float, sync: float, *, max_staleness: int,
               generators: int = 1, batches_per_step: int = 1, reward_executors: int = 1) -> Loop:
    """Every cost fixed: one generator batch of ``4 / batches_per_step`` prompts takes ``gen``
    whatever its lengths (all equal), a scoring call ``reward``, a step ``train``, a sync ``sync``."""
    return Loop(steps=30, prompts_per_step=4, group_size=2, max_staleness=max_staleness, generators=generators,
                gen_batch_prompts=4 // batches_per_step, reward_executors=reward_executors,
                lengths=Lengths(mean=5, sigma=0, cap=10), gen=GenCost(batch_s=gen),
                reward=RewardCost(batch_s=reward), train=TrainCost(step_s=train), sync=SyncCost(fixed_s=sync))


COSTS = [(1.0, 0.5, 2.0, 0.3), (3.0, 0.2, 1.0, 0.1), (1.0, 0.1, 1.0, 0.2), (0.5, 0.5, 0.5, 0.5)]


@pytest.mark.parametrize("costs", COSTS)
def test_synchronous_step_is_the_sum_of_the_stages(costs):
    gen, reward, train, sync = costs
    report = engine.simulate(fixed_loop(*costs, max_staleness=0))
    assert report.median_step_s == pytest.approx(gen + reward + train + sync)
    assert report.staleness == {0: 29 * 4 + 4}  # every group of every step trained fresh


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("costs", COSTS)
def test_asynchronous_step_is_the_slowest_stage_or_the_round_trip_over_k_plus_1(costs, k):
    """One generator, one batch a step: batch n needs weights n - K, published train + sync
    after batch n - K - 1 trained, so K + 1 steps hold one round trip gen + reward + train
    + sync; otherwise the slowest stage sets the pace."""
    gen, reward, train, sync = costs
    report = engine.simulate(fixed_loop(*costs, max_staleness=k))
    assert report.median_step_s == pytest.approx(max(gen, reward, train + sync, (gen + reward + train + sync) / (k + 1)))
    assert max(report.staleness) <= k


def test_generators_share_a_step_and_inline_scoring_overlaps_training():
    # Two batches a step, two generators: they run side by side.
    one = engine.simulate(fixed_loop(1.0, 0.0, 0.2, 0.0, max_staleness=1, batches_per_step=2))
    two = engine.simulate(fixed_loop(1.0, 0.0, 0.2, 0.0, max_staleness=1, batches_per_step=2, generators=2))
    assert one.median_step_s == pytest.approx(2.0)
    assert two.median_step_s == pytest.approx(1.0)
    assert two.idle["generator"] == pytest.approx(0.0, abs=1e-9)
    assert two.idle["trainer"] == pytest.approx(0.8, abs=0.01)  # the last step ends the count early
    inline = engine.simulate(fixed_loop(0.5, 1.0, 1.0, 0.0, max_staleness=1, reward_executors=0))
    assert inline.median_step_s == pytest.approx(1.0)
    assert "reward" not in inline.idle  # the trainer's own thread, no executor


def test_shared_cores_stretch_the_phases_that_run_at_once():
    """One CPU host: generation (1.0) and training (1.0) of an asynchronous loop overlap.
    With a device each (cores 0) or a core each, a step is 1.0; with one core, they split
    it while both run and a step holds both costs; another program's thread on two cores
    leaves each of the two phases two thirds of a core. Synchronous, they never overlap:
    the cores change nothing until another program takes its share."""
    def step(cores: int, load: float = 0.0, k: int = 1) -> float:
        loop = fixed_loop(1.0, 0.0, 1.0, 0.0, max_staleness=k, reward_executors=0)
        return engine.simulate(replace(loop, cores=cores, host_load=load)).median_step_s
    assert step(0) == pytest.approx(1.0) and step(2) == pytest.approx(1.0)
    assert step(1) == pytest.approx(2.0)
    assert step(2, load=1.0) == pytest.approx(1.5)
    assert step(1, k=0) == step(0, k=0) == pytest.approx(2.0)
    assert step(1, load=1.0, k=0) == pytest.approx(4.0)
    # A reward's wait (a remote judge) takes no core: a sleep is not stretched by the load.
    waiting = replace(fixed_loop(1.0, 0.0, 1.0, 0.0, max_staleness=0), reward=RewardCost(wait_s=0.5 / 8),
                      cores=1, host_load=1.0)
    assert engine.simulate(waiting).median_step_s == pytest.approx(4.5)  # 2 + 2 computing, 0.5 waiting
    with pytest.raises(ValueError, match="host_load"):
        Loop(host_load=-1.0)
    with pytest.raises(ValueError, match=r"SyncCost\.byte_s must be a finite number >= 0"):
        SyncCost(byte_s=float("nan"))


def test_idle_fractions_are_of_the_timed_intervals():
    report = engine.simulate(fixed_loop(1.0, 0.5, 2.0, 0.5, max_staleness=0))
    step = 4.0  # the run's edges (the first wait, the last step) shift each by less than 0.01
    assert report.idle["generator"] == pytest.approx((step - 1.0) / step, abs=0.01)
    assert report.idle["reward"] == pytest.approx((step - 0.5) / step, abs=0.01)
    assert report.idle["trainer"] == pytest.approx((step - 2.5) / step, abs=0.01)


def test_a_batch_past_the_kv_room_pays_its_long_tail_per_wave():
    cost = GenCost(step_s=1.0, token_s=0.0, max_rows=2)
    assert cost.seconds([10, 1, 3, 4, 2]) == 10 + 4 + 2
    assert GenCost(step_s=1.0).seconds([10, 1, 3, 4, 2]) == 10


def test_a_long_tail_slows_the_synchronous_loop_more_than_the_asynchronous_one():
    def loop(sigma: float, k: int) -> Loop:
        return Loop(steps=40, prompts_per_step=8, group_size=8, max_staleness=k, generators=4, gen_batch_prompts=2,
                    lengths=Lengths(mean=200, sigma=sigma, cap=2000), gen=GenCost(step_s=0.01, max_rows=8),
                    train=TrainCost(step_s=1.0), sync=SyncCost(fixed_s=0.1))

    sync_gain = engine.simulate(loop(1.0, 0)).median_step_s / engine.simulate(loop(0.0, 0)).median_step_s
    async_gain = engine.simulate(loop(1.0, 2)).median_step_s / engine.simulate(loop(0.0, 2)).median_step_s
    assert sync_gain > async_gain


def test_capped_lognormal_moments_match_sampling():
    lengths = Lengths(mean=30.0, sigma=0.7, cap=48)
    draws = lengths.sample(random.Random(0), 40000)
    mean, std = calibrate.capped_moments(30.0, 0.7, 48)
    assert statistics.mean(draws) == pytest.approx(mean, abs=0.3)
    assert statistics.pstdev(draws) == pytest.approx(std, abs=0.3)
    fitted = calibrate.fit_lengths(mean, std, 48)
    assert fitted.sigma == pytest.approx(0.7, abs=0.05)


def test_robust_fit_recovers_coefficients_past_an_outlier():
    xs = [[1.0, float(t)] for t in range(10, 30)]
    ys = [0.2 + 0.01 * x[1] for x in xs]
    ys[5] *= 5  # a timing slowed by another process
    a, b = calibrate.robust_fit(xs, ys)
    assert a == pytest.approx(0.2) and b == pytest.approx(0.01)
    assert calibrate.least_squares([[1.0, 2.0], [1.0, 2.0]], [1.0, 1.0]) == [1.0, 0.0]  # a constant column


# --------------------------------------------------------------------------- calibration from a database

GROUPS_PER_BATCH, PUSH_S = 4, 0.002


def write_run(run_dir, *, gen_s, train_s, sync_s, score_s, steps=12, rows=16, tokens_per_row=20, cpu_share=None,
              bounds=None):
    """A metrics database as the app writes it (``events.MetricsWriter``), of a synchronous
    loop whose every cost is known: one generator batch a step, scored by one reward
    executor, trained, synced. With ``cpu_share``, a run on CPUs whose generator and
    trainer had that share of a core (their CPU seconds recorded). With ``bounds``, a
    ``--max-staleness auto`` run that held ``bounds[step - 1]`` at each step."""
    config = {"prompts_per_step": rows // 4, "group_size": 4, "max_staleness": 0, "num_generators": 1,
              "num_reward": 1, "gen_batch_prompts": rows // 4, "max_new_tokens": 48, "steps": steps, "eval_every": 0,
              "device": "cpu" if cpu_share else "cuda"}
    if bounds is not None:
        config["max_staleness"] = "auto"
    writer = events.MetricsWriter(run_dir, run_id="fixture", config=config)
    t, evs = 1000.0, []
    for step in range(1, steps + 1):
        n_tokens = rows * tokens_per_row + (step % 3) * 8  # batches differ a little
        g = gen_s + 0.001 * (step % 3)
        # the batch as the app records it: a generate interval per group, each cut by its push
        for k in range(GROUPS_PER_BATCH):
            t0 = t + k * (g / GROUPS_PER_BATCH + PUSH_S)
            evs.append(events.interval("busy", "generate", t0, t0 + g / GROUPS_PER_BATCH, role="generator"))
            evs.append(events.interval("idle", "queue_full", t0 + g / GROUPS_PER_BATCH,
                                       t0 + g / GROUPS_PER_BATCH + PUSH_S, role="generator"))
        g_wall = g + GROUPS_PER_BATCH * PUSH_S
        # the generator at its bound until the step's weights arrive, the trainer waiting for rollouts
        evs.append(events.interval("idle", "staleness_bound", t + g_wall, t + g_wall + score_s + train_s * n_tokens
                                   / (rows * tokens_per_row) + sync_s,
                                   role="generator"))
        evs.append(events.interval("idle", "wait_rollouts", t, t + g_wall + score_s, role="trainer"))
        # rates over the busy time (the pushes left out), reported once the batch is done
        evs += [events.scalar(names.GEN_TOKENS_PER_S, n_tokens / g, role="generator", t=t + g_wall + 0.001),
                events.scalar(names.GEN_SEQS_PER_S, rows / g, role="generator", t=t + g_wall + 0.001)]
        if cpu_share:
            evs.append(events.scalar(names.GEN_CPU_S, g * cpu_share, role="generator", t=t + g_wall + 0.001))
        t += g_wall
        evs.append(events.interval("busy", "score", t, t + score_s, role="reward"))
        evs.append(events.scalar(names.REWARD_SAMPLES_PER_S, rows / score_s, role="reward", t=t + score_s))
        t += score_s
        tr = train_s * n_tokens / (rows * tokens_per_row)  # a training pass costs per token
        evs.append(events.interval("busy", "train", t, t + tr, role="trainer"))
        evs.append(events.scalar(names.TRAIN_TOKENS_PER_S, n_tokens / tr, role="trainer", t=t + tr))
        if cpu_share:
            evs.append(events.scalar(names.TRAIN_CPU_S, tr * cpu_share, role="trainer", t=t + tr))
        evs.append(events.scalar(names.TRAIN_STEP_S, g_wall + score_s + tr + sync_s, role="trainer",
                                 step=step, t=t + tr))
        if step <= len(bounds or ()):
            evs.append(events.scalar(names.STALENESS_BOUND, bounds[step - 1], role="trainer", step=step, t=t + tr))
        t += tr
        evs.append(events.interval("busy", "weight_sync", t, t + sync_s, role="trainer"))
        evs.append(events.weight_sync(step, "trainer/0", 1000, sync_s))
        t += sync_s
    writer.write(evs)
    writer.close()


def test_from_run_fits_the_costs_a_run_recorded(tmp_path):
    write_run(tmp_path, gen_s=0.3, train_s=0.2, sync_s=0.05, score_s=0.01)
    fit = calibrate.from_run(tmp_path)
    loop = fit.loop()
    assert loop.gen.seconds([20] * 16) == pytest.approx(0.3, abs=0.003)  # the batch, not one group
    assert loop.gen.overhead_s == pytest.approx(GROUPS_PER_BATCH * PUSH_S)  # its pushes
    assert loop.train.seconds(320) == pytest.approx(0.2, abs=0.002)
    assert loop.train.seconds(640) == pytest.approx(0.4, abs=0.004)  # one batch size: per token
    assert loop.sync.seconds(senders=1, receivers=1) == pytest.approx(0.05)
    assert loop.reward.seconds(16) == pytest.approx(0.01, abs=1e-4)
    assert fit.lengths.capped_mean() == pytest.approx(20.0, abs=1.0)
    predicted = engine.simulate(loop)
    assert predicted.median_step_s == pytest.approx(calibrate.measured(tmp_path).median_step_s, rel=0.03)
    # The same costs, asynchronous: the slowest stage (gen 0.3) instead of the sum.
    assert engine.simulate(fit.loop(max_staleness=1)).median_step_s == pytest.approx(0.3, rel=0.03)


def test_a_run_on_shared_cpu_cores_is_costed_at_a_core_to_itself(tmp_path):
    """Generator and trainer each ran alone (synchronous) on a third of a core: the other
    programs' load is what leaves that share, the costs are the CPU seconds, and replaying
    the run at its load gives back its step; on a machine of its own each stage is three
    times faster."""
    write_run(tmp_path, gen_s=0.3, train_s=0.2, sync_s=0.0, score_s=0.01, cpu_share=1 / 3)
    fit = calibrate.from_run(tmp_path)
    cores = os.cpu_count()
    assert fit.cores == cores and fit.host_load == pytest.approx(3 * cores - 1, rel=0.01)
    assert calibrate.host_load(tmp_path) == pytest.approx(fit.host_load)
    assert fit.gen.seconds([20] * 16) == pytest.approx(0.1, abs=0.002)
    # One batch shape on a CPU: a batch of other rows costs in proportion (not the same,
    # as a per-batch cost would say): a CPU computes every row.
    assert fit.gen.seconds([20] * 8) == pytest.approx(0.05, abs=0.002)
    assert fit.gen.batch_s == fit.gen.step_s == 0.0 and any("per row" in n for n in fit.notes)
    assert fit.train.seconds(320) == pytest.approx(0.2 / 3, abs=0.002)
    measured = calibrate.measured(tmp_path).median_step_s
    assert engine.simulate(fit.loop()).median_step_s == pytest.approx(measured, rel=0.03)
    alone = engine.simulate(fit.loop(host_load=0.0)).median_step_s
    assert alone == pytest.approx((0.3 + 0.01 + 0.2) / 3, rel=0.03)  # generate, score, train at full speed


def test_the_loop_reads_the_run_flags_the_controller_records():
    """``RUN_FLAGS`` names ``Loop`` fields after the configuration a run records: a flag
    renamed in the configs fails here rather than the simulator falling back to a default."""
    from llamarl.app.config import GeneratorConfig, TrainerConfig

    recorded = {f.name for c in (TrainerConfig, GeneratorConfig) for f in fields(c)}
    recorded |= {"num_generators", "num_reward", "trainer_ranks"}  # the controller's _config_dict
    assert set(calibrate.RUN_FLAGS) <= recorded
    assert set(calibrate.RUN_FLAGS.values()) <= {f.name for f in fields(Loop)}


def test_an_auto_bound_run_is_simulated_at_the_bound_it_held_longest(tmp_path):
    write_run(tmp_path / "auto", gen_s=0.3, train_s=0.2, sync_s=0.05, score_s=0.01, bounds=[1, 2, 2, 2, 3] + [2] * 7)
    fit = calibrate.from_run(tmp_path / "auto")
    assert fit.loop().max_staleness == 2
    assert any("auto: simulated at 2" in n and "from 1 to 3" in n for n in fit.notes)
    write_run(tmp_path / "silent", gen_s=0.3, train_s=0.2, sync_s=0.05, score_s=0.01, bounds=[])
    with pytest.raises(ValueError, match="recorded no staleness/bound"):
        calibrate.from_run(tmp_path / "silent")


def test_from_run_refuses_a_directory_without_a_database(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.db"):
        calibrate.from_run(tmp_path)


# --------------------------------------------------------------------------- specs and the CLI

def test_spec_builds_the_loop_and_refuses_unknown_fields(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"name": "t", "model_params_b": 8, "gpus": 16, "trainer_gpus": 8,
                                "gpus_per_generator": 2, "sync_bytes_per_s": 1e9, "prompts_per_step": 8}))
    loop = spec.load(path).loop()
    assert loop.generators == 4 and loop.trainer_ranks == 8 and loop.gen_batch_prompts == 2
    assert loop.sync.seconds(senders=8, receivers=4) == pytest.approx(16e9 / 8 / 1e9)
    path.write_text(json.dumps({"model_params_b": 8, "gpu_count": 16}))
    with pytest.raises(ValueError, match="gpu_count"):
        spec.load(path)


def test_cli_predicts_a_run_and_writes_what_if(tmp_path, capsys):
    write_run(tmp_path / "run", gen_s=0.3, train_s=0.2, sync_s=0.05, score_s=0.01)
    out = tmp_path / "sim.json"
    sim_cli.main(["--from-run", str(tmp_path / "run"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["report"]["median_step_s"] == pytest.approx(0.56, rel=0.03)
    cases = {c["case"]: c for c in report["what_if"]}
    assert cases["max_staleness 1"]["median_step_s"] < cases["as run"]["median_step_s"]
    assert "median step time" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sim_cli.main(["--from-run", str(tmp_path / "run"), "--spec", "x.json"])
