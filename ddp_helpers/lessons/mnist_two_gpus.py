"""Lesson 05: the seed's Listing 7.2 (MNIST on two GPUs with DDP), run as printed, fixed, and fast.

`listing_faithful` is the listing line for line, its flaws included; `listing_fixed` is the same
function with each flaw fixed on a line marked `# FIX:`; `in_memory` is the kit's fast path. The
`# KIT:` lines are the only other changes: they let the listing run on a CPU, on the kit's data
folder, and hand records back to the parent. `python -m ddp_helpers.mnist` runs all three.
Below them: the demonstrations that find each flaw by running it, and the lesson's exercises.
"""

from __future__ import annotations

import hashlib
import http.server
import math
import os
import pickle
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms
from torchvision.datasets import MNIST as TorchvisionMNIST

import ddp_helpers as dh
from ddp_helpers import digits, models, training
from ddp_helpers.checks import Case, case, pair_cases
from ddp_helpers.data import DataSource, ShardedBatches, mnist_tensors, prepare_data
from ddp_helpers.exercises import exercise_check, require
from ddp_helpers.runtime import BACKEND_VAR, let_gloo_threads_finish, usable_cores
from ddp_helpers.torchrun import torchrun_agents

LISTING_PORT = 23456  # the listing's init_method='tcp://localhost:23456'
NOTEBOOK_SUBSET = 3_000  # training images the notebook's DataLoader runs use (of 60,000)


@dataclass(frozen=True)
class MnistConfig:
    """Everything a run needs, as plain values (it pickles to every rank)."""

    source: DataSource | None = None  # which data; None: find or make it (data.prepare_data)
    epochs: int = 1
    model: str = "linear"  # the listing's Flatten + Linear(784, 10); "cnn" for a small CNN
    batch_size: int = 64  # per rank, as in the listing
    lr: float = 0.01
    num_workers: int = 2  # DataLoader workers per rank, as in the listing
    train_subset: int | None = None  # train on the first N images only (short runs)
    checkpoint: str | None = None  # rank 0 writes model.module.state_dict() here each epoch
    progress_lines: int = 4  # per rank and epoch, for the fixed and fast variants
    port: int = LISTING_PORT  # the faithful listing's fixed rendezvous port
    threads: int | None = None  # CPU threads per rank; None: the cores shared out (torchrun's)
    sampler: bool = True  # in_memory only: False walks the whole set on every rank, as printed
    gather: bool = False  # rank 0 returns every rank's records (torchrun has no parent to)


# ---------------------------------------------------------------- the listing, as printed


def listing_faithful(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()):
    """Listing 7.2 as printed, flaws included; the KIT: lines let it run here and report back."""
    backend = listing_backend(world_size, cfg)  # KIT: 'nccl' with GPUs, else gloo on the CPU
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://localhost:{cfg.port}",  # KIT: cfg.port is the listing's 23456
        rank=rank,
        world_size=world_size)
    torch.manual_seed(0)
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")  # KIT: or the CPU
    transform = transforms.Compose(
        [transforms.ToTensor(),
         transforms.Normalize((0.5,), (0.5,))])
    MNIST, filepath = dataset_class(cfg)  # KIT: data/ (MNIST or its stand-in), not ~/.pytorch
    trainset = MNIST(filepath, download=True, train=True, transform=transform)
    trainset = first_images(trainset, cfg)  # KIT: all of it, unless a subset
    train_loader = DataLoader(trainset,
                              batch_size=cfg.batch_size,
                              shuffle=True,
                              num_workers=cfg.num_workers)
    model = models.build_model(cfg.model).to(device)  # KIT: nn.Sequential(Flatten(), Linear)
    model = DistributedDataParallel(
        model, device_ids=[rank] if backend == "nccl" else None)  # KIT: None on the CPU
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rec = training.Recorder(model, rank, world_size, device)  # KIT: records for the parent
    for epoch in range(cfg.epochs):  # KIT: the listing's train() runs one epoch
        rec.start_epoch(epoch, train_loader)
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            print(f'Process {device}, Batch {batch_idx}')
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
            rec.step(loss, target)  # KIT: this step's loss, labels and times
        save_checkpoint(model, cfg, rank)  # KIT: rank 0 saves, when cfg.checkpoint says where
    return finish(model, rec, cfg, device)  # KIT: test accuracy and the records


def listing_fixed(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()):
    """The listing with each flaw fixed on a `# FIX:` line; otherwise the same code."""
    backend = listing_backend(world_size, cfg)  # KIT: 'nccl' with GPUs, else gloo on the CPU
    local_rank = int(os.environ["LOCAL_RANK"])  # FIX: this machine's GPU; RANK counts them all
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")  # FIX: local
    if device.type == "cuda":
        torch.cuda.set_device(device)  # FIX: CUDA work with no device named goes here, not GPU 0
    dist.init_process_group(
        backend=backend,
        init_method="env://",  # FIX: MASTER_ADDR/PORT from the launcher: a free port, not 23456
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None)  # FIX: NCCL's GPU, bound at once
    torch.manual_seed(0)
    transform = transforms.Compose(
        [transforms.ToTensor(),
         transforms.Normalize((0.5,), (0.5,))])
    MNIST, filepath = dataset_class(cfg)  # KIT: data/ (MNIST or its stand-in), not ~/.pytorch
    with dh.rank_zero_first():  # FIX: rank 0 downloads; the others wait, then only read
        trainset = MNIST(filepath, download=True, train=True, transform=transform)
    trainset = first_images(trainset, cfg)  # KIT: all of it, unless a subset
    sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank)  # FIX: a shard
    train_loader = DataLoader(trainset,
                              batch_size=cfg.batch_size,
                              sampler=sampler,  # FIX: the sampler shuffles; no shuffle=True
                              num_workers=cfg.num_workers,
                              pin_memory=device.type == "cuda",  # NEW: page-locked batches
                              generator=torch.Generator().manual_seed(rank))  # NEW: see below
    model = models.build_model(cfg.model).to(device)  # KIT: nn.Sequential(Flatten(), Linear)
    model = DistributedDataParallel(
        model, device_ids=dh.device_ids(device))  # FIX: this machine's GPU (None on the CPU)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rec = training.Recorder(model, rank, world_size, device)  # KIT: records for the parent
    report_at = progress_steps(len(train_loader), cfg.progress_lines)  # FIX: a few, not all
    for epoch in range(cfg.epochs):  # KIT: the listing's train() runs one epoch
        sampler.set_epoch(epoch)  # FIX: a new shuffle each epoch (else epoch 0's, every time)
        rec.start_epoch(epoch, train_loader)
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data = data.to(device, non_blocking=True)  # NEW: with pin_memory, an async copy
            target = target.to(device, non_blocking=True)
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
            rec.step(loss, target)  # KIT: this step's loss, labels and times
            if batch_idx + 1 in report_at:  # FIX: a few lines, each saying which rank it is
                say(rank, f"epoch {epoch + 1} step {batch_idx + 1}/{len(train_loader)}: "
                               f"loss {loss.item():.3f}")
        save_checkpoint(model, cfg, rank)  # KIT: rank 0 saves, when cfg.checkpoint says where
    results = finish(model, rec, cfg, device)  # KIT: test accuracy and the records
    dist.destroy_process_group()  # FIX: frees the group and its port (NCCL warns without it)
    return results


def in_memory(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()):
    """The kit's fast path: all images as one tensor on the device, sharded like the sampler."""
    with dh.process_group(rank, world_size) as device:  # the fixed listing's setup, destroyed
        if cfg.threads and device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(0)
        # No PIL images, no per-sample transforms, no workers: all of it normalised at once.
        x, y = mnist_tensors(source_of(cfg), train=True, device=device)
        x, y = x[:cfg.train_subset], y[:cfg.train_subset]
        # sampler=False: one shard holding everything, for every rank (the listing's flaw).
        shard = (rank, world_size) if cfg.sampler else (0, 1)
        batches = ShardedBatches(x, y, cfg.batch_size, *shard)
        model = models.build_model(cfg.model).to(device)
        model = DistributedDataParallel(model, device_ids=dh.device_ids(device))
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        rec = training.Recorder(model, rank, world_size, device)
        report_at = progress_steps(len(batches), cfg.progress_lines)
        for epoch in range(cfg.epochs):
            batches.set_epoch(epoch)
            rec.start_epoch(epoch, batches)
            model.train()
            for step, (data, target) in enumerate(batches, 1):
                optimizer.zero_grad()
                loss = criterion(model(data), target)
                loss.backward()
                optimizer.step()
                rec.step(loss, target)
                if step in report_at:
                    say(rank, f"epoch {epoch + 1} step {step}/{len(batches)}: "
                                   f"loss {loss.item():.3f}")
            save_checkpoint(model, cfg, rank)
        return finish(model, rec, cfg, device)


VARIANTS = {"faithful": listing_faithful, "fixed": listing_fixed, "memory": in_memory}


# ---------------------------------------------------------------- what the variants share


def listing_backend(world_size: int, cfg: MnistConfig) -> str:
    """The listing's 'nccl' where every rank on this machine has a GPU, else gloo (dh's rule);
    on the CPU the ranks share the cores out, as torchrun does with OMP_NUM_THREADS=1."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = dh.choose_backend(os.environ.get(BACKEND_VAR, "auto"), world_size, local)[0]
    if backend != "nccl":
        # N ranks each using every core oversubscribe the machine (steps 20-50x slower here).
        torch.set_num_threads(cfg.threads or max(1, usable_cores() // local))
    return backend


def progress_steps(steps: int, lines: int) -> set[int]:
    """`lines` evenly spaced step numbers, the last one `steps`: when to print progress."""
    return {math.ceil(steps * (i + 1) / lines) for i in range(max(1, lines))}


def source_of(cfg: MnistConfig) -> DataSource:
    """The run's data: the parent's choice, or found here (prepare_data locks, so ranks queue)."""
    return cfg.source if cfg.source is not None else prepare_data(verbose=False)


def dataset_class(cfg: MnistConfig) -> tuple[type[TorchvisionMNIST], str]:
    """(torchvision's MNIST or the stand-in's subclass, the folder above it): the listing's
    `datasets.MNIST` and `filepath`."""
    source = source_of(cfg)
    return source.dataset_class, source.root


def first_images(dataset, cfg: MnistConfig):
    """The dataset, or its first cfg.train_subset images (the notebook's short runs)."""
    return dataset if cfg.train_subset is None else Subset(dataset, range(cfg.train_subset))


def say(rank: int, message: str) -> None:
    """Print a progress line that names its rank (torchrun, unlike dh.launch, tags no line)."""
    print(f"rank {rank}: {message}", flush=True)


def finish(model: DistributedDataParallel, rec: training.Recorder, cfg: MnistConfig,
           device: torch.device):
    """After training: the test accuracy (every rank scores half), the saved checkpoint scored
    again after reloading, and this rank's records (all ranks' on rank 0 with cfg.gather)."""
    source = source_of(cfg)
    x_test, y_test = mnist_tensors(source, train=False, device=device)
    accuracy = training.evaluate(model, x_test, y_test, rec.rank, rec.world_size)
    reloaded = None
    if cfg.checkpoint:
        again = load_checkpoint(cfg.checkpoint, cfg.model, device)
        reloaded = training.evaluate(again, x_test, y_test, rec.rank, rec.world_size)
    records = rec.records(model, accuracy, reloaded_accuracy=reloaded, data=source.describe(),
                          backend=dist.get_backend())
    # The Recorder's all-reduce timer is a Python comm hook: let gloo's threads let go of it
    # before the fixed listing destroys the group (a rank hung there on torch 2.9.1).
    let_gloo_threads_finish()
    if not cfg.gather:
        return records
    if device.type == "cuda":  # gather_object's tensors go to the current GPU (the listing
        torch.cuda.set_device(device)  # as printed never sets it: every rank would use GPU 0)
    everyone = [None] * rec.world_size if rec.rank == 0 else None
    dist.gather_object(records, everyone, dst=0)
    return everyone


def save_checkpoint(model: DistributedDataParallel, cfg: MnistConfig, rank: int) -> None:
    """Rank 0 writes the weights atomically; a barrier keeps the others from reading early."""
    if not cfg.checkpoint:
        return
    if rank == 0:
        path = Path(cfg.checkpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        # model.module: the bare model's keys, without DDP's "module." prefix, load anywhere.
        torch.save(model.module.state_dict(), tmp)
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    dist.barrier()


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be loaded: says which file and what to do."""


def load_checkpoint(path: str | os.PathLike, model_name: str,
                    device: torch.device | str = "cpu") -> nn.Module:
    """A fresh model with the saved weights, mapped onto `device` (not the GPU that saved it)."""
    model = models.build_model(model_name)
    # map_location: saved from cuda:0, loaded on rank 1 would otherwise land on GPU 0 again.
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, KeyError) as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded as {model_name!r} weights ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). It is truncated, corrupt, or from "
            "another model: point to another checkpoint, or delete it and train again "
            "(the kit writes checkpoints atomically, so the last complete one is never "
            "half-written).") from e
    return model.to(device)


def summary(results: list[dict]) -> list[str]:
    """Lines for the parent to print: per rank what it saw and scored, then whether all agree."""
    lines = []
    for r in results:
        lines.append(f"rank {r['rank']}: {r['samples_seen']} samples in {len(r['loss'])} steps, "
                     f"{sum(r['epoch_s']):.1f} s training, final loss {r['loss'][-1]:.3f}, "
                     f"test accuracy {r['accuracy']:.4f}")
    same = len({r["param_digest"] for r in results}) == 1
    lines.append("parameters identical on every rank (DDP kept them in step): "
                 f"{'yes' if same else 'NO'} (digest {results[0]['param_digest']})")
    return lines


# ---------------------------------------------------------------- the notebook's short runs


def short_config(source: DataSource, **changes) -> MnistConfig:
    """The notebook's MnistConfig: the first NOTEBOOK_SUBSET images, two progress lines, one
    thread per CPU rank (a fixed thread count keeps the float sums, so the printed numbers, the
    same on every machine)."""
    return replace(MnistConfig(source=source, train_subset=NOTEBOOK_SUBSET, progress_lines=2,
                               threads=1), **changes)


def report_error(rank: int, world_size: int, fn, *args) -> str:
    """Run fn(rank, world_size, *args); return "ran" or the error it raised, as one line."""
    try:
        fn(rank, world_size, *args)
        return "ran"
    except Exception as e:  # noqa: BLE001 - the error is the result to show
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


class LineCounter:
    """A dh.launch output sink: counts the listing's per-batch lines of each rank, and keeps the
    first few of each."""

    def __init__(self, keep: int = 2):
        self.per_rank: Counter = Counter()
        self.first: dict[int, list[str]] = {}
        self.keep = keep

    def __call__(self, rank: int, stream: str, line: str) -> None:
        """Take one line a rank printed."""
        if line.startswith("Process "):  # the listing's per-batch line
            self.per_rank[rank] += 1
            kept = self.first.setdefault(rank, [])
            if len(kept) < self.keep:
                kept.append(line)

    def counts(self) -> dict[int, int]:
        """Lines per rank, rank 0 first (the ranks' lines arrive in any order)."""
        return {rank: self.per_rank[rank] for rank in sorted(self.per_rank)}


def samples_per_epoch(rank: int, world_size: int, source: DataSource) -> dict:
    """What one full epoch of the listing's DataLoader hands this rank, without and with the
    sampler: len(loader.sampler) samples in len(loader) batches; nothing is loaded to count."""
    with dh.process_group(rank, world_size, verbose=False):
        trainset = source.dataset_class(source.root, train=True)
        listing = DataLoader(trainset, batch_size=64, shuffle=True)
        sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank)
        fixed = DataLoader(trainset, batch_size=64, sampler=sampler)
        return {"rank": rank, "dataset": len(trainset),
                "listing": (len(listing.sampler), len(listing)),
                "fixed": (len(fixed.sampler), len(fixed))}


def seen_overlap(results: list[dict]) -> dict:
    """Which sample indices the ranks trained on: how many each, shared, and all together."""
    seen = [set(r["indices"].tolist()) for r in results]
    return {"per_rank": [len(s) for s in seen], "shared": len(set.intersection(*seen)),
            "union": len(set.union(*seen))}


def time_rows(name: str, results: list[dict]) -> list[str]:
    """Per rank: epoch seconds split into waiting for data, compute and gradient all-reduce."""
    rows = []
    for r in results:
        sync = [s for s in r["sync_s"] if s == s]  # NaN: no all-reduce timed at that step
        allreduce = dh.format_seconds(sum(sync) if sync else None)
        rows.append(f"{name}, rank {r['rank']}: epoch {dh.format_seconds(sum(r['epoch_s']))} = "
                    f"data {dh.format_seconds(sum(r['data_s']))} + compute "
                    f"{dh.format_seconds(sum(r['compute_s']))} + all-reduce {allreduce}")
    return rows


def per_step_rows(name: str, results: list[dict]) -> list[str]:
    """Per rank: its steps, and its compute per step (the epoch's compute over its steps)."""
    return [f"{name}, rank {r['rank']}: {len(r['compute_s'])} steps, compute "
            f"{dh.format_seconds(sum(r['compute_s']) / len(r['compute_s']))} per step"
            for r in results]


# ---------------------------------------------------------------- racing downloads


class SlowMirror:
    """An HTTP server on 127.0.0.1 serving MNIST's four .gz files slowly, one rank per path
    (/rank<r>/<file>), and logging which rank downloaded which file in full."""

    def __init__(self, source: DataSource, seconds: float = 2.0):
        raw = Path(source.root) / source.dataset_class.__name__ / "raw"
        self.files = {f"{name}.gz": _gz_bytes(raw / name)
                      for pair in digits.FILES.values() for name in pair}
        self.seconds = seconds  # how long the big file (train images) takes to send
        self.requests: list[tuple[int, str]] = []
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def spec(self) -> dict:
        """What a rank needs to download from this mirror, as plain values (it pickles)."""
        return {"url": self.url,
                "md5": {name: hashlib.md5(data).hexdigest() for name, data in self.files.items()}}

    def __enter__(self) -> SlowMirror:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def asked(self) -> dict[int, list[str]]:
        """Per rank, the files it downloaded, in order."""
        out: dict[int, list[str]] = {}
        for rank, name in self.requests:
            out.setdefault(rank, []).append(name)
        return out

    def _handler(self):
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):  # noqa: N802 - http.server's naming
                self._reply(body=False)

            def do_GET(self):  # noqa: N802
                self._reply(body=True)

            def _reply(self, body: bool):
                _, who, name = self.path.split("/", 2)
                data = mirror.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not body:
                    return
                seconds = mirror.seconds * len(data) / max(map(len, mirror.files.values()))
                try:
                    _send_slowly(self.wfile, data, seconds)
                except (BrokenPipeError, ConnectionResetError):
                    # torchvision first GETs each URL to look for redirects and hangs up after
                    # the headers: not a download.
                    return
                mirror.requests.append((int(who.removeprefix("rank")), name))

            def log_message(self, *args):  # keep the notebook's output clean
                pass

        return Handler


def _gz_bytes(raw_file: Path) -> bytes:
    gz = raw_file.with_name(raw_file.name + ".gz")
    return gz.read_bytes() if gz.is_file() else digits.gzip_bytes(raw_file.read_bytes())


def _send_slowly(out, data: bytes, seconds: float, pieces: int = 40) -> None:
    step = max(1, len(data) // pieces)
    for start in range(0, len(data), step):
        out.write(data[start:start + step])
        out.flush()
        time.sleep(seconds / pieces)


def mirrored_mnist(spec: dict, rank: int) -> type[TorchvisionMNIST]:
    """torchvision's MNIST, downloading from the SlowMirror `spec` names (with its files' md5)."""
    return type("MirroredMNIST", (TorchvisionMNIST,), {
        "mirrors": [f"{spec['url']}rank{rank}/"],
        "resources": [(name, spec["md5"][name]) for name, _ in TorchvisionMNIST.resources]})


def racing_downloads(rank: int, world_size: int, mirror: dict, root: str, late_s: float,
                     rank_zero_first: bool) -> str:
    """The listing's download line on every rank, rank 1 starting `late_s` later; or, with
    rank_zero_first, the fixed listing's. Returns what this rank's MNIST(...) call ended with."""
    with dh.process_group(rank, world_size, verbose=False):
        MNIST = mirrored_mnist(mirror, rank)  # KIT: torchvision's MNIST, from a local mirror
        dist.barrier()  # a common start
        if rank > 0:
            time.sleep(late_s)  # a rank that starts a little later: a slow import, a busy node
        try:
            if rank_zero_first:
                with dh.rank_zero_first():
                    trainset = MNIST(root, download=True, train=True)
            else:
                trainset = MNIST(root, download=True, train=True)
        except RuntimeError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
            # Newer torchvision wraps the md5 failure: "Error downloading <file>: ... <why>".
            return f"RuntimeError: {' ... '.join(dict.fromkeys([lines[0], lines[-1]]))}"
        return f"loaded {len(trainset):,} images"


# ---------------------------------------------------------------- the loader workers' seeds


class _WorkerSeed(torch.utils.data.Dataset):
    """Four items, each the seed of the loader worker that fetched it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return torch.utils.data.get_worker_info().seed


def worker_seeds(rank: int, world_size: int) -> dict:
    """The seeds this rank's two loader workers get after the listing's torch.manual_seed(0):
    with the listing's DataLoader, and with the fixed listing's generator seeded by the rank
    (a worker's torch RNG, which random augmentations draw from, starts from its seed)."""
    seeds = {}
    for name, generator in (("listing", None), ("fixed", torch.Generator().manual_seed(rank))):
        torch.manual_seed(0)
        loader = DataLoader(_WorkerSeed(), batch_size=2, num_workers=2, generator=generator)
        seeds[name] = sorted(set(torch.cat(list(loader)).tolist()))
    return {"rank": rank, **seeds}


# ---------------------------------------------------------------- a second node


def simulated_nodes(nnodes: int = 2, gpus_per_node: int = 2) -> list[dict]:
    """The environment torchrun gives each process of `nnodes` x `gpus_per_node`, and the GPU
    each listing picks from it: the faithful cuda:{RANK}, the fixed cuda:{LOCAL_RANK}."""
    rows = []
    for node in range(nnodes):
        for local_rank in range(gpus_per_node):
            rank = node * gpus_per_node + local_rank  # torchrun's numbering
            rows.append({"node": node, "RANK": rank, "LOCAL_RANK": local_rank,
                         "faithful": f"cuda:{rank}", "fixed": f"cuda:{local_rank}",
                         "faithful_exists": rank < gpus_per_node,
                         "fixed_exists": local_rank < gpus_per_node})
    return rows


def two_torchrun_nodes(script: str | os.PathLike, gpus_per_node: int = 2,
                       timeout: float = 120) -> dict[int, dict]:
    """Run `script` under two torchrun agents on this machine, as two "nodes" of `gpus_per_node`
    workers meeting through c10d on loopback; per node (its GROUP_RANK): the agent's exit code,
    the lines its workers printed that start with "rank ", sorted, and the distinct exception
    lines (`SomeError: ...`) in its output, in order of first appearance."""
    agent = (f"torchrun --nnodes 2 --nproc-per-node {gpus_per_node} --rdzv-backend c10d "
             f"--rdzv-endpoint 127.0.0.1:{dh.free_port()} --rdzv-id second-node "
             f"{Path(script).resolve()}")
    env = {"OMP_NUM_THREADS": "1"}
    runs = torchrun_agents([agent, agent], envs=[env, env], timeout=timeout)
    nodes = {}
    for run in runs:
        lines = run["output"].splitlines()
        ranks = sorted(line for line in lines if line.startswith("rank "))
        node = 1 if any(int(line.split()[1].rstrip(",:")) >= gpus_per_node
                        for line in ranks) else 0
        # After init_process_group torch prefixes a worker's traceback lines with "[rankN]: ".
        bare = (_RANK_PREFIX.sub("", line) for line in lines)
        errors = list(dict.fromkeys(line for line in bare if _EXCEPTION_LINE.match(line)))
        nodes[node] = {"returncode": run["returncode"], "ranks": ranks, "errors": errors}
    return dict(sorted(nodes.items()))


_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception)(:|$)")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


# ---------------------------------------------------------------- exercises


# (images, world size, batch size): dividing evenly, padded by a few, padded on 3 ranks, and
# padded by more than the data holds (2 images on 5 ranks: the sampler repeats them cyclically).
LOADER_SIZES = ((12, 2, 4), (10, 3, 3), (1001, 2, 64), (2, 5, 2))


def loader_cases(sharded_loader) -> list:
    """The learner's loader against DistributedSampler (seed 0) on every rank of each of
    LOADER_SIZES: the samples in order at epochs 0 and 1 (loader.sampler.set_epoch(1) between
    them, as a training loop calls it), and the sizes of the batches. An answer that raises
    on one rank fails that rank's case."""
    cases = []
    for n, world, batch in LOADER_SIZES:
        for rank in range(world):
            label = f"{n} samples, rank {rank} of {world}"
            try:
                cases += _rank_loader_cases(sharded_loader, label, n, rank, world, batch)
            except Exception as e:  # noqa: BLE001 - a crash on one rank names that rank
                cases.append(Case(label, False, f"raised {type(e).__name__}: "
                                                f"{(str(e).splitlines() or [''])[0]}"))
    return cases


def _rank_loader_cases(sharded_loader, label: str, n: int, rank: int, world: int,
                       batch: int) -> list:
    numbers = torch.utils.data.TensorDataset(torch.arange(n))
    loader = sharded_loader(numbers, rank, world, batch_size=batch)
    expected = DistributedSampler(range(n), world, rank, shuffle=True, seed=0)
    batches = [b[0] for b in loader]
    cases = [_samples_case(f"{label}, epoch 0", batches, list(expected))]
    want = [min(batch, len(expected) - i) for i in range(0, len(expected), batch)]
    sizes = [len(b) for b in batches]
    cases.append(Case(f"{label}: batch sizes (batch_size={batch})", sizes == want,
                      f"got {_short(sizes)}, expected {_short(want)}"))
    reshuffle = getattr(getattr(loader, "sampler", None), "set_epoch", None)
    if reshuffle is None:
        return [*cases, case(f"{label}, epoch 1: loader.sampler.set_epoch", "missing", "present")]
    reshuffle(1)  # the same loader, told the epoch
    expected.set_epoch(1)
    return [*cases, _samples_case(f"{label}, epoch 1", [b[0] for b in loader], list(expected))]


def _samples_case(label: str, batches: list, expected: list[int]):
    """The samples a loader's batches held, in order, against the sampler's: a failure says
    how many there were or where the first one differs."""
    got = torch.cat(batches).tolist() if batches else []
    if len(got) != len(expected):
        return Case(label, False, f"got {len(got)} samples, expected {len(expected)} "
                                  "(DistributedSampler pads every rank to the same count)")
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if wrong:
        i = wrong[0]
        return Case(label, False, f"sample {i}: got image {got[i]}, expected {expected[i]} "
                                  f"(got {_short(got)}, expected {_short(expected)})")
    return Case(label, True)


def _short(numbers: list[int], keep: int = 6) -> str:
    return str(numbers) if len(numbers) <= keep else f"[{', '.join(map(str, numbers[:keep]))}, ...]"


@exercise_check("sharded_loader", "file")
def check_sharded_loader(module) -> list:
    """Each rank's samples, in order, and its batch sizes, against DistributedSampler's (seed 0)
    at epochs 0 and 1, on sizes that need padding (see LOADER_SIZES)."""
    return loader_cases(require(module, "sharded_loader"))


@exercise_check("strip_ddp_prefix", "file")
def check_strip_ddp_prefix(module) -> list:
    """Keys from ddp.state_dict() lose their leading "module." only; tensors stay the same, dtype
    included. Cases 3-6 keep a "module." that is not DDP's (a submodule called module, right
    after DDP's too) and a key that starts "modules."; case 7 is a real model with such a
    submodule and BatchNorm buffers, whose plain model must load the answer with strict=True."""
    strip = require(module, "strip_ddp_prefix")
    w, b = torch.ones(10, 784), torch.zeros(10)
    inner = torch.ones(3)
    given = [
        ({"module.1.weight": w, "module.1.bias": b}, {"1.weight": w, "1.bias": b}),
        ({"1.weight": w}, {"1.weight": w}),  # saved from model.module: nothing to strip
        ({"module.encoder.module.scale": inner}, {"encoder.module.scale": inner}),
        # No DDP, a submodule named "module": a "module." that is not leading stays.
        ({"encoder.module.scale": inner, "1.bias": b},
         {"encoder.module.scale": inner, "1.bias": b}),
        # A ModuleList named "modules": starts with "module" but not with "module.".
        ({"modules.0.weight": w, "modules.0.bias": b},
         {"modules.0.weight": w, "modules.0.bias": b}),
        # DDP around a model whose own submodule is called "module": only the first one goes.
        ({"module.module.scale": inner, "module.1.bias": b},
         {"module.scale": inner, "1.bias": b}),
    ]
    cases = []
    for i, (state, expected) in enumerate(given, 1):
        cases += _stripped_cases(f"case {i}", strip(dict(state)), expected)
    with torch.random.fork_rng():  # the learner's RNG is left as it was
        plain = _NetWithBuffers()
    saved = {f"module.{k}": v for k, v in plain.state_dict().items()}  # what ddp.state_dict() holds
    got = strip(dict(saved))
    cases += _stripped_cases("case 7", got, plain.state_dict())
    if all(c.ok for c in cases):
        cases.append(_loads_strictly("case 7: the plain model loads it (strict=True)", got))
    return cases


class _NetWithBuffers(nn.Module):
    """A submodule called `module`, and BatchNorm: float buffers and an int64 step count."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.bn(torch.randn(8, 4))  # running statistics and num_batches_tracked away from 0


def _stripped_cases(label: str, got, expected: dict) -> list:
    keys = sorted(got) if isinstance(got, dict) else got
    cases = [case(f"{label}: keys", keys, sorted(expected))]
    if not (isinstance(got, dict) and sorted(got) == sorted(expected)):
        return cases
    for k, v in expected.items():
        if not isinstance(got[k], torch.Tensor) or got[k].dtype != v.dtype:
            kind = got[k].dtype if isinstance(got[k], torch.Tensor) else type(got[k]).__name__
            cases.append(Case(f"{label}: {k}", False, f"got {kind}, expected a tensor of "
                                                      f"{v.dtype} (the same tensor)"))
        else:
            cases.append(case(f"{label}: {k}", got[k], v, rtol=0, atol=0))
    return cases


def _loads_strictly(label: str, state: dict):
    try:
        with torch.random.fork_rng():
            _NetWithBuffers().load_state_dict(state, strict=True)
    except RuntimeError as e:
        return Case(label, False, f"raised {(str(e).splitlines() or [''])[0]}")
    return Case(label, True)


LINES_PRINTED = (4 * 938, 4 * 235)  # 4 ranks x ceil(60000/64); with the sampler ceil(15000/64)


@exercise_check("lines_printed", "prediction", wrong_answer=(938, 235))
def check_lines_printed(answer) -> list:
    """(lines without the sampler, lines with it) for 4 ranks, one epoch of all 60,000 images."""
    return pair_cases(answer, LINES_PRINTED, "without, with the sampler",
                      ("lines without the sampler (4 ranks)", "lines with the sampler (4 ranks)"))
