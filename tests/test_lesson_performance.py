"""Lesson 07, first half: step phases, all-reduce bandwidth, scaling, the profiler's view."""

import os

import matplotlib
import pytest

import ddp_helpers as dh
from ddp_helpers.lessons import performance as perf
from ddp_helpers.plots import performance as perf_plots

matplotlib.use("Agg")


def test_models_have_the_documented_sizes():
    assert perf.parameter_count("seed") == 784 * 10 + 10
    assert perf.parameter_count("cnn") == 20490
    with pytest.raises(ValueError, match="unknown model 'mlp': choose one of seed, cnn"):
        perf.build_model("mlp")


def test_manual_mode_times_every_phase_of_every_step(no_leftovers):
    recs = dh.launch(perf.step_phases, args=(2, "seed", 4, 16, "manual"), nprocs=2,
                     output="none", timeout=120)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["mode"] == "manual" and r["buckets"] == 0  # no DDP, no comm hook
        for phase in perf.PHASES:
            assert len(r[phase]) == 4 and all(t >= 0 for t in r[phase])
        assert r["threads"] == max(1, os.cpu_count() // 2)  # cores shared between 2 ranks


def test_ddp_mode_counts_buckets(no_leftovers):
    seed = dh.launch(perf.step_phases, args=(2, "seed", 3, 16, "ddp"), nprocs=2, output="none",
                     timeout=120)
    cnn = dh.launch(perf.step_phases, args=(2, "cnn", 3, 16, "ddp", None, 0.0, 0.01), nprocs=2,
                    output="none", timeout=120)
    assert [r["buckets"] for r in seed] == [1, 1]  # 7,850 gradients fit one 25 MB bucket
    assert cnn[0]["buckets"] == cnn[1]["buckets"] >= 2  # a 10 kB cap splits the CNN's


def test_the_fast_rank_waits_for_the_slow_one(no_leftovers):
    recs = dh.launch(perf.step_phases, args=(2, "seed", 6, 16, "ddp", 1, 0.05), nprocs=2,
                     output="none", timeout=120)
    assert perf.waited_longest(recs) == 0
    medians = perf.phase_medians(recs)
    assert medians[1]["data"] > medians[0]["data"]  # rank 1 slept while loading


def test_step_phases_refuses_an_unknown_mode(no_leftovers):
    with pytest.raises(dh.RankRaised, match="rank 0: mode must be 'ddp' or 'manual'"):
        dh.launch(perf.step_phases, args=(2, "seed", 1, 8, "fast"), nprocs=2, output="none",
                  timeout=60)


def test_allreduce_sweep_and_bandwidths(no_leftovers):
    sizes = [1024, 65536]
    recs = dh.launch(perf.allreduce_sweep, args=(2, sizes, 2, 2), nprocs=2, output="none",
                     timeout=120)
    assert recs[0]["copy_seconds"] > 0 and recs[1]["copy_seconds"] is None  # rank 0 copies
    bw = perf.bandwidths(recs)
    assert bw["backend"] == "gloo" and bw["world_size"] == 2
    assert len(bw["seconds"]) == 2
    for i, size in enumerate(sizes):
        slowest = max(r["seconds"][i] for r in recs)
        assert bw["seconds"][i] == slowest
        assert bw["algbw"][i] == pytest.approx(size / slowest / 1e9)
        assert bw["busbw"][i] == pytest.approx(bw["algbw"][i] * perf.bus_factor(2))
    assert bw["copy_gbps"] > 0


@pytest.mark.parametrize("n, factor", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_factor_is_two_n_minus_one_over_n(n, factor):
    assert perf.bus_factor(n) == factor


def test_bus_bandwidth_solution_matches_bandwidths():
    from ddp_helpers.solutions.bus_bandwidth import bus_bandwidth

    recs = [{"world_size": 4, "sizes_bytes": [4096, 8192], "seconds": [1e-4, 3e-4],
             "backend": "gloo", "device": "cpu", "copy_bytes": 8192, "copy_seconds": 1e-6}
            for _ in range(4)]
    bw = perf.bandwidths(recs)
    assert [bus_bandwidth(s, t, 4) for s, t in zip([4096, 8192], [1e-4, 3e-4])] == \
        pytest.approx(bw["busbw"], rel=1e-12)
    assert bw["busbw"][0] == pytest.approx(4096 / 1e-4 / 1e9 * 1.5)


def test_throughput_on_one_and_two_ranks(no_leftovers):
    one = dh.launch(perf.train_throughput, args=(1, "seed", 3, 16, 1), nprocs=1, output="none",
                    timeout=120)
    two = dh.launch(perf.train_throughput, args=(2, "seed", 3, 16, 1), nprocs=2, output="none",
                    timeout=120)
    assert one[0]["samples"] == 48 and [r["samples"] for r in two] == [48, 48]
    assert [r["threads"] for r in one + two] == [1, 1, 1]  # one core per rank by default
    assert perf.throughput(two) == 96 / max(r["seconds"] for r in two)
    whole = dh.launch(perf.train_throughput, args=(1, "seed", 3, 16, 1, None), nprocs=1,
                      output="none", timeout=120)
    assert whole[0]["threads"] == os.cpu_count()  # threads=None: one rank takes every core


def test_throughput_and_efficiency_formulas():
    recs = [{"samples": 100, "seconds": 2.0}, {"samples": 100, "seconds": 4.0}]
    assert perf.throughput(recs) == 50.0  # the job ends when its slowest rank does
    assert perf.scaling_efficiency(150.0, 100.0, 2) == 0.75
    assert perf.scaling_efficiency(100.0, 100.0, 1) == 1.0


def test_profiler_sees_one_all_reduce_per_step(no_leftovers):
    recs = dh.launch(perf.profile_steps, args=(2, "seed", 2, 16), nprocs=2, output="none",
                     timeout=120)
    assert [r["all_reduce_calls"] for r in recs] == [2, 2]
    assert recs[0]["top"] and all(len(row) == 3 for row in recs[0]["top"])


def test_figures_have_fixed_sizes_and_legends():
    rec = {p: [0.001, 0.002] for p in perf.PHASES}
    bars = perf_plots.step_phase_bars({"a": [rec, rec], "b": [rec, rec]})
    assert tuple(bars.get_size_inches()) == (9.0, 4.0)
    assert bars.axes[0].get_legend() is not None
    bw = {"sizes_bytes": [1024, 2048], "algbw": [0.1, 0.2], "busbw": [0.1, 0.2],
          "copy_gbps": 5.0, "world_size": 2, "backend": "gloo", "device": "cpu"}
    assert len(perf_plots.bandwidth_plot(bw).axes) == 1
    scaling = perf_plots.scaling_plot({"seed": {1: 100.0, 2: 120.0}, "cnn": {1: 10.0, 2: 19.0}})
    assert len(scaling.axes) == 2 and all(ax.get_legend() for ax in scaling.axes)
