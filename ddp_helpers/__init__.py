"""ddp_helpers: the multi-process side of the torch.distributed teaching kit."""

from .checks import compare
from .engine import (
    LaunchError,
    LaunchRefused,
    LaunchTimeout,
    RankDied,
    RankRaised,
    Ranks,
    clean_error_text,
    clean_traceback,
    free_port,
    launch,
    load_ipython_extension,
)
from .exercises import check, reveal, solution_source
from .notebook import show, show_diff
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
    "available_backends", "check", "choose_backend", "clean_error_text", "clean_traceback",
    "compare", "free_port", "gpu_count",
    "launch", "load_ipython_extension", "print0", "process_group", "rank_zero_first", "reveal",
    "show", "show_diff", "solution_source",
    "decide_backend", "device_ids", "Laps", "Timer", "format_seconds", "time_allreduce",
]
