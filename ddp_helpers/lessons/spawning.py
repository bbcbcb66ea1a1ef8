"""Lesson 02's functions: what a rank's environment holds, start methods, failures, torchrun.

The per-rank functions here are launched by dh.launch (and by plain mp.spawn for contrast);
`measure_start_methods` runs in the parent. Run as a module under torchrun, this file prints
the variables torchrun sets: `torchrun --nproc-per-node 2 -m ddp_helpers.lessons.spawning`.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

import torch.distributed as dist

from ddp_helpers.runtime import process_group

RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS")
# Values that change from run to run; shown as a description so printed tables stay comparable.
VARYING = {"MASTER_PORT": "(a free port)", "TORCHELASTIC_RUN_ID": "(a fresh id)"}


def rank_environment(rank: int, world_size: int) -> dict:
    """What a freshly started rank sees: its rendezvous variables, pid, parent and __main__."""
    env = {name: os.environ.get(name) for name in RENDEZVOUS_VARS}
    main = sys.modules.get("__main__")
    return {"rank_arg": rank, "env": env, "pid": os.getpid(), "parent_pid": os.getppid(),
            "main_module": getattr(main, "__spec__", None) and main.__spec__.name,
            "start_method": multiprocessing.get_start_method(allow_none=True)}


def describe_environments(records: list[dict]) -> str:
    """A comparable table of rank_environment records: varying values described, not shown."""
    lines = [f"{'':<12}" + "".join(f"rank {r['rank_arg']:<10}" for r in records)]
    for name in RENDEZVOUS_VARS:
        values = [r["env"][name] for r in records]
        shown = [VARYING.get(name, v) if v is not None else "(unset)" for v in values]
        lines.append(f"{name:<12}" + "".join(f"{v:<15}" for v in shown))
    same_port = len({r["env"]["MASTER_PORT"] for r in records}) == 1
    pids = {r["pid"] for r in records}
    lines.append(f"every rank has the same MASTER_PORT: {same_port}")
    lines.append(f"every rank is its own process (distinct pids): {len(pids) == len(records)}")
    return "\n".join(lines)


def print_environment(rank: int, world_size: int) -> None:
    """Print this rank's rendezvous variables and pid (for plain mp.spawn, which returns None)."""
    env = " ".join(f"{k}={os.environ.get(k)}" for k in RENDEZVOUS_VARS)
    print(f"rank argument {rank}: pid {os.getpid()} {env}", flush=True)


# ---------------------------------------------------------------- start methods


def noop() -> None:
    """Do nothing: what a start-up measurement starts."""


def time_start(method: str, nprocs: int = 2) -> float:
    """Seconds to start nprocs processes with `method`, run noop, and join them."""
    ctx = multiprocessing.get_context(method)
    start = time.perf_counter()
    procs = [ctx.Process(target=noop) for _ in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a {method} child exited with code {p.exitcode}; run "
                               f"time_start({method!r}) in a terminal to see its error")
    return time.perf_counter() - start


def measure_start_methods(methods: tuple[str, ...] = ("spawn", "forkserver", "fork"),
                          nprocs: int = 2, repeats: int = 2) -> dict[str, float]:
    """Median start-up seconds of each start method (the forkserver is warmed up first)."""
    if "forkserver" in methods:
        time_start("forkserver", 1)  # the server's own start-up happens once per kernel
    out = {}
    for method in methods:
        out[method] = statistics.median(time_start(method, nprocs) for _ in range(repeats))
    return out


# ---------------------------------------------------------------- what goes wrong


def chatty(rank: int, world_size: int, lines: int = 3) -> int:
    """Print a few lines with pauses, so live output interleaves across ranks."""
    for i in range(lines):
        print(f"step {i}", flush=True)
        time.sleep(0.05 * (rank + 1))
    return lines


def raises_on(rank: int, world_size: int, bad_rank: int = 1) -> str:
    """Every rank joins the group; `bad_rank` raises while the others wait at a barrier."""
    with process_group(rank, world_size, verbose=False):
        if rank == bad_rank:
            print("reading my shard...", flush=True)
            raise ValueError(f"rank {rank} found a corrupt batch (on purpose, for the lesson)")
        dist.barrier()  # never passes: the bad rank never arrives; the launcher stops us
        return "done"


def hangs_on(rank: int, world_size: int, stuck_rank: int = 1) -> str:
    """`stuck_rank` waits forever for a message nobody sends; the others wait at a barrier."""
    with process_group(rank, world_size, verbose=False):
        if rank == stuck_rank:
            print("waiting for a message from rank 0...", flush=True)
            time.sleep(3600)  # stands in for a recv() that no rank will ever match
        else:
            print("at the barrier", flush=True)
        dist.barrier()
        return "done"


# ---------------------------------------------------------------- torchrun


def torchrun_report() -> str | None:
    """Under torchrun: gather every rank's variables; rank 0 returns them as a table."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: run this under torchrun, e.g. "
                           "torchrun --nproc-per-node 2 -m ddp_helpers.lessons.spawning")
    with process_group(verbose=False):
        mine = {name: os.environ.get(name) for name in TORCHRUN_VARS}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # rank 0 prints all, so the output has one order
        if dist.get_rank() != 0:
            return None
    lines = [f"{'':<28}" + "".join(f"rank {r:<9}" for r in range(len(everyone)))]
    for name in TORCHRUN_VARS:
        shown = [VARYING.get(name, e[name]) if e[name] is not None else "(unset)"
                 for e in everyone]
        lines.append(f"{name:<28}" + "".join(f"{v:<14}" for v in shown))
    return "\n".join(lines)


if __name__ == "__main__":
    table = torchrun_report()
    if table:
        print(table, flush=True)
