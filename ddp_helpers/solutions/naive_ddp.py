"""Exercise (lesson 09): DDP by hand, the naive way: broadcast once, one all-reduce per gradient."""

import torch
import torch.distributed as dist


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Give every rank rank 0's parameters, frozen ones included (DDP's constructor does this)."""
    with torch.no_grad():
        for p in model.parameters():  # each tensor once: a tied weight is one parameter
            dist.broadcast(p, src=0)


def naive_average(model: torch.nn.Module) -> None:
    """After backward: replace each gradient by its mean over the ranks."""
    for p in model.parameters():
        if p.grad is None:  # frozen (requires_grad=False) or unused: nothing to average
            continue
        dist.all_reduce(p.grad)  # the sum over the ranks ...
        p.grad /= dist.get_world_size()  # ... made into the mean
