"""Data: the offline stand-in, the download path (local server only), the in-memory fast path."""

from __future__ import annotations

import gzip
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mnist_shared import MirrorServer, offline_raw, offline_source
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision import transforms
from torchvision.datasets import MNIST

from ddp_helpers import data, digits

GZ = [f"{name}.gz" for pair in digits.FILES.values() for name in pair]
ROOT = Path(__file__).resolve().parents[1]
STANDIN_LINE = ("data: offline stand-in digits (MNIST's format and sizes, not MNIST): "
                "$DDP_HELPERS_STANDIN asks for it (the test command's setting, so that compared "
                "notebook outputs never depend on what a machine has downloaded)")


@pytest.fixture(scope="module")
def source() -> data.DataSource:
    return offline_source()


@pytest.fixture
def mirror_dir(tmp_path, source):
    """A folder laid out like a mirror (…/mnist/<file>.gz) holding MNIST-format files."""
    folder = tmp_path / "www" / "mnist"
    folder.mkdir(parents=True)
    for name in GZ:
        shutil.copy(offline_raw() / name, folder / name)
    return folder


@pytest.fixture
def online(monkeypatch):
    """Downloads allowed, but only ever from the test's own server (set per test)."""
    monkeypatch.delenv(data.OFFLINE_ENV, raising=False)
    monkeypatch.setenv(data.MIRROR_ENV, "http://127.0.0.1:9/unset/")


def test_offline_digits_have_mnist_format_and_sizes(source):
    train = data.OfflineDigits(source.root, train=True)
    test = data.OfflineDigits(source.root, train=False)
    assert isinstance(train, MNIST)  # one loader for both: torchvision's
    assert train.data.shape == (60_000, 28, 28) and train.data.dtype == torch.uint8
    assert test.data.shape == (10_000, 28, 28)
    assert sorted(train.targets.unique().tolist()) == list(range(10))
    assert np.bincount(train.targets.numpy()).min() > 5_000  # every digit well represented
    for name in GZ:  # the .gz files are the same bytes as the extracted ones torchvision reads
        raw = offline_raw()
        assert gzip.decompress((raw / name).read_bytes()) == (raw / name[:-3]).read_bytes()
    assert "offline stand-in" in source.describe() and "not MNIST" in source.describe()


def test_offline_digits_look_like_mnist(source):
    x = data.OfflineDigits(source.root, train=True).data[:5_000].float()
    assert 25 < x.mean() < 50  # MNIST: 33
    assert 0.7 < (x == 0).float().mean() < 0.85  # MNIST: 0.81 of the pixels are background
    border = torch.cat([x[:, :2, :].flatten(1), x[:, -2:, :].flatten(1)], 1)
    assert border.mean() < 5  # centred like MNIST: the margins are almost empty
    rows = (x.sum(2) * torch.arange(28.0)).sum(1) / x.sum((1, 2))
    assert abs(rows.mean() - 13.5) < 1  # centre of mass in the middle, as MNIST centres it
    assert (x.amax(dim=(1, 2)) >= 250).float().mean() > 0.95  # strokes saturate like pen ink


def test_generation_is_deterministic_and_seeded():
    a_img, a_lab = digits.generate(300, seed=7)
    b_img, b_lab = digits.generate(300, seed=7)
    c_img, _ = digits.generate(300, seed=8)
    assert np.array_equal(a_img, b_img) and np.array_equal(a_lab, b_lab)
    assert not np.array_equal(a_img, c_img)


def test_fast_path_tensors_equal_the_listing_transform_bit_for_bit(source):
    listing = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    ds = data.mnist_dataset(source, train=True, transform=listing)
    x, y = data.mnist_tensors(source, train=True)
    assert x.shape == (60_000, 1, 28, 28) and y.dtype == torch.int64
    for i in (0, 1, 12_345, 59_999):
        img, label = ds[i]
        assert torch.equal(img, x[i]) and label == y[i].item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_batches_match_distributed_sampler(world_size):
    n, batch = 1001, 64  # not divisible by 2 or 3: the sampler pads, so must we
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(n)
    seen = []
    for rank in range(world_size):
        fast = data.ShardedBatches(x, y, batch, rank, world_size)
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size, rank=rank)
        loader = DataLoader(TensorDataset(x, y), batch_size=batch, sampler=sampler)
        orders = []
        for epoch in (0, 1):
            fast.set_epoch(epoch)
            sampler.set_epoch(epoch)
            got = torch.cat([yb for _, yb in fast])
            want = torch.cat([yb for _, yb in loader])
            assert torch.equal(got, want), f"rank {rank} epoch {epoch}"
            assert torch.equal(fast.indices(), torch.tensor(list(sampler)))
            assert len(fast) == len(loader)
            orders.append(got)
        assert not torch.equal(orders[0], orders[1])  # set_epoch reshuffles
        seen.append(orders[1])
    assert set(torch.cat(seen).tolist()) == set(range(n))  # together the ranks cover everything


def test_sharded_batches_without_set_epoch_repeat_the_order():
    x, y = torch.zeros(100, 1), torch.arange(100)
    fast = data.ShardedBatches(x, y, 10, 0, 2)
    first = torch.cat([yb for _, yb in fast])
    assert torch.equal(first, torch.cat([yb for _, yb in fast]))


def test_download_from_local_mirror_once(tmp_path, mirror_dir, online, monkeypatch):
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        got = data.prepare_data(tmp_path / "data", download=True, verbose=False)
        assert got.kind == "mnist" and server.url in got.how
        assert sorted(server.requests) == sorted(f"/mnist/{name}" for name in GZ)
        again = data.prepare_data(tmp_path / "data", download=True, verbose=False)
        assert again.how == "found on disk" and len(server.requests) == len(GZ)  # no refetch
    mnist = MNIST(str(tmp_path / "data"), train=False)  # plain torchvision reads what we wrote
    assert torch.equal(mnist.data, data.OfflineDigits(offline_source().root, train=False).data)


def test_truncated_download_names_the_file_and_the_fix(tmp_path, mirror_dir, online,
                                                       monkeypatch):
    whole = (mirror_dir / "train-images-idx3-ubyte.gz").read_bytes()
    (mirror_dir / "train-images-idx3-ubyte.gz").write_bytes(whole[: len(whole) // 2])
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        with pytest.raises(data.MNISTFileError,
                           match=r"train-images-idx3-ubyte\.gz from http://127\.0\.0\.1.*"
                                 r"truncated or corrupt.*DDP_HELPERS_MNIST_MIRROR"):
            data.prepare_data(tmp_path / "data", download=True, verbose=False)
    assert not (tmp_path / "data" / "MNIST" / "raw").exists()  # nothing half-written


def test_corrupt_download_is_refused(tmp_path, mirror_dir, online, monkeypatch):
    gz = bytearray((mirror_dir / "t10k-labels-idx1-ubyte.gz").read_bytes())
    gz[len(gz) // 2] ^= 0xFF  # one flipped byte: gzip's CRC must catch it
    (mirror_dir / "t10k-labels-idx1-ubyte.gz").write_bytes(bytes(gz))
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        with pytest.raises(data.MNISTFileError, match=r"t10k-labels-idx1-ubyte\.gz.*corrupt"):
            data.prepare_data(tmp_path / "data", download=True, verbose=False)


def test_wrong_format_from_mirror_is_refused(tmp_path, mirror_dir, online, monkeypatch):
    labels = np.full(10_000, 12, dtype=np.uint8)  # right size, impossible labels
    (mirror_dir / "t10k-labels-idx1-ubyte.gz").write_bytes(
        digits.gzip_bytes(digits.idx_bytes(labels)))
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        with pytest.raises(data.MNISTFileError, match=r"not a valid MNIST file.*labels above 9"):
            data.prepare_data(tmp_path / "data", download=True, verbose=False)


def test_truncated_file_on_disk_names_the_file_and_the_fix(tmp_path, source):
    raw = tmp_path / "data" / "MNIST" / "raw"
    shutil.copytree(offline_raw(), raw)
    labels = raw / "train-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:1000])
    with pytest.raises(data.MNISTFileError,
                       match=r"train-labels-idx1-ubyte is not a valid MNIST file.*1000 bytes.*"
                             r"Fix: delete .*train-labels-idx1-ubyte"):
        data.prepare_data(tmp_path / "data", download=False, verbose=False)


def test_unreachable_mirror_falls_back_to_the_stand_in(tmp_path, source, online, monkeypatch):
    shutil.copytree(offline_raw(), tmp_path / "data" / "OfflineDigits" / "raw")  # no regenerating
    with MirrorServer(tmp_path) as server:  # a port that was open, and is closed again
        closed = server.url
    monkeypatch.setenv(data.MIRROR_ENV, closed)
    got = data.prepare_data(tmp_path / "data", download=True, verbose=False)
    assert got.kind == "offline" and "no mirror answered" in got.how and "127.0.0.1" in got.how


def test_offline_switch_never_asks_the_network(tmp_path, mirror_dir, source, monkeypatch):
    shutil.copytree(offline_raw(), tmp_path / "data" / "OfflineDigits" / "raw")
    monkeypatch.setenv(data.OFFLINE_ENV, "1")
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        got = data.prepare_data(tmp_path / "data", verbose=False)
        assert got.kind == "offline" and server.requests == []
    assert "downloading is off" in got.describe()


def test_mirrors_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(data.MIRROR_ENV, "http://a.example/m, http://b.example/n/")
    assert data.mirrors() == ["http://a.example/m/", "http://b.example/n/"]
    monkeypatch.delenv(data.MIRROR_ENV)
    assert data.mirrors() == list(MNIST.mirrors)


# ---------------------------------------------------------------- the notebook checks' data


def plant_other_mnist(raw: Path) -> None:
    """An MNIST-format data set that is not the stand-in: its images, with the labels shuffled."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for images, labels in digits.FILES.values():
        shutil.copy(offline_raw() / images, raw / images)
        shutil.copy(offline_raw() / f"{images}.gz", raw / f"{images}.gz")
        ours = np.frombuffer((offline_raw() / labels).read_bytes()[8:], dtype=np.uint8)
        idx = digits.idx_bytes(rng.permutation(ours))
        (raw / labels).write_bytes(idx)
        (raw / f"{labels}.gz").write_bytes(digits.gzip_bytes(idx))


def notebook_check_env() -> dict[str, str]:
    """The variables `make test` sets for its nbval step, read from the Makefile's own command."""
    dry = subprocess.run(["make", "-n", "-s", "test"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    # the first nbval pass, as this CPU computes (the second adds another CPU's kernels)
    line = [ln for ln in dry.stdout.splitlines() if "--nbval" in ln][0]
    env = {}
    for word in shlex.split(line):
        if not re.fullmatch(r"[A-Z_]+=.*", word):
            break
        name, value = word.split("=", 1)
        env[name] = value
    assert data.STANDIN_ENV in env and data.ROOT_ENV in env, line
    return env


def test_standin_switch_ignores_mnist_in_the_root(tmp_path, source, mirror_dir, monkeypatch):
    plant_other_mnist(tmp_path / "data" / "MNIST" / "raw")
    monkeypatch.delenv(data.STANDIN_ENV, raising=False)
    found = data.prepare_data(tmp_path / "data", download=False, verbose=False)
    assert found.kind == "mnist"  # without the switch the planted set is what a run would use
    planted = data.mnist_tensors(found, train=False)[1]
    assert not torch.equal(planted, data.mnist_tensors(source, train=False)[1])
    monkeypatch.setenv(data.STANDIN_ENV, "1")
    with MirrorServer(mirror_dir.parent) as server:
        monkeypatch.setenv(data.MIRROR_ENV, server.url)
        got = data.prepare_data(tmp_path / "data", download=True, verbose=False)
        assert server.requests == []  # the switch also means: never the network
    assert got.kind == "offline" and got.describe() == STANDIN_LINE
    assert torch.equal(data.mnist_tensors(got, train=False)[1],
                       data.mnist_tensors(source, train=False)[1])


def test_standin_line_names_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(data.STANDIN_ENV, "1")
    lines = set()
    for name in ("one", "two"):
        shutil.copytree(offline_raw(), tmp_path / name / "OfflineDigits" / "raw")
        lines.add(data.prepare_data(tmp_path / name, verbose=False).describe())
    assert lines == {STANDIN_LINE}  # the same on every machine, whatever the data root


def copy_of_the_kit(tmp_path: Path) -> Path:
    """The package and pyproject.toml in a folder of their own, whose data/ is the default root."""
    kit = tmp_path / "kit"
    shutil.copytree(ROOT / "ddp_helpers", kit / "ddp_helpers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", kit)
    return kit


def kit_env(kit: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_HELPERS_")}
    return {**env, "PYTHONPATH": str(kit), data.OFFLINE_ENV: "1", **extra}


def test_notebook_checks_use_the_standin_over_mnist_where_the_kit_finds_it(tmp_path):
    kit = copy_of_the_kit(tmp_path)
    plant_other_mnist(kit / "data" / "MNIST" / "raw")  # the default place: <checkout>/data
    own_root = tmp_path / "notebook-data"  # the Makefile's root lives in .venv: one of ours
    plant_other_mnist(own_root / "MNIST" / "raw")  # even MNIST in the checks' own root is ignored
    shutil.copytree(offline_raw(), own_root / "OfflineDigits" / "raw")
    show = ("from ddp_helpers import data; s = data.prepare_data(verbose=False); "
            "print(s.kind, s.root)")
    plain = subprocess.run([sys.executable, "-c", show], cwd=kit, env=kit_env(kit, {}),
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.split() == ["mnist", str((kit / "data").resolve())], plain.stderr
    checks = {**notebook_check_env(), data.ROOT_ENV: str(own_root)}
    standin = subprocess.run([sys.executable, "-c", show], cwd=kit, env=kit_env(kit, checks),
                             capture_output=True, text=True, timeout=120)
    assert standin.stdout.split() == ["offline", str(own_root.resolve())], standin.stderr


@pytest.mark.slow
def test_a_notebook_style_run_under_the_checks_env_trains_on_the_standin(tmp_path):
    kit = copy_of_the_kit(tmp_path)
    plant_other_mnist(kit / "data" / "MNIST" / "raw")
    own_root = tmp_path / "notebook-data"
    shutil.copytree(offline_raw(), own_root / "OfflineDigits" / "raw")
    checks = {**notebook_check_env(), data.ROOT_ENV: str(own_root)}
    run = subprocess.run([sys.executable, "-m", "ddp_helpers.mnist", "--nprocs", "2",
                          "--epochs", "1", "--train-subset", "2000", "--memory",
                          "--out", str(tmp_path / "run")], cwd=kit, env=kit_env(kit, checks),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert STANDIN_LINE in run.stdout.splitlines()
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", run.stdout).group(1))
    assert accuracy > 0.3  # the planted set's shuffled labels would leave it near 0.1
