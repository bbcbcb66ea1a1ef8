"""Solution (lesson 12, bug 1): every rank calls the all-reduce; only the print is rank 0's."""

import torch.distributed as dist

LOG_EVERY = 5


def report_loss(loss, step):
    """Every 5th step: the loss averaged over the ranks (on every rank), printed by rank 0."""
    if step % LOG_EVERY != LOG_EVERY - 1:  # the same test on every rank: no rank in it
        return None
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    avg /= dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"step {step}: mean loss {avg.item():.3f}")
    return avg.item()
