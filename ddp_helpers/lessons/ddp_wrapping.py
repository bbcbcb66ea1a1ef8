"""Lesson 03: what DistributedDataParallel does, one measured step at a time.

Every function whose first two parameters are (rank, world_size) runs on each rank through
`dh.launch`; the others are small parent-side helpers (data, the single-process reference).
Models and data are tiny and seeded, so every number the notebook prints is reproducible.
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ..runtime import process_group

IN_FEATURES, CLASSES = 4, 3


def tiny_model(seed: int) -> nn.Sequential:
    """A 4 -> 8 -> 3 MLP (67 parameters) whose initial weights depend only on `seed`."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step (every rank can rebuild it: it depends only on `step`)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    return x, y


def rank_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's contiguous share of a batch (what a sampler would hand it)."""
    per_rank = x.shape[0] // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


def rank_batch(step: int, size: int, rank: int, world_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch of `size` samples, on its device."""
    x, y = global_batch(step, size)
    return rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one CPU vector, in `model.parameters()` order."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients as one CPU vector, in `model.parameters()` order."""
    return torch.cat([p.grad.detach().reshape(-1).cpu() for p in model.parameters()])


def wrap(model: nn.Module, device: torch.device, **ddp_kwargs) -> DDP:
    """Move the model to this rank's device and wrap it (device_ids only on a GPU)."""
    model = model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, **ddp_kwargs)


def broadcast_on_wrap(rank: int, world_size: int) -> dict:
    """Seed each rank differently, then show the weights before and after DDP's constructor."""
    with process_group(rank, world_size) as device:  # rank 0 says which backend and why
        model = tiny_model(seed=rank)  # a deliberate mistake: each rank starts elsewhere
        before = flat_params(model)
        ddp = wrap(model, device)  # the constructor broadcasts rank 0's parameters and buffers
        return {"before": before, "after": flat_params(ddp.module)}


def gradients_before_and_after_sync(rank: int, world_size: int) -> dict:
    """One backward without sync (the rank's own gradient), one with it, and a manual average."""
    with process_group(rank, world_size, verbose=False) as device:
        ddp = wrap(tiny_model(seed=0), device)
        x, y = rank_batch(0, 8 * world_size, rank, world_size, device)
        with ddp.no_sync():  # backward without DDP's all-reduce: this rank's gradient only
            F.cross_entropy(ddp(x), y).backward()
        local = flat_grads(ddp.module)
        manual = local.clone().to(device)
        dist.all_reduce(manual)  # sum over ranks ...
        manual /= world_size  # ... divided by the number of ranks: the mean
        ddp.zero_grad()
        F.cross_entropy(ddp(x), y).backward()  # DDP all-reduces and averages during backward
        return {"local": local, "synced": flat_grads(ddp.module), "manual": manual.cpu()}


def ddp_training(rank: int, world_size: int, steps: int, batch: int, lr: float = 0.1) -> dict:
    """Train tiny_model for `steps` SGD steps, `batch` samples per step split over the ranks."""
    with process_group(rank, world_size, verbose=False) as device:
        ddp = wrap(tiny_model(seed=0), device)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            x, y = rank_batch(step, batch, rank, world_size, device)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"params": flat_params(ddp.module), "losses": losses}


def single_process_training(steps: int, batch: int, lr: float = 0.1) -> dict:
    """The reference: one process, no DDP, the whole batch each step (runs in the parent)."""
    model = tiny_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": flat_params(model), "losses": losses}


def sampler_indices(rank: int, world_size: int, dataset_size: int, epochs: int,
                    call_set_epoch: bool, seed: int = 0) -> list[list[int]]:
    """The dataset indices DistributedSampler gives this rank in each epoch."""
    with process_group(rank, world_size, verbose=False):
        sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)
        per_epoch = []
        for epoch in range(epochs):
            if call_set_epoch:
                sampler.set_epoch(epoch)  # the shuffle is seeded with seed + epoch
            per_epoch.append(list(sampler))
        return per_epoch


class AllReduceCounter:
    """The state of `counting_allreduce_hook`: how many all-reduces, and of what sizes."""

    def __init__(self) -> None:
        self.calls = 0
        self.bucket_numels: list[int] = []

    def reset(self) -> None:
        """Start counting afresh (call before a backward)."""
        self.calls = 0
        self.bucket_numels = []


def counting_allreduce_hook(state: AllReduceCounter, bucket: dist.GradBucket
                            ) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that does what DDP does by default (average) and counts it."""
    # No `from __future__ import annotations` in this file: DDP checks these two annotations.
    state.calls += 1
    state.bucket_numels.append(bucket.buffer().numel())
    tensor = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def accumulate_gradients(rank: int, world_size: int, micro_batches: int, batch: int,
                         use_no_sync: bool, lr: float = 0.1) -> dict:
    """One optimizer step from `micro_batches` backwards per rank; count the all-reduces."""
    with process_group(rank, world_size, verbose=False) as device:
        ddp = wrap(tiny_model(seed=0), device)
        counter = AllReduceCounter()
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        x, y = rank_batch(0, batch, rank, world_size, device)  # the batch of one big step
        xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == micro_batches - 1
            # no_sync: gradients only accumulate locally; the last backward all-reduces the sum
            ctx = ddp.no_sync() if use_no_sync and not last else nullcontext()
            with ctx:
                loss = F.cross_entropy(ddp(xm), ym) / micro_batches
                loss.backward()
        opt.step()
        return {"params": flat_params(ddp.module), "allreduce_calls": counter.calls}


def layered_model(layers: int = 8, width: int = 128) -> nn.Sequential:
    """`layers` Linear(width, width) blocks (257 KiB of parameters each): buckets worth counting."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def allreduce_calls_per_backward(rank: int, world_size: int, bucket_caps_mb: list[float],
                                 steps: int = 6) -> list[dict]:
    """For each bucket_cap_mb: all-reduce calls in each backward and mean seconds per step."""
    out = []
    with process_group(rank, world_size, verbose=False) as device:
        x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank)).to(device)
        for cap in bucket_caps_mb:
            ddp = wrap(layered_model(), device, bucket_cap_mb=cap)
            counter = AllReduceCounter()
            ddp.register_comm_hook(counter, counting_allreduce_hook)
            calls, numels, seconds = [], [], []
            for _ in range(steps):
                counter.reset()
                start = time.perf_counter()
                ddp(x).square().mean().backward()
                seconds.append(time.perf_counter() - start)
                calls.append(counter.calls)
                numels.append(counter.bucket_numels)
            # The first backward uses DDP's initial buckets; after it DDP rebuilds them in the
            # order the gradients arrived, so steps 2.. show the steady state.
            out.append({"bucket_cap_mb": cap, "calls": calls, "bucket_numels": numels[-1],
                        "seconds_per_step": sum(seconds[2:]) / len(seconds[2:])})
    return out


class TwoHeads(nn.Module):
    """A body with two heads; forward uses only one, so the other head never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN_FEATURES, 8)
        self.head = nn.Linear(8, CLASSES)
        self.spare_head = nn.Linear(8, CLASSES)  # parameters 4 and 5: never used below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def train_with_unused_head(rank: int, world_size: int, find_unused_parameters: bool,
                           steps: int = 2) -> dict:
    """Train TwoHeads with DDP; without find_unused_parameters the second step raises."""
    with process_group(rank, world_size, verbose=False) as device:
        ddp = wrap(TwoHeads(), device, find_unused_parameters=find_unused_parameters)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = rank_batch(step, 8 * world_size, rank, world_size, device)
            opt.zero_grad()
            try:
                loss = F.cross_entropy(ddp(x), y)
            except RuntimeError:
                if rank == 0:
                    raise
                # Every rank raises this same error. The others wait here for rank 0, which
                # never comes: dh.launch then always reports rank 0's copy and stops the rest.
                dist.barrier()
                raise
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}


def average_gradients_by_hand(model: nn.Module, world_size: int) -> None:
    """What DDP's backward does, written with one all_reduce per parameter (no buckets)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum of every rank's gradient ...
        p.grad /= world_size  # ... made into the mean


def ddp_from_primitives(rank: int, world_size: int, steps: int, batch: int, lr: float = 0.1,
                        average_gradients=average_gradients_by_hand) -> dict:
    """ddp_training without DDP: broadcast the parameters once, average gradients each step."""
    with process_group(rank, world_size, verbose=False) as device:
        model = tiny_model(seed=rank).to(device)  # different on each rank, as before wrapping
        for p in model.parameters():  # what DDP's constructor does: rank 0's values everywhere
            dist.broadcast(p.data, src=0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            x, y = rank_batch(step, batch, rank, world_size, device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model, world_size)  # what DDP's backward hooks do
            opt.step()
            losses.append(loss.item())
        return {"params": flat_params(model), "losses": losses}


def save_on_rank0_load_everywhere(rank: int, world_size: int, path: str) -> dict:
    """Train one step, save model.module.state_dict() on rank 0, load it on every rank."""
    with process_group(rank, world_size, verbose=False) as device:
        ddp = wrap(tiny_model(seed=0), device)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = rank_batch(0, 8 * world_size, rank, world_size, device)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if rank == 0:  # the parameters are equal on all ranks: one copy is enough
            # .module: the plain model, so keys have no "module." prefix and load without DDP
            torch.save(ddp.module.state_dict(), path)
        dist.barrier()  # nobody reads the file before rank 0 has finished writing it
        # map_location: a checkpoint saved from cuda:0 would otherwise load onto cuda:0 on
        # every rank; here each rank puts it on its own device.
        state = torch.load(path, map_location=device, weights_only=True)
        fresh = tiny_model(seed=123)  # different weights, so a successful load is visible
        fresh.load_state_dict(state)
        return {"ddp_keys": list(ddp.state_dict())[:2], "saved_keys": list(state)[:2],
                "trained": flat_params(ddp.module), "loaded": flat_params(fresh)}
