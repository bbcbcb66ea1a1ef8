"""Exercise (lesson 03): the indices DistributedSampler(shuffle=False) hands one rank."""

import math


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Pad 0..n-1 to a multiple of world_size from its start, then take every world_size-th."""
    total = math.ceil(n / world_size) * world_size
    indices = list(range(n))
    indices += indices[:total - n]  # padding: every rank gets the same number of samples
    return indices[rank:total:world_size]
