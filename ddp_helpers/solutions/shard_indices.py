"""Exercise (lesson 03): the indices DistributedSampler(shuffle=False) hands one rank."""

import math


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Pad 0..n-1 to a multiple of world_size by repeating it from its start, then deal it out:
    rank r takes every world_size-th index, starting at r."""
    total = math.ceil(n / world_size) * world_size  # every rank gets the same number
    indices = (list(range(n)) * math.ceil(total / n))[:total]  # the padding repeats 0, 1, ...
    return indices[rank:total:world_size]
