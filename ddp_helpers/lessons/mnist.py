"""The seed's MNIST exercise (Listing 7.2) as per-rank functions: faithful, fixed, and fast.

`listing_faithful` keeps what the listing does, its flaw included; `listing_fixed` adds the
DistributedSampler; `in_memory` is the kit's fast path with the same sharding. Every line that
differs from the listing says why in a comment: `# KIT:` for plumbing the kit needs (launching,
records), `# FIX:` for a correction of the listing.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

import ddp_helpers as dh
from ddp_helpers import data, models, training


@dataclass(frozen=True)
class MnistConfig:
    """Everything a run needs, as plain values (it pickles to every rank)."""

    source: data.DataSource | None = None  # None: rank 0 prepares the data, the others wait
    data_root: str | None = None
    download: bool | None = None  # None: allowed unless $DDP_HELPERS_OFFLINE is set
    epochs: int = 1
    model: str = "linear"
    batch_size: int = 64
    lr: float = 0.01
    num_workers: int = 2
    train_subset: int | None = None  # train on the first N samples only (quick tests)
    checkpoint: str | None = None  # rank 0 writes model.module.state_dict() here each epoch
    progress_lines: int = 4  # per rank and epoch; the listing printed one per batch
    tag_rank: bool = False  # prefix "[rank r]": torchrun does not tag the lines for us
    gather: bool = False  # rank 0 returns every rank's records (torchrun has no parent to)


def listing_faithful(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()) -> dict:
    """Listing 7.2's training, flaw included: no DistributedSampler, so every rank sees all data."""
    with dh.process_group(rank, world_size) as device:  # FIX: free port, any backend, destroyed
        source = _data_source(cfg)  # FIX: the listing downloads on every rank at once
        torch.manual_seed(0)
        transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
        trainset = _subset(data.mnist_dataset(source, True, transform), cfg)  # KIT: data/ folder
        train_loader = DataLoader(trainset, batch_size=cfg.batch_size, shuffle=True,
                                  num_workers=cfg.num_workers)  # KIT: 64 and 2, as cfg defaults
        model = models.build_model(cfg.model).to(device)  # KIT: Flatten + Linear(784, 10)
        model = DistributedDataParallel(model, device_ids=_ids(device))  # KIT: CPU has no ids
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # KIT: lr 0.01 by default
        # KIT: the listing's train() call, plus records, a test, and a checkpoint.
        return _train_and_finish(rank, world_size, device, cfg, source, model, train_loader,
                                 criterion, optimizer, sampler=None)


def listing_fixed(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()) -> dict:
    """The listing with a DistributedSampler: each rank trains on its own half of the data."""
    with dh.process_group(rank, world_size) as device:  # FIX: free port, any backend, destroyed
        source = _data_source(cfg)  # FIX: the listing downloads on every rank at once
        torch.manual_seed(0)
        transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
        trainset = _subset(data.mnist_dataset(source, True, transform), cfg)  # KIT: data/ folder
        # FIX: the sampler gives each rank a disjoint 1/world_size of the (shuffled) samples.
        sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank, shuffle=True)
        train_loader = DataLoader(trainset, batch_size=cfg.batch_size,
                                  sampler=sampler,  # FIX: replaces shuffle=True
                                  num_workers=cfg.num_workers,
                                  pin_memory=device.type == "cuda")  # FIX: faster copies to GPU
        model = models.build_model(cfg.model).to(device)  # KIT: Flatten + Linear(784, 10)
        model = DistributedDataParallel(model, device_ids=_ids(device))  # KIT: CPU has no ids
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # KIT: lr 0.01 by default
        # KIT: the listing's train() call, plus records, a test, and a checkpoint; FIX: set_epoch.
        return _train_and_finish(rank, world_size, device, cfg, source, model, train_loader,
                                 criterion, optimizer, sampler=sampler)


def in_memory(rank: int, world_size: int, cfg: MnistConfig = MnistConfig()) -> dict:
    """The kit's fast path: the whole set as one tensor on the device, sharded like the sampler."""
    with dh.process_group(rank, world_size) as device:
        source = _data_source(cfg)
        torch.manual_seed(0)
        # No PIL images, no per-sample transforms, no worker processes: normalise all of it once.
        x, y = data.mnist_tensors(source, train=True, device=device)
        if cfg.train_subset is not None:
            x, y = x[:cfg.train_subset], y[:cfg.train_subset]
        batches = data.ShardedBatches(x, y, cfg.batch_size, rank, world_size)
        model = models.build_model(cfg.model).to(device)
        model = DistributedDataParallel(model, device_ids=_ids(device))
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        return _train_and_finish(rank, world_size, device, cfg, source, model, batches,
                                 criterion, optimizer, sampler=batches)


VARIANTS = {"faithful": listing_faithful, "fixed": listing_fixed, "memory": in_memory}


def _train_and_finish(rank, world_size, device, cfg, source, model, batches, criterion,
                      optimizer, sampler) -> dict:
    """Train cfg.epochs epochs, test, checkpoint on rank 0, reload, and return the records."""
    say = _sayer(rank, cfg.tag_rank)
    rec = training.Recorder(rank, world_size, device, say, cfg.progress_lines)
    sync = training.time_gradient_sync(model)
    for epoch in range(cfg.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)  # FIX: without it every epoch repeats epoch 0's order
        rec.train_epoch(model, batches, criterion, optimizer, epoch, sync)
        if cfg.checkpoint:
            save_checkpoint(model, cfg.checkpoint, rank)
    x_test, y_test = data.mnist_tensors(source, train=False, device=device)
    accuracy = training.evaluate(model, x_test, y_test, rank, world_size)
    reloaded = None
    if cfg.checkpoint:
        again = load_checkpoint(cfg.checkpoint, cfg.model, device)
        reloaded = training.evaluate(again, x_test, y_test, rank, world_size)
    say(f"test accuracy {accuracy:.4f} after {cfg.epochs} epoch(s), "
        f"{sum(rec.steps_per_epoch)} steps, {sum(len(b) for b in rec.labels)} samples seen")
    records = rec.records(model, accuracy, reloaded_accuracy=reloaded, data=source.describe(),
                          variant=_variant_name(sampler, batches))
    return _gather(records, rank, world_size) if cfg.gather else records


def save_checkpoint(model: DistributedDataParallel, path: str | os.PathLike, rank: int) -> None:
    """Rank 0 writes the weights atomically; a barrier keeps the others from reading too early."""
    if rank == 0:
        path = Path(path)
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


def _data_source(cfg: MnistConfig) -> data.DataSource:
    """The parent's choice of data, or (under torchrun) rank 0 prepares it first."""
    if cfg.source is not None:
        return cfg.source
    with dh.rank_zero_first() as first:
        # Rank 0 may download or generate; the others only look, after the barrier.
        return data.prepare_data(cfg.data_root, download=cfg.download if first else False,
                                 verbose=first)


def _subset(dataset, cfg: MnistConfig):
    return dataset if cfg.train_subset is None else Subset(dataset, range(cfg.train_subset))


def _ids(device: torch.device) -> list[int] | None:
    # The listing's device_ids=[rank] assumes one GPU per rank; on CPU DDP wants None.
    return [device.index] if device.type == "cuda" else None


def _sayer(rank: int, tag: bool):
    def say(message: str) -> None:
        print(f"[rank {rank}] {message}" if tag else message, flush=True)
    return say


def _variant_name(sampler, batches) -> str:
    if isinstance(batches, data.ShardedBatches):
        return "memory"
    return "fixed" if sampler is not None else "faithful"


def _gather(records: dict, rank: int, world_size: int) -> list[dict] | None:
    everyone = [None] * world_size if rank == 0 else None
    dist.gather_object(records, everyone, dst=0)
    return everyone


def summary(results: list[dict]) -> list[str]:
    """Lines for the parent to print: per rank what it saw and scored, then what all agree on."""
    lines = []
    for r in results:
        epoch_s = sum(r["epoch_s"])
        lines.append(f"rank {r['rank']}: {r['samples_seen']} samples in {len(r['loss'])} steps, "
                     f"{epoch_s:.1f} s training, final loss {r['loss'][-1]:.3f}, "
                     f"test accuracy {r['accuracy']:.4f}")
    digests = {r["param_digest"] for r in results}
    lines.append("parameters identical on every rank (DDP kept them in step): "
                 f"{'yes' if len(digests) == 1 else 'NO'} (digest {results[0]['param_digest']})")
    return lines
