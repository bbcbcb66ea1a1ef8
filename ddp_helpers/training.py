"""What a rank records while it trains, and the test-set score: shared by the MNIST variants.

The training loop itself is written out in each variant (lessons/mnist_two_gpus.py), as the
listing writes it; the loop calls `Recorder.step` once per batch. The recorder times each step
without touching the loop: a forward pre-hook on the model marks when the batch has arrived, and
`dh.time_allreduce` (a DDP comm hook, CUDA events on GPUs) times the gradient all-reduce.
Everything returned is plain Python or CPU tensors, so it pickles to the parent.
"""

from __future__ import annotations

import math
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from .models import param_digest, param_sum
from .timing import time_allreduce


class Recorder:
    """One rank's records while it trains: per step the loss, the labels and where the time went
    (waiting for data, compute, gradient all-reduce); per epoch its seconds and sample order."""

    def __init__(self, model: DistributedDataParallel, rank: int, world_size: int,
                 device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.loss: list[float] = []
        self.labels: list[torch.Tensor] = []
        self.data_s: list[float] = []
        self.compute_s: list[float] = []
        self.sync_s: list[float] = []  # NaN where no all-reduce was timed (never a made-up 0)
        self.allreduces: list[int] = []  # gradient buckets all-reduced per step
        self.epoch_s: list[float] = []
        self.epochs: list[int] = []
        self.steps_per_epoch: list[int] = []
        self.indices: list[torch.Tensor] = []
        self._allreduce = time_allreduce(model)  # DDP's own averaging, with its span marked
        # The batch is on the device when forward starts: the time before that is the loader's.
        model.register_forward_pre_hook(self._batch_arrived)
        self._last = self._arrived = self._epoch_start = None

    def start_epoch(self, epoch: int, batches) -> None:
        """Call before each epoch: starts its clock, and notes its sample order where known."""
        self._close_epoch()
        self.epochs.append(epoch)
        order = planned_indices(batches)
        if order is not None:
            self.indices.append(order)
        self._epoch_start = self._last = perf_counter()
        self.steps_per_epoch.append(0)
        self._allreduce.reset()

    def step(self, loss: torch.Tensor, target: torch.Tensor) -> None:
        """Call once per batch, after optimizer.step(): records the loss, labels and times."""
        value = loss.item()  # waits for the GPU, so the step's wall time below is complete
        done = perf_counter()
        synced = self._allreduce.seconds()  # None: no all-reduce ran (e.g. under no_sync)
        self.allreduces.append(self._allreduce.buckets)
        self._allreduce.reset()
        arrived = self._arrived if self._arrived is not None else self._last
        self.loss.append(value)
        self.labels.append(target.detach().to("cpu", torch.uint8))
        self.data_s.append(arrived - self._last)
        self.compute_s.append(done - arrived - (synced or 0.0))
        self.sync_s.append(math.nan if synced is None else synced)
        self.steps_per_epoch[-1] += 1
        self._last, self._arrived = done, None

    def records(self, model: nn.Module, accuracy: float, **extra) -> dict:
        """This rank's records: per-step lists, samples seen, accuracy and a parameter checksum."""
        self._close_epoch()
        module = model.module if isinstance(model, DistributedDataParallel) else model
        labels = torch.cat(self.labels) if self.labels else torch.empty(0, dtype=torch.uint8)
        return {
            "rank": self.rank, "world_size": self.world_size, "device": str(self.device),
            "loss": self.loss, "data_s": self.data_s, "compute_s": self.compute_s,
            "sync_s": self.sync_s, "allreduces": self.allreduces, "epoch_s": self.epoch_s,
            "epochs": self.epochs,
            "steps_per_epoch": self.steps_per_epoch, "samples_seen": len(labels),
            "labels": labels, "indices": torch.cat(self.indices) if self.indices else None,
            "accuracy": accuracy, "param_sum": param_sum(module),
            "param_digest": param_digest(module), **extra,
        }

    def _batch_arrived(self, module, inputs) -> None:
        self._arrived = perf_counter()

    def _close_epoch(self) -> None:
        if self._epoch_start is not None:
            self.epoch_s.append(self._last - self._epoch_start)
            self._epoch_start = None


def average_gradients(model: nn.Module) -> None:
    """What DDP does for you, in one piece, after backward: flatten, all-reduce, divide, copy."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def planned_indices(batches) -> torch.Tensor | None:
    """The sample indices an epoch will visit, where the loader can say so in advance."""
    sampler = getattr(batches, "sampler", None)
    if isinstance(batches, DataLoader) and isinstance(sampler, DistributedSampler):
        return torch.tensor(list(sampler), dtype=torch.int64)  # set_epoch already applied
    if callable(getattr(batches, "indices", None)):
        return batches.indices().cpu()
    return None  # the listing's shuffle=True: a RandomSampler draws its order as it goes


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int,
             batch_size: int = 2000) -> float:
    """Test accuracy: each rank scores its slice of the test set, one all-reduce adds them up."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    module.eval()  # the plain module: DDP's forward is for training steps taken by every rank
    lo, hi = rank * len(x) // world_size, (rank + 1) * len(x) // world_size
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(lo, hi, batch_size):
        end = min(start + batch_size, hi)
        correct += (module(x[start:end]).argmax(1) == y[start:end]).sum()
    counts = torch.stack([correct, torch.tensor(hi - lo, device=x.device)])
    if dist.is_initialized():
        dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()
