"""Shared fixtures: count the processes a test leaves behind."""

import pytest

from ddp_helpers.census import rank_descendants, wait_for_no_descendants


def rank_processes():
    """Live rank processes (and their children) of this test process."""
    return rank_descendants()


def wait_no_rank_processes(seconds: float = 5.0):
    """Rank processes still alive after up to `seconds`."""
    return wait_for_no_descendants(seconds)


@pytest.fixture
def no_leftovers():
    """Fail the test if any rank (or rank's child) outlives it."""
    yield
    alive = wait_for_no_descendants()
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"
