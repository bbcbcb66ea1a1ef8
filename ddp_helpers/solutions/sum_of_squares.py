"""Solution: every rank contributes (rank + 1) ** 2 and all-reduces, so each holds the total."""

import torch
import torch.distributed as dist

import ddp_helpers as dh


def sum_of_squares(rank: int, world_size: int) -> float:
    """Return 1 + 4 + ... + world_size ** 2, computed with one all_reduce."""
    with dh.process_group(rank, world_size, verbose=False) as device:
        t = torch.tensor([float((rank + 1) ** 2)], device=device)
        dist.all_reduce(t)  # SUM is the default op
        return t.item()
