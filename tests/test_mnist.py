"""The seed's MNIST exercise: real ranks through dh.launch (gloo, loopback), the command line,
torchrun on one machine and as two "nodes", and the GPU paths (skipped without two GPUs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import needs_two_gpus
from mnist_shared import offline_source

import ddp_helpers as dh
from ddp_helpers import data, training
from ddp_helpers.lessons import mnist_two_gpus as mnist
from ddp_helpers.mnist import parse_args

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def source() -> data.DataSource:
    return offline_source()


def run(variant: str, cfg: mnist.MnistConfig, **kw) -> list[dict]:
    cfg = replace(cfg, port=dh.free_port())  # the faithful listing's port: a free one in tests
    return dh.launch(mnist.VARIANTS[variant], args=(2, cfg), nprocs=2, timeout=300,
                     output="none", **kw)


def test_sampler_fix_and_fast_path_train_identically(source):
    cfg = mnist.MnistConfig(source=source, train_subset=1280, num_workers=0)
    fixed, fast = run("fixed", cfg), run("memory", cfg)
    for a, b in zip(fixed, fast, strict=True):
        assert a["loss"] == b["loss"]  # same samples, same order, same arithmetic: bit for bit
        assert torch.equal(a["indices"], b["indices"])
        assert a["param_digest"] == b["param_digest"] and a["accuracy"] == b["accuracy"]
    assert len(fast[0]["loss"]) == 10 and fast[0]["samples_seen"] == 640


def test_faithful_listing_walks_all_data_on_every_rank_in_the_same_order(source):
    cfg = mnist.MnistConfig(source=source, train_subset=1280)  # the listing's 2 workers
    faithful = run("faithful", cfg)
    fixed = run("fixed", mnist.MnistConfig(source=source, train_subset=1280, num_workers=0))
    assert [r["samples_seen"] for r in faithful] == [1280, 1280]  # not "its subset"
    # Same seed on every rank, so the same shuffle: two ranks doing identical work.
    assert torch.equal(faithful[0]["labels"], faithful[1]["labels"])
    assert faithful[0]["loss"] == faithful[1]["loss"]
    assert faithful[0]["indices"] is None  # shuffle=True cannot say its order in advance
    assert [r["samples_seen"] for r in fixed] == [640, 640]
    shards = [set(r["indices"].tolist()) for r in fixed]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(1280))


def test_records_checkpoint_and_reload(source, tmp_path):
    ckpt = tmp_path / "ckpt" / "model.pt"
    cfg = mnist.MnistConfig(source=source, train_subset=640, epochs=2, checkpoint=str(ckpt))
    results = run("memory", cfg)
    r0, r1 = results
    assert r0["param_digest"] == r1["param_digest"] and r0["param_sum"] == r1["param_sum"]
    assert len(r0["loss"]) == len(r0["data_s"]) == len(r0["sync_s"]) == 10  # 2 epochs x 5
    assert r0["epochs"] == [0, 1] and r0["steps_per_epoch"] == [5, 5]
    assert all(s > 0 for s in r0["sync_s"])  # measured on CPU (a number, not NaN)
    assert r0["reloaded_accuracy"] == r0["accuracy"] == r1["accuracy"]
    epoch0, epoch1 = r0["indices"][:320], r0["indices"][320:]
    assert not torch.equal(epoch0, epoch1)  # set_epoch reshuffled
    assert ckpt.is_file() and not list(ckpt.parent.glob(".*.tmp"))  # renamed into place
    model = mnist.load_checkpoint(ckpt, "linear", "cpu")  # here, in the parent: no group
    x, y = data.mnist_tensors(source, train=False)
    assert training.evaluate(model, x, y, 0, 1) == r0["accuracy"]
    assert "offline stand-in" in r0["data"]


def test_without_a_source_the_ranks_find_the_data_themselves(source, monkeypatch):
    monkeypatch.setenv(data.ROOT_ENV, source.root)  # prepare_data's default root, on the ranks
    cfg = mnist.MnistConfig(train_subset=640, gather=True)
    results = run("memory", cfg)
    assert results[1] is None and len(results[0]) == 2  # rank 0 gathered every rank's records
    assert results[0][0]["param_digest"] == results[0][1]["param_digest"]
    assert "offline stand-in" in results[0][0]["data"]


def test_cli_rejects_faithful_with_memory(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--faithful", "--memory"])
    assert "drop --memory" in capsys.readouterr().err
    assert parse_args(["--loader"]).variant == "fixed"
    assert parse_args([]).variant == "memory"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env[data.OFFLINE_ENV] = "1"  # tests never touch the internet
    return env


def _logs(tmp_path: Path) -> list[str]:
    """torchrun's --log-dir in the test's folder: without one, each agent leaves a
    /tmp/torchelastic_* folder behind."""
    return ["--log-dir", str(tmp_path / "torchrun_logs")]


def _accuracy(text: str) -> float:
    found = re.findall(r"final test accuracy: ([0-9.]+)", text)
    assert len(found) == 1, text
    return float(found[0])


@pytest.mark.slow
def test_cli_one_epoch_reaches_mnist_like_accuracy(source, tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ddp_helpers.mnist", "--nprocs", "2", "--epochs",
                        "1", "--data-root", source.root, "--out", str(out)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "data: offline stand-in digits" in p.stdout
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: epoch 1 step 469/469" in p.stdout
    assert 0.80 <= _accuracy(p.stdout) <= 0.95  # learns like MNIST: not trivial, not broken
    assert "reloaded with map_location: accuracy" in p.stdout and "(the same)" in p.stdout
    assert (out / "loss_per_rank.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_under_torchrun(source, tmp_path):
    out = tmp_path / "run"
    # --standalone: torchrun binds a free port itself (a port picked here could be taken by
    # another process before torchrun binds it)
    p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *_logs(tmp_path),
                        "-m", "ddp_helpers.mnist", "--train-subset", "1280", "--num-workers", "0",
                        "--data-root", source.root, "--out", str(out)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "under torchrun: 2 ranks" in text
    assert "rank 0: epoch 1 step 10/10" in text and "rank 1: epoch 1 step 10/10" in text
    assert "parameters identical on every rank (DDP kept them in step): yes" in text
    assert 0 < _accuracy(text) <= 1
    assert (out / "loss_per_rank.png").is_file()


@pytest.mark.slow
def test_cli_as_two_torchrun_nodes_on_one_machine(source, tmp_path):
    port = dh.free_port()
    common = [*_logs(tmp_path), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}",
              "-m", "ddp_helpers.mnist", "--train-subset", "1280", "--num-workers", "0",
              "--data-root", source.root, "--out", str(tmp_path / "run")]
    nodes = [subprocess.Popen([TORCHRUN, "--node-rank", str(n), *common], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    texts = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(texts)
    both = "\n".join(texts)
    assert "rank 0: epoch 1 step 10/10" in both and "rank 1: epoch 1 step 10/10" in both
    assert 0 < _accuracy(both) <= 1  # printed once, by global rank 0
    assert (tmp_path / "run" / "loss_per_rank.png").is_file()


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_fast_path_with_nccl(source):
    cfg = mnist.MnistConfig(source=source, train_subset=1280)
    results = run("memory", cfg, backend="nccl")
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]  # data and model on the GPU
    assert results[0]["param_digest"] == results[1]["param_digest"]
    for r in results:  # CUDA events in the comm hook: measured, never a made-up 0 or NaN
        assert r["allreduces"] == [1] * len(r["loss"]) and all(s > 0 for s in r["sync_s"])
        assert "not measured" not in mnist.time_rows("nccl", [r])[0]


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_listing_with_pinned_memory_and_checkpoint_on_other_gpu(source, tmp_path):
    ckpt = tmp_path / "model.pt"
    cfg = mnist.MnistConfig(source=source, train_subset=1280, checkpoint=str(ckpt))
    fixed = run("fixed", cfg, backend="nccl")
    fast = run("memory", mnist.MnistConfig(source=source, train_subset=1280), backend="nccl")
    faithful = run("faithful", mnist.MnistConfig(source=source, train_subset=1280),
                   backend="nccl")  # cuda:{rank}, device_ids=[rank]: fine on one machine
    assert [r["device"] for r in faithful] == ["cuda:0", "cuda:1"]
    assert faithful[0]["param_digest"] == faithful[1]["param_digest"]
    # Rank 1 reloaded rank 0's cuda:0 checkpoint onto cuda:1 through map_location.
    assert fixed[1]["reloaded_accuracy"] == fixed[1]["accuracy"]
    assert abs(fixed[0]["accuracy"] - fast[0]["accuracy"]) < 0.01
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert set(saved) == {"1.weight", "1.bias"}  # model.module's keys: no "module." prefix
