"""Lesson 03: what DistributedDataParallel does, one step at a time, on persistent ranks.

The notebook types the DDP lines in `%%ranks` cells; this module holds what those cells use
but is not the point of the lesson (tiny seeded models, each rank's share of a batch, a counting
communication hook), the single-process reference the parent computes, and the exercise checks.
Models and data are tiny and seeded, so every number the notebook compares is reproducible.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ..checks import Case, case
from ..data import rank_share
from ..exercises import exercise_check, require
from ..models import flat_params

# No `from __future__ import annotations` in this file: DDP's register_comm_hook checks the
# hook's annotations at run time, and strings would not match.

IN_FEATURES, CLASSES = 4, 3


def tiny_model(seed: int | None = None) -> nn.Sequential:
    """A 4 -> 8 -> 3 MLP (67 parameters); with `seed`, its initial weights depend only on it."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step (every rank can rebuild it: it depends only on `step`)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    return x, y


def rank_batch(step: int, size: int, rank: int, world_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch of `size` samples, on its device."""
    return rank_share(global_batch(step, size), rank, world_size, device)


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients as one CPU vector, in `model.parameters()` order."""
    return torch.cat([p.grad.detach().reshape(-1).cpu() for p in model.parameters()])


def single_process_training(steps: int, batch: int, lr: float = 0.1) -> dict:
    """The reference: one process, no DDP, the whole batch each step (runs in the parent)."""
    model = tiny_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = global_batch(step, batch)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"params": flat_params(model)}


def sampler_covers_every_index(per_rank: list[list[list[int]]], size: int) -> bool:
    """True if in every epoch the ranks' index lists are disjoint and cover 0..size-1."""
    epochs = len(per_rank[0])
    return all(sorted(i for rank in per_rank for i in rank[e]) == list(range(size))
               for e in range(epochs))


def epochs_repeat(per_rank: list[list[list[int]]]) -> bool:
    """True if every rank gets the same indices, in the same order, in every epoch."""
    return all(epoch == indices[0] for indices in per_rank for epoch in indices)


# ---------------------------------------------------------------- counting all-reduces


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
    state.calls += 1
    state.bucket_numels.append(bucket.buffer().numel())
    tensor = bucket.buffer().div_(dist.get_world_size())
    # async_op=True returns at once; DDP waits on the future when backward ends.
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def layered_model(layers: int = 8, width: int = 128) -> nn.Sequential:
    """`layers` Linear(width, width) blocks: 16,512 parameters, 64.5 KiB each at the default."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def count_allreduces(ddp_model, backwards: int = 2) -> dict:
    """Run `backwards` backward passes of a layered_model under DDP, counting the all-reduces
    of each and the bucket sizes (in parameters) of the last one."""
    counter = AllReduceCounter()
    ddp_model.register_comm_hook(counter, counting_allreduce_hook)
    width = ddp_model.module[0].in_features
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    calls = []
    for _ in range(backwards):
        counter.reset()
        ddp_model(x.to(next(ddp_model.parameters()).device)).square().mean().backward()
        calls.append(counter.calls)
    return {"calls per backward": calls, "bucket sizes": counter.bucket_numels}


# ---------------------------------------------------------------- models with a twist


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


def shifted_batch(rank: int, device: torch.device) -> torch.Tensor:
    """Four samples of two features whose mean is exactly 10 * rank in each feature (a rank
    whose data differs from the others', as with a non-shuffled split)."""
    pattern = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
    return (pattern + 10.0 * rank).to(device)


def average_gradients_by_hand(model: nn.Module, world_size: int) -> None:
    """What DDP's backward does, written with one all_reduce per parameter (no buckets)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum of every rank's gradient ...
        p.grad /= world_size  # ... made into the mean


# ---------------------------------------------------------------- exercises


def _local_gradients(build: Callable[[], nn.Module], rank: int, device) -> nn.Module:
    """A freshly built model whose .grad holds this rank's own gradient of a seeded batch."""
    model = build().to(device)
    width = next(model.parameters()).shape[1]
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    model(x).square().mean().backward()
    return model


@exercise_check("bucketed_average_gradients", "ranks")
def check_bucketed_average_gradients(namespace: dict) -> list[Case]:
    """Two models: after the learner's function every gradient is the mean over the ranks,
    and all of them travelled in one all_reduce. Rank 0 calls it after the others returned
    (races.rank_zero_last): an all_reduce started with async_op=True and never waited on
    FAILs every run, not in some share of them."""
    from ..ledger import Ledger
    from ..races import agreed_key, rank_zero_last

    average = require(namespace, "bucketed_average_gradients")
    rank, world_size = dist.get_rank(), dist.get_world_size()  # the pool's, at any size
    device = namespace["device"]
    cases = []
    for label, build in (("tiny_model", tiny_model),
                         ("2 layers of 16x16", lambda: layered_model(2, 16))):
        model = _local_gradients(build, rank, device)
        expected = flat_grads(model).to(device)
        dist.all_reduce(expected)  # the reference: a sum over the ranks, then the mean
        expected /= world_size
        key = agreed_key("bucketed_average_gradients", device)
        with Ledger() as ledger:  # sees the call whatever name it was imported under
            got = rank_zero_last(key, lambda m=model: average(m, world_size),
                                 lambda _, m=model: flat_grads(m).clone())
        cases.append(case(f"{label}: gradients", got, expected.cpu()))
        calls = ledger.calls
        one = [c.op for c in calls] == ["all_reduce"] and calls[0].nbytes == \
            expected.numel() * expected.element_size()
        cases.append(Case(f"{label}: collectives", one,
                          f"called {', '.join(c.text() for c in calls) or 'no collective'}; "
                          f"expected one all_reduce of {str(expected.dtype)[6:]}"
                          f"[{expected.numel()}]: one bucket for every gradient"))
    return cases


# (dataset size, world size): even, uneven, 3 ranks, padding larger than the data, one sample.
SHARD_CASES = ((10, 2), (11, 2), (11, 3), (5, 4), (2, 5), (1, 3), (7, 3))


@exercise_check("shard_indices", "ranks")
def check_shard_indices(namespace: dict) -> list[Case]:
    """The learner's shard_indices against DistributedSampler(shuffle=False), on every rank
    of several dataset and world sizes (some that need padding)."""
    shard_indices = require(namespace, "shard_indices")
    cases = []
    for n, world_size in SHARD_CASES:
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                         shuffle=False)
            cases.append(case(f"n={n}, world_size={world_size}, rank {rank}",
                              shard_indices(n, rank, world_size), list(sampler)))
    return cases
