"""dh.process_group and the backend choice: real gloo groups on loopback; GPU cases skip here."""

import os

import pytest
import rank_fns

import ddp_helpers as dh

needs_two_gpus = pytest.mark.skipif(dh.gpu_count() < 2, reason="needs two CUDA GPUs")


def test_auto_is_gloo_on_cpu_with_a_reason():
    if dh.gpu_count():
        pytest.skip("this machine has GPUs")
    backend, device, why = dh.choose_backend("auto", 2)
    assert (backend, device) == ("gloo", "cpu")
    assert "no CUDA GPU" in why


def test_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'ncl': choose one of auto, gloo"):
        dh.choose_backend("ncl", 2)


def test_nccl_without_enough_gpus_is_refused_before_launch():
    if dh.gpu_count() >= 2:
        pytest.skip("this machine has two GPUs")
    with pytest.raises(ValueError, match="needs one CUDA GPU per rank: 2 ranks"):
        dh.launch(rank_fns.backend_seen, args=(2,), nprocs=2, timeout=30, backend="nccl")


def test_process_group_says_what_it_chose(capsys, no_leftovers):
    dh.launch(rank_fns.all_reduce_sum, args=(2,), nprocs=2, timeout=60)
    assert capsys.readouterr().out == ""  # verbose=False in that function
    dh.launch(rank_fns.backend_seen_verbose, args=(2,), nprocs=2, timeout=60)
    out = capsys.readouterr().out
    assert out.count("process group:") == 1  # one line, from rank 0
    assert "[rank 0] process group: gloo on cpu, 2 ranks" in out


def test_process_group_outside_a_launcher_says_how_to_start(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="rank 0: MASTER_ADDR and MASTER_PORT not set"):
        with dh.process_group(0, 1):
            pass


def test_rank_zero_first_orders_the_ranks(no_leftovers):
    order = dh.launch(rank_fns.rank_zero_first_order, args=(2,), nprocs=2, timeout=60)
    assert order[0] < order[1]  # rank 0 finished its block before rank 1 started its own


@needs_two_gpus
@pytest.mark.gpu
def test_auto_picks_nccl_with_one_gpu_per_rank(no_leftovers):
    assert dh.choose_backend("auto", 2)[:2] == ("nccl", "cuda")
    assert dh.launch(rank_fns.backend_seen, args=(2,), nprocs=2, timeout=120) == ["nccl"] * 2


@needs_two_gpus
@pytest.mark.gpu
def test_each_rank_is_set_to_its_own_gpu(no_leftovers):
    assert dh.launch(rank_fns.current_cuda_device, args=(2,), nprocs=2, timeout=120) == [0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(dh.gpu_count() != 1, reason="needs exactly one GPU")
def test_one_gpu_two_ranks_shares_it_over_gloo(no_leftovers):
    assert dh.choose_backend("auto", 2)[:2] == ("gloo", "cuda")
    assert dh.launch(rank_fns.backend_seen, args=(2,), nprocs=2, timeout=120) == ["gloo"] * 2


def test_cpu_ranks_split_the_cores_between_them(monkeypatch, no_leftovers):
    if dh.gpu_count():
        pytest.skip("GPU ranks keep torch's default threads")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert dh.launch(rank_fns.threads_in_group, args=(2,), nprocs=2, timeout=60) == [expected] * 2
