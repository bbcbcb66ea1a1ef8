"""Solution (lesson 01): all-reduce through rank 0 with send/recv only (correct, but rank 0 is
a bottleneck)."""

import torch
import torch.distributed as dist


def naive_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place: everyone sends to rank 0, rank 0 sends the sum back."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        inbox = torch.empty_like(tensor)
        for src in range(1, world_size):
            dist.recv(inbox, src=src)  # rank 0 receives (N-1) whole tensors...
            tensor += inbox
        for dst in range(1, world_size):
            dist.send(tensor, dst=dst)  # ...and sends (N-1) whole tensors back
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    return tensor
