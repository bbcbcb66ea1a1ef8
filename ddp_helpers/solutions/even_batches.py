"""Solution (lesson 07): agree on the smallest batch count before the loop, so no rank leaves it
early and no rank waits in an all-reduce that its peer never calls."""

import torch
import torch.distributed as dist

import ddp_helpers as dh

GRAD_NUMEL = 7850  # the seed model's gradient, as in lessons/performance_and_debugging


def even_batches(rank: int, world_size: int, batches_per_rank: list[int]) -> float:
    """Run the same number of all-reduce steps on every rank, then sum the loss over ranks."""
    with dh.process_group(rank, world_size, verbose=False, timeout_s=20) as device:
        # Every rank offers its own count; MIN hands every rank the count all of them can run.
        # (DistributedSampler pads the shards to equal counts up front; torch's Join context
        # manager is the alternative that lets ranks with more data keep going.)
        steps = torch.tensor([batches_per_rank[rank]], device=device)
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        loss = torch.zeros(1, device=device)
        for _ in range(int(steps.item())):
            dist.all_reduce(torch.ones(GRAD_NUMEL, device=device))
            loss += 1.0
        dist.all_reduce(loss)  # the end-of-epoch collective every rank now reaches
        return loss.item()
