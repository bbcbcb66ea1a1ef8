"""Lesson 04: what a barrier guarantees, what goes wrong without one, and how hangs are found.

Every function whose first two parameters are (rank, world_size) runs on each rank through
`dh.launch`; the others are small helpers. Errors a demo provokes on purpose are caught on the
rank and returned as text, so the notebook prints every rank's message in rank order.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..runtime import process_group

LINES = 5  # lines in the prepared file, plus a final "END" line that marks it complete


def skewed_arrivals(rank: int, world_size: int, work_seconds: list[float]) -> dict:
    """Each rank works for work_seconds[rank], then waits in dist.barrier: when did it do what?"""
    with process_group(rank, world_size):  # rank 0 says which backend and why
        dist.barrier()  # a common starting line, so the timeline starts from the same moment
        start = time.time()  # wall clock: comparable between processes on one machine
        time.sleep(work_seconds[rank])  # stands for uneven work: a slow batch, a checkpoint
        arrive = time.time()
        dist.barrier()  # nobody leaves until everybody has arrived
        leave = time.time()
        return {"rank": rank, "start": start, "arrive": arrive, "leave": leave}


def timeline(records: list[dict]) -> list[dict]:
    """Per-rank times in seconds from the earliest start (parent side)."""
    t0 = min(r["start"] for r in records)
    return [{"rank": r["rank"], "start": r["start"] - t0, "arrive": r["arrive"] - t0,
             "leave": r["leave"] - t0, "waited": r["leave"] - r["arrive"]} for r in records]


def write_slowly(path: str, line_seconds: float = 0.2) -> None:
    """Write the prepared file the naive way: in place, one line at a time (a slow download)."""
    with open(path, "w") as f:
        for i in range(LINES):
            f.write(f"sample {i}\n")
            f.flush()  # make the half-written state visible to other processes
            time.sleep(line_seconds)
        f.write("END\n")


def inspect_file(path: str) -> str:
    """What a reader finds: 'missing', 'half-written (k of N lines)' or 'complete'."""
    if not os.path.exists(path):
        return "missing"
    with open(path) as f:
        lines = f.read().splitlines()
    if lines[-1:] == ["END"] and len(lines) == LINES + 1:
        return "complete"
    return f"half-written ({len(lines)} of {LINES + 1} lines)"


def prepare_without_barrier(rank: int, world_size: int, path: str,
                            line_seconds: float = 0.2) -> str:
    """Rank 0 prepares the file; the others read it at once. Returns what each rank found."""
    with process_group(rank, world_size, verbose=False):
        if rank == 0:
            write_slowly(path, line_seconds)
        return inspect_file(path)  # a race: rank 1 may look before rank 0 is done


def prepare_with_barrier(rank: int, world_size: int, path: str,
                         line_seconds: float = 0.2) -> str:
    """The same, with a barrier between writing and reading: every rank finds the whole file."""
    with process_group(rank, world_size, verbose=False):
        if rank == 0:
            write_slowly(path, line_seconds)
        dist.barrier()  # rank 0 arrives only after writing; the others wait here for it
        return inspect_file(path)


def prepare_with(rank: int, world_size: int, path: str, prepare_once,
                 line_seconds: float = 0.2) -> str:
    """Run an exercise's prepare_once(rank, path, write) and report what each rank found."""
    with process_group(rank, world_size, verbose=False):
        prepare_once(rank, path, lambda p: write_slowly(p, line_seconds))
        return inspect_file(path)


def monitored_barrier_demo(rank: int, world_size: int, late_ranks: list[int],
                           timeout_s: float = 1.0) -> str:
    """Ranks in late_ranks stay busy past the timeout; the rest call monitored_barrier."""
    with process_group(rank, world_size, backend="gloo", verbose=False):  # gloo only
        if rank in late_ranks:
            time.sleep(timeout_s + 1.5)  # stuck in slow work while the others wait
            return "busy: never reached the barrier"
        try:
            # wait_all_ranks: rank 0 collects every missing rank instead of stopping at the first
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            return f"RuntimeError: {e}"
        return "passed the barrier"


def mismatched_collectives(rank: int, world_size: int, timeout_s: float = 3.0) -> dict:
    """Rank 0 calls all_reduce while the others call broadcast: a bug DETAIL mode names."""
    with process_group(rank, world_size, backend="gloo", timeout_s=timeout_s, verbose=False):
        t = torch.full((3,), float(rank + 1))
        start = time.monotonic()
        try:
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)  # the bug: a different collective on this rank
            error = None
        except RuntimeError as e:
            error = f"RuntimeError: {e}"
        return {"error": error, "seconds": time.monotonic() - start, "tensor": t}


def collective_timeout(rank: int, world_size: int, timeout_s: float = 2.0) -> dict:
    """init_process_group(timeout=...): rank 0's all_reduce gives up when rank 1 never comes."""
    # Called directly (not through dh.process_group) to show the argument where it is set.
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        if rank != 0:
            time.sleep(timeout_s + 1.0)  # hung: a deadlock, a dead data loader, an endless loop
            return {"error": None, "seconds": None}
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3))
            return {"error": None, "seconds": time.monotonic() - start}
        except RuntimeError as e:
            return {"error": f"RuntimeError: {e}", "seconds": time.monotonic() - start}
    finally:
        dist.destroy_process_group()


def hang_forever(rank: int, world_size: int) -> None:
    """Rank 1 never reaches the barrier; the run only ends when dh.launch's timeout stops it."""
    with process_group(rank, world_size, verbose=False):
        if rank == 1:
            print("rank 1: stuck in work that never ends", flush=True)
            time.sleep(3600)
        print(f"rank {rank}: waiting in dist.barrier()", flush=True)
        dist.barrier()
