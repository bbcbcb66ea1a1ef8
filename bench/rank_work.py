"""The per-rank functions the benchmarks launch (importable, as spawned ranks need)."""

import torch
import torch.distributed as dist

import ddp_helpers as dh


def trivial(rank: int) -> int:
    """Nothing but being started and returning: measures the launcher itself."""
    return rank


def gloo_all_reduce(rank: int, world_size: int) -> float:
    """Start-up plus a process group and one all_reduce: the smallest real DDP-shaped run."""
    with dh.process_group(rank, world_size, verbose=False):
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()
