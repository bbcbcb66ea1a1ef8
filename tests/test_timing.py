"""dh.Timer, dh.Laps, dh.time_allreduce and the copy timers: real gloo ranks on loopback here;
the CUDA-event paths run where there is a GPU (make gpu-check)."""

import math
import time

import pytest
import timing_fns
import torch
from conftest import needs_two_gpus

import ddp_helpers as dh
from ddp_helpers import timing

needs_a_gpu = pytest.mark.skipif(dh.gpu_count() < 1, reason="needs a CUDA GPU")


def test_timer_measures_the_block_on_cpu():
    with dh.Timer("cpu") as t:
        time.sleep(0.01)
    assert t.seconds >= 0.01  # a lower bound: sleep never returns early


def test_timer_read_before_stop_says_what_to_do():
    t = dh.Timer("cpu").start()
    with pytest.raises(RuntimeError, match="read before stop"):
        _ = t.seconds
    with pytest.raises(RuntimeError, match=r"stop\(\) before start\(\)"):
        dh.Timer().stop()


def test_laps_name_the_time_up_to_each_mark():
    laps = dh.Laps("cpu")
    laps.mark("start")
    time.sleep(0.01)
    laps.mark("sleep")
    laps.mark("nothing")
    got = laps.seconds()
    assert list(got) == ["sleep", "nothing"]
    assert got["sleep"] >= 0.01 and got["nothing"] >= 0


@pytest.mark.parametrize("value, text", [(None, "not measured"), (math.nan, "not measured"),
                                         (0.0123, "12.3 ms"), (4.56, "4.56 s")])
def test_format_seconds_never_invents_a_zero(value, text):
    assert dh.format_seconds(value) == text


def test_median_seconds_runs_warmup_then_iters_times_trials():
    calls = []
    timing.median_seconds(lambda: calls.append(1), "cpu", iters=3, trials=4, warmup=2)
    assert len(calls) == 2 + 3 * 4


def test_copy_seconds_on_cpu_is_positive():
    assert timing.copy_seconds(1 << 20, "cpu") > 0


def test_allreduce_hook_times_ddp_and_keeps_its_gradients(no_leftovers):
    records = dh.launch(timing_fns.timed_ddp_steps, args=(2,), nprocs=2, timeout=120,
                        output="none")
    for r in records:
        assert r["before"] is None  # read before any backward: not measured, not 0.0
        assert r["no_sync"] is None  # no all-reduce under no_sync: not measured either
        assert all(b >= 1 for b in r["buckets"])
        assert r["buckets"][-1] > 1  # after DDP rebuilt its buckets at bucket_cap_mb
        assert all(s > 0 for s in r["seconds"])
        for step, per_bucket in enumerate(r["bucket_seconds"]):
            assert len(per_bucket) == r["buckets"][step]
            # the union of the spans is at most their sum, and at least the longest
            assert max(per_bucket) <= r["seconds"][step] <= sum(per_bucket) + 1e-9
        assert r["max_grad_diff"] < 1e-6  # the hook averages exactly as DDP's own does


def test_hook_annotations_pass_ddps_check():
    # DDP refuses string annotations at registration; this file must not turn them into strings.
    hints = timing.timed_allreduce_hook.__annotations__
    assert hints["bucket"] is torch.distributed.GradBucket
    assert hints["return"] == torch.futures.Future[torch.Tensor]


# ---------------------------------------------------------------- GPU: CUDA events


@pytest.mark.gpu
@needs_a_gpu
def test_timer_and_laps_use_cuda_events_on_a_gpu(no_leftovers):
    r = dh.launch(timing_fns.timer_on_device, args=(1,), nprocs=1, timeout=120,
                  output="none")[0]
    assert r["device"] == "cuda:0"
    assert r["timer"] > 0 and list(r["laps"]) == ["matmul", "all_reduce"]


@pytest.mark.gpu
@needs_a_gpu
def test_allreduce_hook_with_nccl_on_one_gpu(no_leftovers):
    r = dh.launch(timing_fns.timed_ddp_steps, args=(1,), nprocs=1, timeout=120,
                  output="none")[0]
    assert r["device"] == "cuda:0"
    assert r["before"] is None and r["no_sync"] is None
    assert all(s is not None and s > 0 for s in r["seconds"])
    assert r["max_grad_diff"] < 1e-6


@pytest.mark.gpu
@needs_a_gpu
def test_allreduce_hook_with_gloo_ranks_sharing_a_gpu(no_leftovers):
    records = dh.launch(timing_fns.timed_ddp_steps, args=(2, "cuda"), nprocs=2, timeout=120,
                        output="none", backend="gloo")
    assert [r["device"] for r in records] == [f"cuda:{r % dh.gpu_count()}" for r in range(2)]
    assert all(s > 0 for r in records for s in r["seconds"])
    assert max(r["max_grad_diff"] for r in records) < 1e-6


@pytest.mark.gpu
@needs_a_gpu
def test_host_to_gpu_copies_pinned_and_pageable():
    pageable = timing.copy_seconds(64 << 20, "cpu", "cuda:0")
    pinned = timing.copy_seconds(64 << 20, "cpu", "cuda:0", pinned=True)
    on_gpu = timing.copy_seconds(64 << 20, "cuda:0")
    assert pageable > 0 and pinned > 0 and on_gpu > 0


@pytest.mark.gpu
@needs_a_gpu
def test_pinned_copy_really_is_pinned_and_asynchronous():
    host = torch.ones(1 << 20, pin_memory=True)
    assert host.is_pinned()
    with dh.Timer("cuda:0") as t:
        on_gpu = host.to("cuda:0", non_blocking=True)
    assert t.seconds > 0 and on_gpu.sum().item() == host.numel()


@pytest.mark.gpu
@needs_two_gpus
def test_link_copy_between_two_gpus():
    assert timing.copy_seconds(64 << 20, "cuda:0", "cuda:1") > 0
    assert isinstance(timing.peer_access(0, 1), bool)
