"""Shared fixtures: no test leaves a rank process behind, checked for every test."""

import signal

import pytest

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.engine import rank_descendants, wait_for_no_descendants

# Tests of the two-GPU paths (NCCL, one GPU per rank, cuda:0 -> cuda:1 copies) skip elsewhere.
needs_two_gpus = pytest.mark.skipif(dh.gpu_count() < 2, reason="needs two CUDA GPUs")


# A shell without job control starts background jobs with SIGINT ignored, and Python keeps it
# ignored: the tests that press the notebook's stop button (SIGINT -> KeyboardInterrupt, as in
# ipykernel) would then wait for their timeout instead. Give the test process Python's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def rank_processes():
    """Live rank processes (and their children) of this test process."""
    return rank_descendants()


def wait_no_rank_processes(seconds: float = 5.0):
    """Rank processes still alive after up to `seconds`."""
    return wait_for_no_descendants(seconds)


def _describe(procs) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline())[:120])
        except Exception:  # noqa: BLE001 - gone meanwhile
            out.append(str(p.pid))
    return out


@pytest.fixture(autouse=True)
def _no_process_left_by_the_test(request):
    """Every test: the processes it started (ranks, their workers, torchrun, servers) are gone
    when it ends. Those of module-scoped fixtures start before this snapshot. The browser test
    is checked per module: Chromium keeps a renderer per tab until the browser closes."""
    if request.node.get_closest_marker("browser"):
        yield
        return
    before = {p.pid for p in rank_descendants()}
    yield
    left = wait_for_no_descendants(ignore=before)
    assert not left, f"processes left behind: {_describe(left)}"


@pytest.fixture(autouse=True, scope="module")
def _no_process_left_by_the_module():
    """Every test file: nothing is left once its module-scoped fixtures are torn down."""
    yield
    left = wait_for_no_descendants()
    assert not left, f"processes left behind by this test file: {_describe(left)}"


@pytest.fixture
def no_leftovers():
    """Fail the test if any rank (or rank's child) outlives it, whoever started it."""
    yield
    alive = wait_for_no_descendants()
    assert not alive, f"processes left behind: {_describe(alive)}"


def solution_edit(name: str, old: str, new: str) -> str:
    """The kit's solution of exercise `name` with one edit: a wrong answer a learner could write."""
    source = exercises.solution_source(name)
    assert old in source, f"{old!r} is not in the solution of {name}"
    return source.replace(old, new)
