"""Lesson 06 on real gloo ranks: gradient sync keeps the ranks identical, no sync lets them drift,
averaging every k resets the drift with one all-reduce per tensor, a split by label makes no sync
fail; the ring model and its fit; the exercises' checks pass the solutions and fail wrong ones
(average_parameters' check on ranks: tests/test_exercise_gradient_sync_effects.py)."""

from dataclasses import replace

import pytest
import torch
from mnist_shared import offline_source

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import gradient_sync_effects as lesson


@pytest.fixture(scope="module")
def source():
    return offline_source()


@pytest.fixture(scope="module")
def cfg(source):
    return lesson.SyncConfig(source=source, steps=30, lr=0.01, train_subset=3_000)


def run(nprocs, *args):
    return dh.launch(lesson.train_with_sync, args=(nprocs, *args), nprocs=nprocs, timeout=120,
                     output="none")


def test_ddp_keeps_parameters_exactly_equal_with_one_all_reduce_per_step(cfg):
    r0, r1 = run(2, cfg)
    gap = lesson.param_distance([r0, r1])
    assert len(gap) == cfg.steps + 1
    assert gap.max().item() == 0.0  # exactly: both ranks apply the same all-reduced gradient
    assert torch.equal(r0["params"], r1["params"])
    assert not torch.equal(r0["params"][-1], r0["params"][0])  # it did train
    assert r0["loss"] != r1["loss"]  # on different batches: the same split as without sync
    assert r0["allreduce_bytes"] == [31_400] * cfg.steps  # one bucket: all 7,850 gradients
    # 1,500 images a rank: an epoch is 23 batches of 64 and one of 28, so 30 steps see the
    # whole shard once, then 6 batches of 64 (not 30 x 64: the short batch counts as it is)
    assert r0["samples_seen"] == 1_500 + 6 * 64


def test_without_sync_the_ranks_drift_apart_and_never_communicate(cfg):
    results = run(2, replace(cfg, sync="none"))
    gap = lesson.param_distance(results)
    assert gap[0].item() == 0.0  # the same start
    assert 0 < gap[1] < gap[10] < gap[-1]
    assert results[0]["allreduce_bytes"] == []


def test_averaging_every_k_steps_resets_the_distance_with_a_call_per_tensor(cfg):
    every = 7
    results = run(2, replace(cfg, sync="average", every=every))
    gap = lesson.param_distance(results)
    between = torch.cat([gap[s + 1:s + every] for s in range(0, cfg.steps, every)])
    assert gap[every::every].max().item() == 0.0
    assert between.min().item() > 0.0
    averages = cfg.steps // every  # 4
    assert results[0]["allreduce_bytes"] == [31_360, 40] * averages  # weight, then bias
    rows = lesson.traffic_rows({"average every 7 steps": results})
    assert "8 all-reduce calls in 30 steps" in rows[0] and "MB all-reduced per rank" in rows[0]


def test_split_by_label_gives_each_rank_its_digits_and_no_sync_fails(source):
    cfg = lesson.SyncConfig(source=source, steps=150, train_subset=12_000, split="by_label")
    alone = run(2, replace(cfg, sync="none"))
    averaged = run(2, replace(cfg, sync="average", every=10))
    synced = run(2, cfg)
    assert [r["digits"] for r in alone] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    # The numbers the notebook prints (seed 0, one thread per rank, the stand-in digits).
    assert [round(r["accuracy"], 3) for r in alone] == [0.468, 0.461]
    assert [round(r["accuracy"], 3) for r in averaged] == [0.840, 0.840]
    assert [round(r["accuracy"], 3) for r in synced] == [0.848, 0.848]
    assert max(r["accuracy"] for r in alone) < 0.5 < min(r["accuracy"] for r in averaged)


def test_the_iid_runs_print_the_notebooks_numbers(source):
    base = lesson.SyncConfig(source=source, steps=150, train_subset=12_000)
    runs = {label: run(2, c) for label, c in lesson.sync_variants(base, every=10).items()}
    assert [round(r["accuracy"], 3) for r in runs["no sync"]] == [0.843, 0.846]
    assert [round(r["accuracy"], 3) for r in runs["DDP (sync every step)"]] == [0.848] * 2
    gap = lesson.param_distance(runs["average every 10 steps"])
    assert bool((gap[10::10] == 0).all())
    assert [len(r["allreduce_bytes"]) for r in (runs["no sync"][0],
                                                runs["average every 10 steps"][0],
                                                runs["DDP (sync every step)"][0])] == [0, 30, 150]


def test_summary_loss_is_the_last_ten_steps_mean_not_the_short_last_batch():
    losses = [5.0] * 20 + [1.0] * 9 + [10.0]  # a short last batch's outlier
    assert lesson.tail_loss(losses) == (9 * 1.0 + 10.0) / 10
    assert lesson.tail_loss([2.0, 4.0]) == 3.0  # fewer steps than the window: all of them
    results = [{"rank": r, "samples_seen": 640, "loss": losses, "accuracy": 0.5,
                "params": torch.zeros(2, 3)} for r in range(2)]
    line = lesson.run_summary(results)[0]
    assert "loss over the last 10 steps 1.900" in line and "10.000" not in line


def test_one_rank_and_four_ranks_run_and_say_their_backend(cfg):
    one = run(1, replace(cfg, steps=None))
    four = run(4, replace(cfg, steps=None))
    assert len(one[0]["loss"]) == 47 and len(four[0]["loss"]) == 12  # ceil(3000/n/64)
    assert lesson.param_distance(four).max().item() == 0.0
    assert {r["backend"] for r in four} == {"gloo"}
    rows = lesson.backend_rows([1, 4])
    assert rows[1].startswith("4 rank(s): gloo on cpu (")


@pytest.mark.parametrize(("gpus", "expected"), [
    (0, "gloo on cpu (no CUDA GPU visible"),
    (2, "gloo on cpu (4 ranks but 2 GPUs: NCCL needs one GPU per rank, so gloo on the CPU)"),
    (4, "nccl on cuda"),
])
def test_four_ranks_on_two_gpus_fall_back_to_gloo(gpus, expected):
    name, kind, why = dh.decide_backend("auto", 4, 4, gpus, ["gloo", "nccl"])
    assert f"{name} on {kind} ({why})".startswith(expected)


def test_bad_settings_are_refused_with_the_fix(cfg):
    with pytest.raises(ValueError, match="less than one batch of 256"):
        lesson.check_config(replace(cfg, batch_size=256, train_subset=400), 2)
    with pytest.raises(ValueError, match="choose one of ddp, none, average"):
        lesson.check_config(replace(cfg, sync="sometimes"), 2)
    with pytest.raises(ValueError, match="choose one of iid, by_label"):
        lesson.check_config(replace(cfg, split="sorted"), 2)


def test_bad_settings_raised_on_the_rank_name_it(cfg):
    with pytest.raises(dh.RankRaised, match="raised ValueError: every=0"):
        run(2, replace(cfg, sync="average", every=0))


def test_scaling_table_and_digits_per_rank(cfg):
    rows = lesson.effective_batch_rows(replace(cfg, lr=0.05, train_subset=12_000), [1, 2, 4])
    assert rows[1].split() == ["1", "64", "64", "188", "0.05", "0.05"]
    assert rows[3].split() == ["4", "64", "256", "47", "0.05", "0.2"]
    assert [n for n, _, _ in lesson.scaling_configs(cfg, [1, 2])] == [1, 2, 2]
    assert [lesson.digits_of(r, 4) for r in range(4)] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]


def test_ring_model_terms_and_fit():
    assert [lesson.latency_steps(n) for n in (2, 4, 8)] == [2, 6, 14]
    assert lesson.ring_factor(2) == 1.0 and lesson.ring_factor(4) == 1.5
    assert lesson.ring_seconds(1e6, 4, 1e-4, 1e9) == pytest.approx(6e-4 + 1.5e-3)
    points = [(n, b, lesson.ring_seconds(b, n, 5e-5, 2e9)) for n in (2, 4) for b in (1e4, 1e7)]
    alpha, bandwidth = lesson.fit_ring(points)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)
    # Oversubscribed 4-rank points, three times slower, must not move a fit on N=2.
    slow = [(n, b, 3 * s if n == 4 else s) for n, b, s in points]
    alpha, bandwidth = lesson.fit_ring_on(slow, world_size=2)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)
    assert lesson.fit_ring(slow)[0] > 1.1 * 5e-5  # while a fit over every point is dragged up



def _launch(seconds_by_n: dict[int, list[float]], numels=(1_000, 100_000)) -> list[list[dict]]:
    """What allreduce_times returns, one rank per world size, with given seconds."""
    return [[{"world_size": n, "numels": list(numels), "seconds": s}]
            for n, s in seconds_by_n.items()]


def test_cost_round_rows_print_each_launch_against_its_own_fit():
    exact = {n: [lesson.ring_seconds(4.0 * m, n, 5e-5, 2e9) for m in (1_000, 100_000)]
             for n in (2, 4)}
    twice = {n: [2 * s for s in times] for n, times in exact.items()}
    rows = lesson.cost_round_rows([_launch(exact), _launch(twice)])
    # Twice as slow everywhere: alpha doubles and B halves, and every ratio stays 1.
    assert rows[0] == ("fit on the 2-rank points, 2 launches: alpha 50-100 us per step, "
                       "B 1.00-2.00 GB/s")
    assert len(rows) == 5 and all(r.endswith("measured / model 1.00-1.00") for r in rows[1:])
    assert rows[3].startswith("N=4,   0.004 MB: measured ")


def test_slower_on_more_ranks_needs_every_size_in_every_launch():
    fast, slow = [1.0, 2.0], [1.5, 3.0]
    assert lesson.slower_on_more_ranks([_launch({2: fast, 4: slow}), _launch({2: fast, 4: slow})])
    assert not lesson.slower_on_more_ranks([_launch({2: fast, 4: slow}),
                                            _launch({2: fast, 4: [1.5, 2.0]})])

def test_allreduce_times_on_gloo_for_two_and_four_ranks():
    numels = [1_000, 100_000]
    timed = [dh.launch(lesson.allreduce_times, args=(n, numels, 3), nprocs=n, timeout=120,
                       output="none", backend="gloo") for n in (2, 4)]
    points = lesson.cost_points(timed)
    assert [(n, b) for n, b, _ in points] == [(2, 4e3), (2, 4e5), (4, 4e3), (4, 4e5)]
    assert all(s > 0 for _, _, s in points)
    lesson.fit_ring(points)  # real timings go through the fit (its arithmetic: the test above)


def test_counting_all_reduce_leaves_dist_all_reduce_alone():
    # The ledger counts at torch's dispatch: nothing is patched, so an import alias is seen too.
    real = torch.distributed.all_reduce
    with lesson.counting_all_reduce() as calls:
        assert torch.distributed.all_reduce is real
    assert calls == []


# ---------------------------------------------------------------- exercises


def _module(text: str):
    import types

    module = types.ModuleType("attempt")
    exec(compile(text, "attempt.py", "exec"), module.__dict__)
    return module


def test_scaled_lr_and_allreduce_calls_checks():
    assert all(c.ok for c in lesson.check_scaled_lr(
        _module(exercises.solution_source("scaled_lr"))))
    wrong = _module("def scaled_lr(base_lr, base_batch, batch_per_rank, world_size):\n"
                    "    return base_lr * world_size\n")
    assert not all(c.ok for c in lesson.check_scaled_lr(wrong))
    assert exercises.evaluate("allreduce_calls", (40, 80)).outcome == "PASS"
    assert exercises.evaluate("allreduce_calls", (20, 20)).outcome == "FAIL"
    assert exercises.evaluate("allreduce_calls", (40, 40)).outcome == "FAIL"
    assert exercises.solution_module("allreduce_calls").answer == lesson.ALLREDUCE_CALLS
