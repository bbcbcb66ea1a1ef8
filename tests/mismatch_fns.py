"""Launched functions that make each kind of collective mismatch (tests/test_mismatch.py):
the same mistakes the %%ranks cells of lesson 04 make, in a function given to dh.launch."""

import torch
import torch.distributed as dist

import ddp_helpers as dh


def mismatched(rank: int, world_size: int, kind: str) -> int:
    """Make the mismatch named by `kind` (see CELLS in test_mismatch.py)."""
    with dh.process_group(rank, world_size, verbose=False):
        t = torch.ones(4)
        if kind == "ops":
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        elif kind == "shapes":
            dist.all_reduce(torch.ones(4 + rank))
        elif kind == "fewer":
            for _ in range(4 - rank):
                dist.all_reduce(t)
        elif kind == "never":
            if rank == 0:
                dist.barrier()
        elif kind == "group":
            g = dist.new_group([0, 1])
            dist.all_reduce(t, group=g if rank == 1 else None)
        elif kind == "roots":
            dist.broadcast(t, src=rank)
        return rank
