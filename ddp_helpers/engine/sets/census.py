"""Which rank processes are alive: the census behind "nothing is left behind".

Ranks are children of multiprocessing's forkserver (or, with spawn, of the caller), and their
DataLoader workers are their children. Tests, the fault campaign and `Ranks.status` count them
here, in one place.
"""

from __future__ import annotations

import time

import psutil


def rank_descendants() -> list[psutil.Process]:
    """Live descendants of this process, minus multiprocessing's own servers (ranks are the
    forkserver's children, so its descendants count)."""
    found = []
    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
            below = child.children(recursive=True)
        except psutil.Error:
            continue
        server = "forkserver" in cmd or "resource_tracker" in cmd
        found.extend(below if server else [child, *below])
    return [p for p in found if is_alive(p)]


def wait_for_no_descendants(seconds: float = 5.0, ignore: set[int] | frozenset = frozenset()
                            ) -> list[psutil.Process]:
    """Rank processes (other than the pids in `ignore`) still alive after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in rank_descendants() if p.pid not in ignore]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def is_alive(p: psutil.Process) -> bool:
    """True for a running process; False for a zombie or one that is gone."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pid_alive(pid: int | None) -> bool:
    """True if `pid` names a live, non-zombie process."""
    if pid is None:
        return False
    try:
        return is_alive(psutil.Process(pid))
    except psutil.Error:
        return False
