"""The per-rank training loop: trains, and records what the parent plots and checks.

Per step it records the loss, the labels it trained on, and the time split into waiting for data,
computing, and the gradient all-reduce. At the end: samples seen, test accuracy, a checksum of
the parameters. Everything returned is plain Python or CPU tensors, so it pickles to the parent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from .models import param_digest, param_sum


class SyncTimer:
    """Seconds spent in DDP's gradient all-reduce, summed until `take()` reads and resets them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        """The seconds since the last take()."""
        s, self.seconds = self.seconds, 0.0
        return s


def _timed_allreduce(state, bucket):  # no annotations: DDP checks them, and ours are strings
    # DDP's default hook averages the same way (divide by world size, then sum), but returns at
    # once and overlaps the sum with backward. Waiting here is what makes its time measurable.
    t0 = perf_counter()
    grads = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(grads)
    state.seconds += perf_counter() - t0
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grads)
    return done


def time_gradient_sync(model: DistributedDataParallel) -> SyncTimer | None:
    """On CPU, time DDP's all-reduce with a comm hook; on GPUs (NCCL overlaps it) return None."""
    if model.device_type == "cuda":
        return None  # a blocking wait would only time the launch of NCCL's kernels
    timer = SyncTimer()
    model.register_comm_hook(timer, _timed_allreduce)
    return timer


class Recorder:
    """Collects one rank's records while it trains; `records()` gives them as plain values."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 say: Callable[[str], None] = print, progress_lines: int = 4):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.say, self.progress_lines = say, progress_lines
        self.loss: list[float] = []
        self.data_s: list[float] = []
        self.compute_s: list[float] = []
        self.sync_s: list[float] = []
        self.labels: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.epoch_s: list[float] = []
        self.steps_per_epoch: list[int] = []

    def train_epoch(self, model: nn.Module, batches: Iterable, criterion: nn.Module,
                    optimizer: torch.optim.Optimizer, epoch: int, sync: SyncTimer | None) -> None:
        """One pass over `batches`: the listing's train() plus records and a few progress lines."""
        model.train()
        idx = _planned_indices(batches)
        if idx is not None:
            self.indices.append(idx)
        n = len(batches)  # type: ignore[arg-type]
        marks = {max(1, math.ceil(n * (i + 1) / self.progress_lines))
                 for i in range(self.progress_lines)}
        cuda = self.device.type == "cuda"
        start = last = perf_counter()
        for step, (x, y) in enumerate(batches, 1):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            got_data = perf_counter()
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()  # DDP all-reduces the gradients during this call
            optimizer.step()
            value = loss.item()  # waits for the GPU, so the step's time is real
            if cuda:
                torch.cuda.synchronize(self.device)
            done = perf_counter()
            synced = sync.take() if sync is not None else math.nan
            self.loss.append(value)
            self.labels.append(y.to("cpu", torch.uint8))
            self.data_s.append(got_data - last)
            self.compute_s.append(done - got_data - (0.0 if math.isnan(synced) else synced))
            self.sync_s.append(synced)
            last = done
            if step in marks:
                self.say(f"epoch {epoch + 1} step {step}/{n}: loss {value:.3f}")
        self.epoch_s.append(perf_counter() - start)
        self.steps_per_epoch.append(n)

    def records(self, model: nn.Module, accuracy: float, **extra) -> dict:
        """This rank's records: per-step lists, samples seen, accuracy and a parameter checksum."""
        module = model.module if isinstance(model, DistributedDataParallel) else model
        labels = torch.cat(self.labels) if self.labels else torch.empty(0, dtype=torch.uint8)
        return {
            "rank": self.rank, "world_size": self.world_size, "device": str(self.device),
            "loss": self.loss, "data_s": self.data_s, "compute_s": self.compute_s,
            "sync_s": self.sync_s, "epoch_s": self.epoch_s,
            "steps_per_epoch": self.steps_per_epoch, "samples_seen": len(labels),
            "labels": labels,
            "indices": torch.cat(self.indices) if self.indices else None,
            "accuracy": accuracy, "param_sum": param_sum(module),
            "param_digest": param_digest(module), **extra,
        }


def _planned_indices(batches) -> torch.Tensor | None:
    """The sample indices this epoch will visit, where the loader can say so in advance."""
    if isinstance(batches, DataLoader) and isinstance(batches.sampler, DistributedSampler):
        return torch.tensor(list(batches.sampler), dtype=torch.int64)  # set_epoch already applied
    if hasattr(batches, "indices") and callable(batches.indices):
        return batches.indices().cpu()
    return None  # the listing's shuffle=True: a RandomSampler that draws its order as it goes


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
