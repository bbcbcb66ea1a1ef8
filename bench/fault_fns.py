"""Per-rank functions that fail on purpose, one way each (the fault campaign launches them).

Each takes (rank, world_size, mark) where `mark` is a file the failing rank stamps with the
time just before its fault, so the campaign can measure seconds from fault to error.
"""

import ctypes
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ddp_helpers as dh


def _stamp(mark: str) -> None:
    Path(mark).write_text(repr(time.time()))


def raise_before_init(rank, world_size, mark):
    if rank == 1:
        _stamp(mark)
        raise ValueError("bad config found before init_process_group")
    with dh.process_group(rank, world_size, verbose=False):
        dist.barrier()


def raise_after_init(rank, world_size, mark):
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            _stamp(mark)
            raise RuntimeError("loss is NaN")
        dist.barrier()


def raise_inside_collective(rank, world_size, mark):
    with dh.process_group(rank, world_size, verbose=False):
        t = torch.ones(4)
        if rank == 1:
            _stamp(mark)
            dist.all_reduce(t, op="not an op")  # raises inside the collective call
        dist.all_reduce(t)


def exit_three(rank, world_size, mark):
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            _stamp(mark)
            os._exit(3)
        dist.barrier()


def all_reduce_forever(rank, world_size, mark):
    """Rank 1 writes its pid into `mark`, then both all-reduce until someone kills rank 1."""
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            Path(mark + ".pid").write_text(str(os.getpid()))
        t = torch.ones(1 << 16)
        while True:
            dist.all_reduce(t)


def segfault(rank, world_size, mark):
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            _stamp(mark)
            ctypes.string_at(0)  # reads address 0: SIGSEGV in C, as a buggy extension would
        dist.barrier()


def skip_a_collective(rank, world_size, mark):
    with dh.process_group(rank, world_size, verbose=False, timeout_s=5):
        if rank == 0:
            _stamp(mark)
            dist.all_reduce(torch.ones(1))  # rank 1 never joins this one
        dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=5))


def never_init(rank, world_size, mark):
    if rank == 1:
        _stamp(mark)
        return "rank 1 forgot init_process_group"
    with dh.process_group(rank, world_size, verbose=False, timeout_s=5):
        dist.barrier()


class _Stuck(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        time.sleep(3600)  # a worker stuck on slow storage
        return i


def stuck_in_dataloader(rank, world_size, mark):
    """Both ranks wait on DataLoader workers (grandchildren) that never deliver a batch."""
    Path(f"{mark}.workers{rank}").write_text("")
    loader = DataLoader(_Stuck(), batch_size=2, num_workers=2)
    if rank == 0:
        _stamp(mark)
    for _ in loader:
        pass


def sleep_forever(rank, world_size, mark):
    if rank == 0:
        _stamp(mark)
    time.sleep(3600)


def ok(rank, world_size, mark=None):
    with dh.process_group(rank, world_size, verbose=False):
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return t.item()


def kill_from_outside(mark: str, seconds: float = 30) -> None:
    """Wait for rank 1's pid file, stamp the time, SIGKILL it (run in a thread of the parent)."""
    pid_file = Path(mark + ".pid")
    deadline = time.monotonic() + seconds
    while not pid_file.exists() or not pid_file.read_text():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(0.3)  # let the all-reduce loop get going
    _stamp(mark)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
