"""Lesson 07 (second half): why it hangs. A desync on purpose, and the tools that find it.

`uneven_batches` is the classic DDP hang: the ranks' shards hold different numbers of batches,
so one rank leaves the loop while another still waits in the gradient all-reduce. The
parent-side helpers pull the deterministic facts (which rank, which collective) out of the
errors torch raises, so the notebook can print and compare them.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ..runtime import process_group

GRAD_NUMEL = 7850  # the seed model's gradient: what each step all-reduces
ENDINGS = ("monitored_barrier", "barrier", "loss")


def uneven_batches(rank: int, world_size: int, batches_per_rank: list[int],
                   end: str = "monitored_barrier", timeout_s: float = 60,
                   barrier_timeout_s: float = 2) -> float:
    """Run batches_per_rank[rank] all-reduce steps, then an end-of-epoch collective `end`."""
    if end not in ENDINGS:
        raise ValueError(f"rank {rank}: end must be one of {', '.join(ENDINGS)}, not {end!r}")
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported; the launcher's
    # warm start server imported it before this rank's environment was set, so read it again.
    dist.set_debug_level_from_env()
    # gloo even on GPUs: monitored_barrier exists only there, and the desync is the same.
    with process_group(rank, world_size, backend="gloo", verbose=False, timeout_s=timeout_s):
        loss = torch.zeros(1)
        for step in range(batches_per_rank[rank]):
            print(f"step {step}: all_reduce of the gradients", flush=True)
            grads = torch.ones(GRAD_NUMEL)
            dist.all_reduce(grads)
            loss += 1.0
        print(f"end of epoch: {end}", flush=True)
        if end == "monitored_barrier":
            # Like barrier, but rank 0 waits at most barrier_timeout_s for each other rank
            # and then names those that never arrived (gloo only).
            dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s),
                                   wait_all_ranks=True)
        elif end == "barrier":
            dist.barrier()
        else:
            dist.all_reduce(loss)  # a shape-[1] collective where a peer expects the gradients
        return loss.item()


def tiny_all_reduce(rank: int, world_size: int) -> list[float]:
    """One process group and one all_reduce: the least a C++ log can say something about."""
    with process_group(rank, world_size, verbose=False) as device:
        t = torch.ones(2, device=device)
        dist.all_reduce(t)
        return t.tolist()


# ---------------------------------------------------------------- parent side


def ranks_named_by_monitored_barrier(message: str) -> list[int]:
    """The ranks a monitored_barrier error says never arrived (empty if it names none)."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in re.findall(r"\d+", m.group(1))] if m else []


def collective_mismatch(message: str) -> list[tuple[int, str]]:
    """From a TORCH_DISTRIBUTED_DEBUG=DETAIL mismatch error: (rank, "OP shape") pairs, by rank."""
    found = []
    for rank, fingerprint in re.findall(r"Rank (\d+) is running collective: "
                                        r"CollectiveFingerPrint\((.*?)\)(?:, but|\.|$)",
                                        message):
        op = re.search(r"OpType=(\w+)", fingerprint)
        shape = re.search(r"TensorShape=(\[[^\]]*\])", fingerprint)
        found.append((int(rank), f"{op.group(1) if op else '?'} "
                                 f"{shape.group(1) if shape else '(no tensor)'}"))
    return sorted(found)


@contextlib.contextmanager
def startup_env(env: dict[str, str]) -> Iterator[None]:
    """Set variables in this process for the duration, so freshly spawned interpreters start
    with them (needed for settings torch reads once, at import); restore them afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_captured(launch, fn, args: tuple = (), **kwargs) -> tuple[list, list[str]]:
    """Call launch(fn, args, output="live", ...) and return (results, every relayed line)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        results = launch(fn, args=args, output="live", **kwargs)
    return results, buf.getvalue().splitlines()


def cpp_log_lines(lines: list[str]) -> dict[int, list[str]]:
    """Per rank, the lines torch's C++ logger wrote (they start with a level letter and date)."""
    per_rank: dict[int, list[str]] = {}
    for line in lines:
        m = re.match(r"\[rank (\d+)\] (?:\[rank\d+\]:)?\[([IWEF])\d{4} ", line)
        if m:
            per_rank.setdefault(int(m.group(1)), []).append(line)
    return per_rank


def cpp_log_sources(lines: list[str]) -> list[str]:
    """The C++ source files that logged, sorted: which parts of torch.distributed spoke."""
    return sorted({m.group(1) for m in (re.search(r" (\w+\.cpp):\d+\]", s) for s in lines)
                   if m})
