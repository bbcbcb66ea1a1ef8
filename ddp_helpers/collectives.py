"""Counting the collectives a piece of code calls, by name, from torch's CommDebugMode: the
lessons that write DDP by hand (09) and shard it (10) check their versions with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from . import compat


def count_collectives(work: Callable[[], object]) -> dict[str, int]:
    """Run work() under torch's CommDebugMode; return {collective: calls}, e.g.
    {"all_reduce": 6}. CommDebugMode sees torch.distributed's ops and DDP's C++ reducer alike."""
    mode_class = compat.comm_debug_mode()
    if mode_class is None:  # present on every torch the kit supports; said plainly if not
        raise RuntimeError("this torch has no CommDebugMode, so collectives cannot be counted")
    mode = mode_class()
    with mode:
        work()
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        counts[_op_name(op)] += n
    return dict(sorted(counts.items()))


def _op_name(op) -> str:
    """'c10d.allreduce_' or '_c10d_functional.all_reduce' -> 'all_reduce'; 'broadcast' etc."""
    name = str(op).split(".")[-1].strip("_").replace("_base", "")
    return {"allreduce": "all_reduce", "allgather": "all_gather",
            "allgather_into_tensor": "all_gather"}.get(name, name)
