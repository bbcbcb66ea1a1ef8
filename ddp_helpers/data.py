"""MNIST through torchvision under the repo's data/ folder, the offline stand-in, and sharding.

`prepare_data()` runs once, in the parent (or on rank 0 behind a barrier): it finds MNIST,
downloads it when allowed and reachable, or else generates the offline stand-in digits. Ranks
then only read what it left, through torchvision's MNIST loader either way. The test command sets
$DDP_HELPERS_STANDIN so that notebooks run on the stand-in whatever a machine has downloaded.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import http.client
import math
import os
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchvision.datasets import MNIST

from . import digits
from .files import replaced_folder, write_atomic

ROOT_ENV = "DDP_HELPERS_DATA"  # where data/ is, if not the repo's own
MIRROR_ENV = "DDP_HELPERS_MNIST_MIRROR"  # comma-separated base URLs tried instead of torchvision's
OFFLINE_ENV = "DDP_HELPERS_OFFLINE"  # "1": never try the network
STANDIN_ENV = "DDP_HELPERS_STANDIN"  # "1": the stand-in, even when MNIST is on disk; no network
STANDIN_WHY = (f"${STANDIN_ENV} asks for it (the test command's setting, so that compared "
               "notebook outputs never depend on what a machine has downloaded)")
MEAN, STD = 0.5, 0.5  # the listing's Normalize((0.5,), (0.5,))
_SIZES = {"train": 60_000, "t10k": 10_000}
_TIMEOUT_S = 10.0


class MNISTFileError(RuntimeError):
    """An MNIST file on disk or from a mirror is truncated, corrupt or not in MNIST's format."""


class OfflineDigits(MNIST):
    """torchvision's MNIST loader, reading the offline stand-in from data/OfflineDigits/raw."""

    mirrors: list[str] = []  # nothing to download: prepare_data() generates these files

    def download(self) -> None:
        """Generate the stand-in instead of downloading anything."""
        if not digits.is_current(Path(self.raw_folder)):
            digits.write_offline_digits(Path(self.raw_folder))


@dataclass(frozen=True)
class DataSource:
    """Which data a run uses and where it is: plain values, so it pickles to every rank."""

    kind: str  # "mnist" or "offline"
    root: str
    how: str  # how it got there, for the one line every run prints

    @property
    def dataset_class(self) -> type[MNIST]:
        """torchvision.datasets.MNIST for real MNIST, its OfflineDigits subclass otherwise."""
        return MNIST if self.kind == "mnist" else OfflineDigits

    def describe(self) -> str:
        """One line saying which data this is; for the stand-in, the same line on every machine."""
        if self.kind == "mnist":
            folder = _shown(Path(self.root) / self.dataset_class.__name__)
            return f"data: MNIST (real handwritten digits) in {folder} ({self.how})"
        # No folder: the stand-in is the same bytes wherever it lies, and a machine's path in
        # this line would differ between the committed notebooks and the machine checking them.
        return f"data: offline stand-in digits (MNIST's format and sizes, not MNIST): {self.how}"


def _shown(path: Path) -> str:
    """`path` relative to the checkout when inside it (data/MNIST), else as it is."""
    repo = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(repo))
    except ValueError:
        return str(path)


def default_root() -> Path:
    """$DDP_HELPERS_DATA, else the repo's data/ folder (never ~/.pytorch), else ./data."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file():
        return repo / "data"
    return Path.cwd() / "data"


def mirrors() -> list[str]:
    """Base URLs for MNIST: $DDP_HELPERS_MNIST_MIRROR (comma-separated), else torchvision's."""
    custom = os.environ.get(MIRROR_ENV, "")
    urls = [u.strip() for u in custom.split(",") if u.strip()] or list(MNIST.mirrors)
    return [u if u.endswith("/") else u + "/" for u in urls]


def _switch_on(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


def download_allowed() -> bool:
    """False when $DDP_HELPERS_OFFLINE (or $DDP_HELPERS_STANDIN) is set to other than 0/empty."""
    return not (_switch_on(OFFLINE_ENV) or standin_forced())


def standin_forced() -> bool:
    """True when $DDP_HELPERS_STANDIN is set to other than 0/empty: MNIST on disk is ignored."""
    return _switch_on(STANDIN_ENV)


def prepare_data(root: str | os.PathLike | None = None, download: bool | None = None,
                 verbose: bool = True) -> DataSource:
    """Find MNIST, else download it (when allowed and reachable), else make the stand-in.

    With $DDP_HELPERS_STANDIN set, always the stand-in, whatever `root` holds and `download` says.
    """
    root = (Path(root) if root is not None else default_root()).resolve()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(
            f"data root {root} is a file, not a folder: MNIST goes in a folder of its own. Pass "
            "a folder (--data-root DIR or data_root=...), or move that file away.")
    root.mkdir(parents=True, exist_ok=True)
    download = download_allowed() if download is None else download
    with _locked(root):  # two runs preparing at once (two torchrun nodes, two notebooks) wait
        source = _prepare_locked(root, download, verbose)
    if verbose:
        print(source.describe(), flush=True)
    return source


def _prepare_locked(root: Path, download: bool, verbose: bool) -> DataSource:
    if standin_forced():  # checked first: MNIST on disk must not even be opened
        return _standin(root, STANDIN_WHY, verbose)
    raw = root / "MNIST" / "raw"
    if _mnist_on_disk(raw):
        return DataSource("mnist", str(root), "found on disk")
    why = "MNIST is not on disk, and downloading is off ($DDP_HELPERS_OFFLINE or download=False)"
    if download:
        fetched = _download_mnist(raw, verbose)
        if fetched is None:
            return DataSource("mnist", str(root), "downloaded from " + ", ".join(mirrors()))
        why = f"MNIST is not on disk and no mirror answered ({fetched})"
    return _standin(root, why, verbose)


def _standin(root: Path, why: str, verbose: bool) -> DataSource:
    """The stand-in under root/OfflineDigits, generated first if missing or out of date."""
    offline_raw = root / OfflineDigits.__name__ / "raw"
    if not digits.is_current(offline_raw):
        if verbose:
            print("generating the offline stand-in digits once (a few seconds)...", flush=True)
        digits.write_offline_digits(offline_raw)
    return DataSource("offline", str(root), why)


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root / ".prepare.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _mnist_on_disk(raw: Path) -> bool:
    """True if MNIST's four files are in raw/ and valid; raise naming the file if one is not."""
    names = [n for pair in digits.FILES.values() for n in pair]
    if not all((raw / n).is_file() or (raw / f"{n}.gz").is_file() for n in names):
        return False
    for n in names:
        if not (raw / n).is_file():  # only the .gz is there (copied by hand): extract it
            gz = raw / f"{n}.gz"
            data = _gunzip_bytes(gz.read_bytes(), str(gz), _fix_on_disk(gz))
            _check_idx(n, data, gz, _fix_on_disk(gz))
            write_atomic(raw / n, data)
        else:
            _check_idx(n, (raw / n).read_bytes(), raw / n, fix=_fix_on_disk(raw / n))
    return True


def _fix_on_disk(path: Path) -> str:
    return (f"delete {path} (and its .gz or extracted twin) and run again: it is downloaded "
            f"afresh when the network allows, or put a good copy there")


def _download_mnist(raw: Path, verbose: bool) -> str | None:
    """Fetch the four files into raw/; None on success, else why no mirror could be reached."""
    files: dict[str, bytes] = {}
    for split_files in digits.FILES.values():
        for name in split_files:
            got = _fetch_one(f"{name}.gz", verbose)
            if isinstance(got, str):
                return got
            files[name] = got
    with replaced_folder(raw) as tmp:  # all four or nothing
        for name, gz in files.items():
            (tmp / f"{name}.gz").write_bytes(gz)
            (tmp / name).write_bytes(gzip.decompress(gz))
    return None


def _fetch_one(filename: str, verbose: bool) -> bytes | str:
    """The file's .gz bytes from the first mirror that has it, checked; or why none answered."""
    unreachable = []
    official = {name: md5 for name, md5 in MNIST.resources}
    for base in mirrors():
        url = base + filename
        try:
            with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
                gz = response.read()
        except http.client.IncompleteRead as e:
            raise MNISTFileError(
                f"downloading {url} stopped after {len(e.partial)} bytes: the file {filename} is "
                f"truncated. Run again to retry, or point ${MIRROR_ENV} at another mirror."
            ) from e
        except (TimeoutError, urllib.error.URLError, ConnectionError, ValueError) as e:
            host = urllib.parse.urlsplit(url).netloc or url
            unreachable.append(f"{host}: {getattr(e, 'reason', e)}")
            continue
        fix = (f"this mirror serves a bad copy: point ${MIRROR_ENV} at another mirror, or put "
               "good MNIST files into data/MNIST/raw by hand")
        data = _gunzip_bytes(gz, f"{filename} from {url}", fix)
        _check_idx(filename[:-3], data, url, fix)
        if verbose:
            same = hashlib.md5(gz).hexdigest() == official.get(filename)
            print(f"downloaded {url}" + ("" if same else " (checks out as MNIST's format; "
                                          "not byte-identical to the official file)"), flush=True)
        return gz
    return "; ".join(unreachable)


def _gunzip_bytes(gz: bytes, what: str, fix: str) -> bytes:
    try:
        return gzip.decompress(gz)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise MNISTFileError(f"{what} is truncated or corrupt ({len(gz)} bytes; gzip says: {e}). "
                             f"Fix: {fix}.") from e


def _check_idx(name: str, data: bytes, where, fix: str) -> None:
    """Raise MNISTFileError unless data is the IDX file `name` should be, at MNIST's size."""
    split = name.split("-")[0]
    n = _SIZES[split]
    images = "images" in name
    magic, shape = (0x0803, (n, 28, 28)) if images else (0x0801, (n,))
    header = 4 + 4 * len(shape)
    expected = header + math.prod(shape)
    got_magic = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    got_shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(len(shape)))
    problem = None
    if got_magic != magic:
        problem = f"its header says magic {got_magic!r}, MNIST's {name} has {magic}"
    elif got_shape != shape:
        problem = f"its header says shape {got_shape}, MNIST's {name} has {shape}"
    elif len(data) != expected:
        problem = f"it holds {len(data)} bytes where {expected} are expected (truncated?)"
    elif not images and max(data[header:]) > 9:
        problem = "it has labels above 9"
    if problem:
        raise MNISTFileError(f"{where} is not a valid MNIST file: {problem}. Fix: {fix}.")


def mnist_dataset(source: DataSource, train: bool = True, transform=None) -> Dataset:
    """The torchvision dataset (per-sample PIL images through `transform`), as the listing uses."""
    return source.dataset_class(source.root, train=train, transform=transform, download=False)


def mnist_tensors(source: DataSource, train: bool = True,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """All images as one N x 1 x 28 x 28 float tensor, normalised, and the labels (int64)."""
    ds = mnist_dataset(source, train=train)
    # The same arithmetic as ToTensor() then Normalize((0.5,), (0.5,)), so values match bit for bit.
    x = ds.data.to(torch.float32).div(255).sub(MEAN).div(STD).unsqueeze(1)
    return x.to(device), ds.targets.to(torch.int64).to(device)


def rank_share(batch: tuple[torch.Tensor, ...], rank: int, world_size: int,
               device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s equal, contiguous share of each tensor of a global batch (what a sampler
    would hand it), on its device: every rank rebuilds the same batch and keeps its part."""
    per_rank = batch[0].shape[0] // world_size
    return tuple(t[rank * per_rank:(rank + 1) * per_rank].to(device) for t in batch)


def shard_indices(n: int, rank: int, world_size: int, epoch: int = 0, shuffle: bool = True,
                  seed: int = 0, drop_last: bool = False) -> torch.Tensor:
    """The sample indices DistributedSampler gives `rank` in `epoch` (it computes them)."""
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler), dtype=torch.int64)


class ShardedBatches:
    """Batches of in-memory tensors, with DistributedSampler's shards; `set_epoch` reshuffles."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int,
                 world_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Like DistributedSampler.set_epoch: without it every epoch repeats the same order."""
        self.epoch = epoch

    def indices(self) -> torch.Tensor:
        """This rank's sample indices for the current epoch, in order."""
        return shard_indices(len(self.x), self.rank, self.world_size, self.epoch, self.shuffle,
                             self.seed, self.drop_last)

    def __len__(self) -> int:
        shard = DistributedSampler(range(len(self.x)), num_replicas=self.world_size,
                                   rank=self.rank, drop_last=self.drop_last).num_samples
        return math.ceil(shard / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices().to(self.x.device)
        for start in range(0, len(idx), self.batch_size):
            batch = idx[start:start + self.batch_size]
            yield self.x.index_select(0, batch), self.y.index_select(0, batch)
