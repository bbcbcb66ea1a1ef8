"""Lessons 05-06: gradient sync keeps the ranks identical, no sync lets them drift (real gloo)."""

from dataclasses import replace

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons import grad_sync as gs
from ddp_helpers.lessons import mnist_lesson
from ddp_helpers.solutions.average_parameters import average_parameters
from ddp_helpers.solutions.scaled_lr import scaled_lr


@pytest.fixture(scope="module")
def source():
    return data.prepare_data(verbose=False)


@pytest.fixture(scope="module")
def cfg(source):
    return gs.SyncConfig(source=source, steps=30, lr=0.01, train_subset=3_000)


def run(fn, nprocs, *args):
    return dh.launch(fn, args=(nprocs, *args), nprocs=nprocs, timeout=120, output="none")


def test_ddp_keeps_parameters_exactly_equal(cfg, no_leftovers):
    r0, r1 = run(gs.train_with_sync, 2, cfg)
    gap = gs.param_distance([r0, r1])
    assert len(gap) == cfg.steps + 1
    assert gap.max().item() == 0.0  # exactly: both ranks apply the same all-reduced gradient
    assert torch.equal(r0["params"], r1["params"])
    assert not torch.equal(r0["params"][-1], r0["params"][0])  # it did train
    assert r0["loss"] != r1["loss"]  # on different batches: the same split as without sync


def test_without_sync_the_ranks_drift_apart(cfg, no_leftovers):
    results = run(gs.train_with_sync, 2, replace(cfg, sync="none"))
    gap = gs.param_distance(results)
    assert gap[0].item() == 0.0  # the same start
    assert 0 < gap[1] < gap[10] < gap[-1]
    synced = run(gs.train_with_sync, 2, cfg)
    assert results[0]["loss"][0] == synced[0]["loss"][0]  # same first batch, same start


def test_averaging_every_k_steps_resets_the_distance(cfg, no_leftovers):
    every = 7
    results = run(gs.train_with_sync, 2, replace(cfg, sync="average", every=every))
    gap = gs.param_distance(results)
    at_average = gap[every::every]
    between = torch.cat([gap[s + 1:s + every] for s in range(0, cfg.steps, every)])
    assert at_average.max().item() == 0.0
    assert between.min().item() > 0.0


def test_average_parameters_solution_matches_kit(cfg, no_leftovers):
    every_5 = replace(cfg, sync="average", every=5, steps=10)
    kit = run(gs.train_with_sync, 2, every_5)
    mine = run(gs.train_with_sync, 2, every_5, average_parameters)
    assert torch.equal(kit[0]["params"], mine[0]["params"])


def test_one_rank_and_four_ranks_run(cfg, no_leftovers):
    one = run(gs.train_with_sync, 1, replace(cfg, steps=None))
    four = run(gs.train_with_sync, 4, replace(cfg, steps=None))
    assert len(one[0]["loss"]) == 47 and len(four[0]["loss"]) == 12  # ceil(3000/n/64)
    assert gs.param_distance(one).max().item() == 0.0
    assert gs.param_distance(four).max().item() == 0.0


def test_bad_settings_are_refused_with_the_fix(cfg):
    with pytest.raises(ValueError, match="less than one batch of 256"):
        gs.check_config(replace(cfg, batch_size=256, train_subset=400), 2)
    with pytest.raises(ValueError, match="choose one of ddp, none, average"):
        gs.check_config(replace(cfg, sync="sometimes"), 2)


def test_bad_settings_raised_on_the_rank_name_it(cfg, no_leftovers):
    with pytest.raises(dh.RankRaised, match="raised ValueError: every=0"):
        run(gs.train_with_sync, 2, replace(cfg, sync="average", every=0))


def test_scaling_table_and_rule(cfg):
    rows = gs.effective_batch_rows(replace(cfg, lr=0.05, train_subset=12_000), [1, 2, 4])
    assert rows[1].split() == ["1", "64", "64", "188", "0.05", "0.05"]
    assert rows[3].split() == ["4", "64", "256", "47", "0.05", "0.2"]
    assert [n for n, _, _ in gs.scaling_configs(cfg, [1, 2])] == [1, 2, 2]
    assert scaled_lr(0.05, 64, 64, 4) == pytest.approx(0.2)
    assert scaled_lr(0.1, 256, 32, 2) == pytest.approx(0.025)


def test_allreduce_times_and_the_cost_model(no_leftovers):
    numels = [1_000, 100_000]
    results = run(gs.allreduce_times, 2, numels, 3)
    assert [r["numels"] for r in results] == [numels, numels]
    assert all(s > 0 for r in results for s in r["seconds"])
    assert gs.ring_factor(2) == 1.0 and gs.ring_factor(4) == 1.5
    nbytes = [1e3, 1e5, 1e7]
    times = [gs.alpha_beta_seconds(b, 4, 5e-5, 2e9) for b in nbytes]
    alpha, bandwidth = gs.fit_alpha_beta(nbytes, times, 4)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_listing_loader_gives_every_rank_the_whole_set(source, no_leftovers):
    without = run(mnist_lesson.samples_per_epoch, 2, source, False)
    with_ = run(mnist_lesson.samples_per_epoch, 2, source, True)
    assert [r["samples"] for r in without] == [60_000, 60_000]
    assert [r["samples"] for r in with_] == [30_000, 30_000]
    assert [r["batches"] for r in with_] == [469, 469]
