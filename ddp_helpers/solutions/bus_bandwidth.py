"""Solution (lesson 07): algorithm bandwidth is bytes over time; bus bandwidth scales it by
2(N-1)/N."""


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """GB/s each link carried during an all-reduce of nbytes that took `seconds` on N ranks."""
    algbw = nbytes / seconds / 1e9
    # A ring all-reduce sends every byte around twice (reduce-scatter, then all-gather), each
    # time over N-1 of the N steps: that is what one link carries, whatever N is.
    return algbw * 2 * (world_size - 1) / world_size
