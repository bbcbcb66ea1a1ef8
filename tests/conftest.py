"""Shared fixtures: count the processes a test leaves behind."""

import time

import psutil
import pytest


def rank_processes() -> list[psutil.Process]:
    """Descendants of this test process, minus multiprocessing's own servers (the ranks are
    children of the forkserver, so its descendants count)."""
    procs = []
    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
            below = child.children(recursive=True)
        except psutil.Error:
            continue
        server = "forkserver" in cmd or "resource_tracker" in cmd
        procs.extend(below if server else [child, *below])
    return procs


def wait_no_rank_processes(seconds: float = 5.0) -> list[psutil.Process]:
    """Rank processes still alive after up to `seconds` (zombies count as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in rank_processes() if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def no_leftovers():
    """Fail the test if any rank (or rank's child) outlives it."""
    yield
    alive = wait_no_rank_processes()
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"
