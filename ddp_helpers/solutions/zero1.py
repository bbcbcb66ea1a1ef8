"""Exercise (lesson 10): ZeRO-1 by hand: each rank keeps the optimizer state of its slice only."""

import torch
import torch.distributed as dist

from ddp_helpers import compat


def make_shard(model: torch.nn.Module) -> torch.Tensor:
    """This rank's slice of all parameters, flattened and padded to a multiple of the world
    size, as a leaf tensor of its own: the only tensor this rank's optimizer will see."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    size = -(-flat.numel() // world)  # ceil: every rank holds the same number of elements
    flat = torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
    return flat[rank * size:(rank + 1) * size].clone().requires_grad_(True)


def zero1_step(model: torch.nn.Module, shard: torch.Tensor, optimizer) -> None:
    """After backward: this rank's slice of the mean gradient (reduce-scatter), an optimizer
    step on the slice alone, then every rank's updated slice into every model (all-gather)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    grads = torch.nn.functional.pad(grads, (0, shard.numel() * world - grads.numel()))
    mine = torch.empty_like(shard)
    # NCCL's reduce-scatter sends half an all-reduce's bytes. gloo has no real one: newer torch
    # emulates this list form with one all-reduce per rank (ProcessGroupGloo::reduce_scatter,
    # pytorch PR #149869), older torch lacks it. Either way gloo moves an all-reduce's bytes
    # here, so ZeRO-1 by hand on gloo sends about 1.5x DDP's bytes (all-reduce + all-gather).
    if dist.get_backend() != "gloo" or compat.gloo_supports_reduce_scatter():
        dist.reduce_scatter(mine, list(grads.chunk(world)))  # the sum of my slice only
    else:  # older gloo: the whole sum, then keep my slice (the same bytes, in one call)
        dist.all_reduce(grads)
        mine = grads.chunk(world)[rank]
    shard.grad = mine / world
    optimizer.step()
    gathered = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(gathered, shard.detach())
    flat, offset = torch.cat(gathered), 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
