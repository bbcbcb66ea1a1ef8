"""ddp_helpers: the multi-process side of the torch.distributed teaching kit."""

from . import engine
from .checks import compare
from .engine import *  # noqa: F403 - the engine's public names, listed once in engine.__all__
from .exercises import check, hint, reveal, solution_source
from .notebook import show, show_diff
from .runtime import (
    available_backends,
    choose_backend,
    decide_backend,
    device_ids,
    gpu_count,
    process_group,
    rank_zero_first,
)
from .timing import Laps, Timer, format_seconds, time_allreduce

__all__ = [
    *engine.__all__,
    "available_backends", "check", "choose_backend", "compare", "gpu_count", "process_group",
    "hint", "rank_zero_first", "reveal", "show", "show_diff", "solution_source",
    "decide_backend", "device_ids", "Laps", "Timer", "format_seconds", "time_allreduce",
]
