"""dh.process_group and the backend choice: the decision table with faked GPU counts, real gloo
groups on loopback; the GPU cases run where there are GPUs (make gpu-check)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import rank_fns
import timing_fns
import torch
from conftest import needs_two_gpus

import ddp_helpers as dh

needs_a_gpu = pytest.mark.skipif(dh.gpu_count() < 1, reason="needs a CUDA GPU")
one_gpu = pytest.mark.skipif(dh.gpu_count() != 1, reason="needs exactly one GPU")
no_gpu = pytest.mark.skipif(dh.gpu_count() > 0, reason="checks the CPU-only machine")
BOTH = ("gloo", "nccl")

# ---------------------------------------------------------------- the decision, counts faked

DECISIONS = [  # backend asked, local ranks, GPUs, device asked -> backend, device, reason
    ("auto", 2, 0, None, "gloo", "cpu", "no CUDA GPU visible, so gloo on the CPU"),
    ("auto", 2, 1, None, "gloo", "cpu",
     "2 ranks but 1 GPU: NCCL needs one GPU per rank, so gloo on the CPU"),
    ("auto", 2, 2, None, "nccl", "cuda", "2 GPUs for 2 ranks on this machine: one GPU each"),
    ("auto", 2, 8, None, "nccl", "cuda", "8 GPUs for 2 ranks on this machine: one GPU each"),
    ("auto", 1, 1, None, "nccl", "cuda", "1 GPU for 1 rank on this machine: one GPU each"),
    ("auto", 4, 2, None, "gloo", "cpu",
     "4 ranks but 2 GPUs: NCCL needs one GPU per rank, so gloo on the CPU"),
    ("auto", 2, 1, "cuda", "gloo", "cuda", "asked for CUDA tensors; 2 ranks but 1 GPU: NCCL "
     "needs one GPU per rank, so gloo with the ranks' CUDA tensors on 1 GPU"),
    ("auto", 2, 2, "cuda", "nccl", "cuda", "2 GPUs for 2 ranks on this machine: one GPU each"),
    ("auto", 2, 2, "cpu", "gloo", "cpu", "asked for the CPU, so gloo (NCCL moves CUDA tensors "
     "only)"),
    ("gloo", 2, 0, None, "gloo", "cpu", "asked for gloo"),
    ("gloo", 2, 2, None, "gloo", "cpu", "asked for gloo, CPU tensors (device='cuda' puts them "
     "on the GPU)"),
    ("gloo", 2, 1, "cuda", "gloo", "cuda", "asked for gloo with CUDA tensors: 2 ranks on 1 "
     "GPU"),
    ("nccl", 2, 2, None, "nccl", "cuda", "asked for NCCL; 2 GPUs for 2 ranks: one GPU each"),
    ("nccl", 1, 1, "cuda", "nccl", "cuda", "asked for NCCL; 1 GPU for 1 rank: one GPU each"),
]


@pytest.mark.parametrize("asked, local, gpus, device, backend, kind, why", DECISIONS)
def test_decision_table(asked, local, gpus, device, backend, kind, why):
    assert dh.decide_backend(asked, 8, local, gpus, BOTH, device) == (backend, kind, why)


REFUSALS = [  # backend asked, local ranks, GPUs, device asked, available -> message
    ("nccl", 2, 1, None, BOTH, r"needs one CUDA GPU per rank: 2 ranks on this machine but 1 "
     r"GPU\(s\) visible. Use backend='gloo' \(or 'auto', which picks gloo here\), or at most 1"),
    ("nccl", 2, 0, None, BOTH, r"needs one CUDA GPU per rank: 2 ranks .* 0 GPU\(s\)"),
    ("nccl", 2, 2, "cpu", BOTH, "NCCL moves CUDA tensors only. Use backend='gloo'"),
    ("gloo", 2, 0, "cuda", BOTH, "device='cuda' with gloo, but no CUDA GPU is visible"),
    ("auto", 2, 0, "cuda", BOTH, "device='cuda' with gloo, but no CUDA GPU is visible"),
    ("auto", 2, 2, "cuda:1", BOTH, r"device='cuda:1': use None .* index comes from the local"),
    ("nccl", 1, 1, None, ("gloo",), "backend 'nccl' is not in this build of torch .* gloo"),
    ("ncl", 1, 1, None, BOTH, "unknown backend 'ncl': choose one of auto, gloo"),
]


@pytest.mark.parametrize("asked, local, gpus, device, available, message", REFUSALS)
def test_refusals_name_the_fix(asked, local, gpus, device, available, message):
    with pytest.raises(ValueError, match=message):
        dh.decide_backend(asked, 2, local, gpus, available, device)


def test_auto_without_nccl_in_this_torch_is_gloo_on_cpu():
    assert dh.decide_backend("auto", 2, 2, 2, ("gloo",)) == (
        "gloo", "cpu", "2 GPUs but this build of torch has no NCCL, so gloo on the CPU")


def test_a_group_smaller_than_the_launch_counts_only_its_own_ranks():
    # world_size 1 inside a two-rank launch: that group has one rank here, so one GPU is enough
    assert dh.decide_backend("auto", 1, 2, 1, BOTH)[:2] == ("nccl", "cuda")


def test_choose_backend_is_the_decision_with_this_machines_counts():
    assert dh.choose_backend("auto", 2) == dh.decide_backend(
        "auto", 2, 2, dh.gpu_count(), dh.available_backends())


def test_device_ids_for_ddp():
    assert dh.device_ids(torch.device("cpu")) is None
    assert dh.device_ids("cpu") is None
    assert dh.device_ids(torch.device("cuda", 1)) == [1]


# ---------------------------------------------------------------- real groups on this machine


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
    out = capsys.readouterr().out
    # verbose=False in that function; torch 2.9 and 2.10 print a line of their own at every init
    assert [ln for ln in out.splitlines() if "[Gloo] Rank" not in ln] == []
    dh.launch(rank_fns.backend_seen_verbose, args=(2,), nprocs=2, timeout=60)
    out = capsys.readouterr().out
    assert out.count("process group:") == 1  # one line, from rank 0
    name, kind, why = dh.choose_backend("auto", 2)  # gloo on cpu here, nccl on a two-GPU box
    assert f"[rank 0] process group: {name} on {kind}, 2 ranks ({why})" in out


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
@needs_two_gpus
def test_nccl_binds_each_rank_to_its_gpu_at_init(no_leftovers):
    records = dh.launch(timing_fns.group_device, args=(2,), nprocs=2, timeout=120)
    for r, rec in enumerate(records):
        assert (rec["backend"], rec["device"], rec["tensor_device"]) == ("nccl", f"cuda:{r}",
                                                                         f"cuda:{r}")
        assert rec["sum"] == 3.0 and rec["device_ids"] == [r]
        assert rec["bound"] in (None, f"cuda:{r}")  # device_id, where this torch reports it


@pytest.mark.gpu
@needs_a_gpu
def test_nccl_with_one_rank_on_one_gpu(no_leftovers):
    rec = dh.launch(timing_fns.group_device, args=(1,), nprocs=1, timeout=120)[0]
    assert (rec["backend"], rec["device"], rec["current"], rec["sum"]) == ("nccl", "cuda:0", 0,
                                                                          1.0)


@pytest.mark.gpu
@one_gpu
def test_one_gpu_two_ranks_is_gloo_on_the_cpu(no_leftovers):
    assert dh.choose_backend("auto", 2)[:2] == ("gloo", "cpu")  # CPU tensors: send/recv work
    records = dh.launch(timing_fns.group_device, args=(2,), nprocs=2, timeout=120)
    assert [(r["backend"], r["device"], r["sum"]) for r in records] == [("gloo", "cpu", 3.0)] * 2


@pytest.mark.gpu
@needs_a_gpu
def test_gloo_ranks_share_the_gpu_when_asked(no_leftovers):
    records = dh.launch(timing_fns.group_device, args=(2, "cuda"), nprocs=2, timeout=120,
                        backend="gloo")
    gpus = dh.gpu_count()
    assert [(r["backend"], r["tensor_device"], r["sum"]) for r in records] == [
        ("gloo", f"cuda:{r % gpus}", 3.0) for r in range(2)]
    assert [r["device_ids"] for r in records] == [[r % gpus] for r in range(2)]


@no_gpu
def test_cuda_without_a_gpu_is_refused_on_the_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")  # never reached: refused before init
    with pytest.raises(ValueError, match="rank 0: device='cuda' with gloo, but no CUDA GPU"):
        with dh.process_group(0, 1, verbose=False, device="cuda"):
            pass


@no_gpu
def test_gloo_ranks_on_cpu_by_default(no_leftovers):
    records = dh.launch(timing_fns.group_device, args=(2,), nprocs=2, timeout=60)
    assert [(r["backend"], r["device"], r["sum"], r["device_ids"]) for r in records] == [
        ("gloo", "cpu", 3.0, None)] * 2


def test_cpu_ranks_split_the_cores_between_them(monkeypatch, no_leftovers):
    if dh.choose_backend("auto", 2)[1] == "cuda":
        pytest.skip("GPU ranks keep torch's default threads")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert dh.launch(rank_fns.threads_in_group, args=(2,), nprocs=2, timeout=60) == [expected] * 2


@no_gpu
def test_gpu_check_without_a_gpu_says_so_and_succeeds():
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=repo, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "no GPU: nothing to check\n"), done.stderr
