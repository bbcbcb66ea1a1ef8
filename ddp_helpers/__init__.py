"""ddp_helpers: the multi-process side of the torch.distributed teaching kit."""

from .checks import compare
from .errors import LaunchError, LaunchRefused, LaunchTimeout, RankDied, RankRaised
from .exercises import check, reveal, solution_source
from .launch import free_port, launch
from .notebook import show, show_diff
from .ranks import Ranks
from .ranks_magic import load_ipython_extension
from .runtime import (
    available_backends,
    choose_backend,
    decide_backend,
    device_ids,
    gpu_count,
    print0,
    process_group,
    rank_zero_first,
)
from .timing import Laps, Timer, format_seconds, time_allreduce

__all__ = [
    "LaunchError", "LaunchRefused", "LaunchTimeout", "RankDied", "RankRaised", "Ranks",
    "available_backends", "check", "choose_backend", "compare", "free_port", "gpu_count",
    "launch", "load_ipython_extension", "print0", "process_group", "rank_zero_first", "reveal",
    "show", "show_diff", "solution_source",
    "decide_backend", "device_ids", "Laps", "Timer", "format_seconds", "time_allreduce",
]
