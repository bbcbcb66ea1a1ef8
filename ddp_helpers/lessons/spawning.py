"""Lesson 02's functions: what a rank's environment holds, start methods, failures, torchrun.

The per-rank functions here are started by dh.launch, by plain mp.spawn and by
torch.multiprocessing.start_processes, for contrast; the other functions run in the parent. Run
as a module under torchrun, this file prints the variables torchrun sets:
`torchrun --nproc-per-node 2 -m ddp_helpers.lessons.spawning`.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_helpers import RankRaised, clean_traceback, free_port, launch, looks_like_peer_failure
from ddp_helpers.checks import Case, case
from ddp_helpers.exercises import exercise_check, require
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


class Captured:
    """What child processes wrote while `children_output` was active."""

    raw: str = ""

    @property
    def text(self) -> str:
        """The output with machine paths shortened and library frames folded."""
        return clean_traceback(self.raw)

    @property
    def lines(self) -> list[str]:
        """The output's lines, sorted: children write concurrently, in no fixed order."""
        return sorted(line for line in self.text.splitlines() if line.strip())


@contextlib.contextmanager
def children_output() -> Iterator[Captured]:
    """Collect what processes started in the block write to file descriptors 1 and 2.

    Children started with the spawn start method inherit the notebook kernel's descriptors 1
    and 2; the kernel forwards those to whichever cell is running when it reads them, untagged.
    Pointing them at a file for the block keeps the children's lines together, to print."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    captured = Captured()
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            captured.raw = sink.read().decode("utf-8", "replace")


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


def start_method_rounds(methods: tuple[str, ...] = ("spawn", "forkserver", "fork"),
                        nprocs: int = 2, rounds: int = 3) -> dict[str, list[float]]:
    """Start-up seconds of each start method, one per round (the forkserver is warmed up
    first). Each round times every method once, so a slow moment of the machine hits one
    round of every method rather than all rounds of one."""
    if "forkserver" in methods:
        time_start("forkserver", 1)  # the server's own start-up happens once per kernel
    out: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(rounds):
        for method in methods:
            out[method].append(time_start(method, nprocs))
    return out


def measure_start_methods(methods: tuple[str, ...] = ("spawn", "forkserver", "fork"),
                          nprocs: int = 2, repeats: int = 2) -> dict[str, float]:
    """Median start-up seconds of each start method over `repeats` rounds."""
    rounds = start_method_rounds(methods, nprocs, repeats)
    return {method: statistics.median(times) for method, times in rounds.items()}


def slowest_in_every_round(rounds: dict[str, list[float]]) -> str | None:
    """The method that was the slowest in every round, or None if no method was."""
    per_round = zip(*rounds.values())  # one tuple of every method's seconds per round
    methods = list(rounds)
    slowest = {methods[times.index(max(times))] for times in per_round}
    return slowest.pop() if len(slowest) == 1 else None


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
            raise ValueError(f"rank {rank} found a corrupt batch (on purpose, for the lesson)")
        dist.barrier()  # never passes: the bad rank never arrives
        return "done"


def raises_after_barrier(rank: int, world_size: int, port: int) -> str:
    """raises_on for start_processes: meet at tcp://127.0.0.1:port (a forkserver child does
    not see variables set in the notebook after the server started), then rank 1 raises."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        if rank == 1:
            raise ValueError("rank 1 found a corrupt batch (on purpose, for the lesson)")
        dist.barrier()
        return "done"
    finally:
        dist.destroy_process_group()


def outlives_sigterm(rank: int, world_size: int, port: int) -> None:
    """Rank 1 raises before joining the group; rank 0 waits for it in the rendezvous, inside
    C++ code, with a SIGTERM handler installed (as scripts that checkpoint on preemption do)."""
    # Python runs this handler in the main thread between two Python instructions; a main
    # thread blocked in C++ never gets there, so SIGTERM is noted and nothing more happens.
    signal.signal(signal.SIGTERM, _save_checkpoint_on_sigterm)
    if rank == 1:
        raise ValueError("rank 1: bad config (on purpose, for the lesson)")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))


def _save_checkpoint_on_sigterm(signum, frame) -> None:
    """Where a training script would save a checkpoint before the scheduler kills it."""


def join_like_spawn(context, grace_seconds: float) -> None:
    """Join `context` as mp.spawn does (loop on join until it returns True or raises), with
    `grace_seconds` instead of join's default 30 s between SIGTERM and SIGKILL.

    join(grace_period=g) waits g s for the others to exit, sends SIGTERM, waits g s more, then
    SIGKILLs. torch versions whose join has no grace_period always wait the full 30 s."""
    if "grace_period" in inspect.signature(context.join).parameters:
        while not context.join(grace_period=grace_seconds):
            pass
    else:  # older torch: SIGTERM at once, then up to 30 s before SIGKILL
        while not context.join():
            pass


def knock_on(message: str) -> bool:
    """True for an error a rank raises because a peer failed first (the connection to it
    closed, or a wait for it timed out): the rule dh.launch itself uses to find the root cause."""
    return looks_like_peer_failure("", message)


def readable(error: BaseException) -> str:
    """An exception as "Type: message", its traceback text with machine paths shortened,
    library frames folded and C++ source locations dropped."""
    return f"{type(error).__name__}: {clean_traceback(str(error).strip())}"


def describe_failure(rank: int, error_line: str) -> str:
    """One failure in words: "rank 1: its own ValueError" or "rank 0: a knock-on RuntimeError
    (caused by a failed peer)"."""
    exc_type = error_line.split(":", 1)[0].strip()
    if knock_on(error_line):
        return f"rank {rank}: a knock-on {exc_type} (caused by a failed peer)"
    return f"rank {rank}: its own {exc_type}"


def reported_by_start_processes(port: int, start_method: str = "forkserver") -> str:
    """Run raises_after_barrier under torch's own process context (what mp.spawn uses) and
    describe the failure its join reported (see describe_failure)."""
    context = mp.start_processes(raises_after_barrier, args=(2, port), nprocs=2, join=False,
                                 start_method=start_method)
    try:
        join_like_spawn(context, grace_seconds=5)
    except mp.ProcessRaisedException as e:
        return describe_failure(e.error_index, e.msg.strip().splitlines()[-1])
    return "no error"


def reported_by_launch(fn, nprocs: int = 2) -> str:
    """Launch fn on nprocs ranks and describe the failure dh.launch reported."""
    try:
        launch(fn, args=(nprocs,), nprocs=nprocs, output="none")
    except RankRaised as e:
        return describe_failure(e.rank, f"{e.exc_type}: {e.exc_message}")
    return "no error"


def all_reduce_once(rank: int, world_size: int) -> float:
    """A whole program in miniature: join the group, sum rank + 1 over the ranks, leave."""
    with process_group(rank, world_size, verbose=False) as device:
        t = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(t)
        return t.item()


def finishes_then_other_fails(rank: int, world_size: int) -> dict:
    """Rank 0 returns its result; rank 1 fails a moment later (after rank 0 has returned)."""
    with process_group(rank, world_size, verbose=False):
        dist.barrier()  # both ranks got this far
    if rank == 0:
        return {"rank": 0, "evaluated_samples": 5000}
    time.sleep(1.0)  # rank 0 has returned meanwhile
    raise RuntimeError("rank 1 ran out of memory (on purpose, for the lesson)")


def hangs_on(rank: int, world_size: int, stuck_rank: int = 1, marker: str = "") -> str:
    """`stuck_rank` waits for a file nobody writes; the others wait at a barrier.

    The stuck rank is outside torch (in Python, polling), so no collective is out of step and
    nothing names the cause early: only the timeout stops it. (A rank stuck in a recv that
    nobody sends is another matter: the kit sees each rank's call and names it within a second.)
    """
    marker = marker or os.path.join(tempfile.gettempdir(), f"never-written-{os.getpid()}")
    with process_group(rank, world_size, verbose=False):
        if rank == stuck_rank:
            print("waiting for a file that rank 0 never writes...", flush=True)
            while not os.path.exists(marker):  # rank 0 was meant to write it, and forgot
                time.sleep(0.05)
        else:
            print("at the barrier", flush=True)
        dist.barrier()
        return "done"


def waits_in_recv(rank: int, world_size: int, stuck_rank: int = 1) -> str:
    """`stuck_rank` waits in recv for a message nobody sends; the others wait at a barrier.

    hangs_on's contrast: here the stuck rank is inside torch.distributed, so its call (a recv)
    can be compared with the others' (a barrier), and dh.launch names the mismatch."""
    with process_group(rank, world_size, verbose=False) as device:
        if rank == stuck_rank:
            sender = 0 if stuck_rank != 0 else 1
            print(f"waiting for a message from rank {sender}...", flush=True)
            dist.recv(torch.empty(1, device=device), src=sender)  # never sent: sender is at barrier
        else:
            print("at the barrier", flush=True)
        dist.barrier()
        return "done"


# ---------------------------------------------------------------- torchrun


# torchrun --standalone sets MASTER_ADDR to socket.getfqdn() (dynamic_rendezvous.py), a name
# that changes from machine to machine: shown as what it is, so the output reads the same.
TORCHRUN_VARYING = {**VARYING, "MASTER_ADDR": "(this host)"}


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
        shown = [TORCHRUN_VARYING.get(name, e[name]) if e[name] is not None else "(unset)"
                 for e in everyone]
        lines.append(f"{name:<28}" + "".join(f"{v:<14}" for v in shown))
    return "\n".join(lines)


# ---------------------------------------------------------------- exercises


def _env_report_decoyed(rank: int, fn, world_size: int) -> dict:
    """On a rank: the learner's env_report called with rank and world_size both -1, so that
    only os.environ can give the right values; and the local variables set as torchrun sets
    them for 2 ranks per node (rank 2 is local rank 0 of the second node), so that reading
    LOCAL_RANK or LOCAL_WORLD_SIZE for the global values FAILs (dh.launch sets them equal)."""
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.environ["LOCAL_WORLD_SIZE"] = str(min(2, world_size - rank // 2 * 2))
    return fn(-1, -1)


@exercise_check("env_report", "file")
def check_env_report(module) -> list[Case]:
    """Launch the learner's env_report on 2 and then 3 ranks, each with a known MASTER_PORT; on
    3 ranks its arguments are -1, as the values must come from os.environ."""
    env_report = require(module, "env_report")
    cases = []
    for nprocs, fn, args, how in ((2, env_report, (2,), ""),
                                  (3, _env_report_decoyed, (env_report, 3),
                                   " (called with rank=-1, world_size=-1, 2 ranks per "
                                   "node)")):
        port = free_port()
        reports = launch(fn, args=args, nprocs=nprocs, timeout=60, output="none",
                         master_port=port)
        for rank, got in enumerate(reports):
            expected = {"RANK": rank, "WORLD_SIZE": nprocs, "MASTER_PORT": port}
            cases.append(case(f"{nprocs} ranks, rank {rank}{how}", got, expected))
    return cases


ROOT_CAUSE_CASES = [
    ({0: "RuntimeError: Connection reset by peer", 1: "ValueError: corrupt batch"}, 1),
    ({0: "ValueError: bad config", 1: "RuntimeError: Connection closed by peer"}, 0),
    ({0: "DistBackendError: barrier timed out after 60 s",
      1: "RuntimeError: Connection reset by peer", 2: "KeyError: 'lr'"}, 2),
    ({1: "RuntimeError: Connection closed by peer", 0: "RuntimeError: Connection reset by peer"},
     None),
    # Unsorted keys with two causes (the lowest, not the first listed); knock-ons in other
    # letter cases; a rank that did not fail is absent.
    ({3: "KeyError: 'lr'", 1: "ValueError: corrupt batch", 0: "Connection Reset by peer"}, 1),
    ({0: "DistBackendError: Timed Out waiting 30000ms", 2: "RuntimeError: CONNECTION CLOSED",
      3: "AssertionError"}, 3),
]


@exercise_check("root_cause_rank", "file")
def check_root_cause_rank(module) -> list[Case]:
    """The learner's root_cause_rank on runs with knock-on errors in various places."""
    root_cause_rank = require(module, "root_cause_rank")
    return [case(f"errors {errors}", root_cause_rank(dict(errors)), expected)
            for errors, expected in ROOT_CAUSE_CASES]


if __name__ == "__main__":
    table = torchrun_report()
    if table:
        print(table, flush=True)
