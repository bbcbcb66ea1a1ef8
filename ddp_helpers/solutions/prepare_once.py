"""Solution (lesson 04): rank 0 prepares a file once; nobody reads it before it is complete."""

import torch.distributed as dist


def prepare_once(rank: int, path: str, write) -> None:
    """Rank 0 calls write(path); every rank then waits at a barrier until rank 0 has finished."""
    if rank == 0:
        write(path)
    dist.barrier()  # rank 0 arrives after writing, so the others leave only once the file is whole
