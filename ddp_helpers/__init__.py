"""ddp_helpers: the multi-process side of the torch.distributed teaching kit."""

from .checks import compare
from .errors import LaunchError, LaunchRefused, LaunchTimeout, RankDied, RankRaised
from .launch import free_port, launch
from .notebook import exercise, reveal, show
from .runtime import (
    available_backends,
    choose_backend,
    gpu_count,
    print0,
    process_group,
    rank_zero_first,
)

__all__ = [
    "LaunchError", "LaunchRefused", "LaunchTimeout", "RankDied", "RankRaised",
    "available_backends", "choose_backend", "compare", "exercise", "free_port", "gpu_count",
    "launch", "print0", "process_group", "rank_zero_first", "reveal", "show",
]
