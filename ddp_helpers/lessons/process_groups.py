"""Lesson 01 (process groups): what the notebook checks in the parent, and its exercise checks.

The torch.distributed code of the lesson is typed in the notebook's `%%ranks` cells. This module
holds what those cells do not teach: the expected result of each collective, computed from the
ranks' starting tensors without any communication; the traffic of a ring all-reduce; and the
checks of the two exercises, which run on the persistent ranks (kind "ranks").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..checks import Case, case
from ..exercises import exercise_check, require

COLLECTIVES = ("broadcast", "all_reduce SUM", "all_reduce AVG", "all_reduce MAX", "reduce",
               "all_gather", "gather", "scatter", "reduce_scatter")

# ---------------------------------------------------------------- what each collective leaves


def expected_after(name: str, before: list) -> list:
    """What each rank should hold after collective `name`, from what each held before
    (`before[r]`, rank r's tensor; for scatter only rank 0's is used). None: no result there."""
    n = len(before)
    if name in ("scatter",):
        return list(before[0].chunk(n))
    total = sum(before)
    rest = [None] * (n - 1)
    results = {
        "broadcast": lambda: [before[0]] * n,
        "all_reduce SUM": lambda: [total] * n,
        "all_reduce AVG": lambda: [total / n] * n,
        "all_reduce MAX": lambda: [torch.stack(before).max(0).values] * n,
        "reduce": lambda: [total, *rest],
        "all_gather": lambda: [torch.cat(before)] * n,
        "gather": lambda: [torch.cat(before), *rest],
        "reduce_scatter": lambda: list(total.chunk(n)),
    }
    if name not in results:
        raise ValueError(f"no expected result for {name!r}; known: {', '.join(COLLECTIVES)}")
    return results[name]()


def check_collective(name: str, before: list, after: list) -> bool:
    """Print PASS if every rank holds what the docs say `name` leaves there (bit for bit), else
    FAIL with the first rank and value that differ; return whether it passed."""
    for rank, (got, want) in enumerate(zip(after, expected_after(name, before))):
        if want is None:
            continue  # e.g. reduce: the other ranks' buffers hold nothing defined
        result = case(f"rank {rank}", got, want, rtol=0, atol=0)
        if not result.ok:
            print(f"FAIL {name}: rank {rank}: {result.detail}")
            return False
    print(f"PASS {name}: every rank holds what the docs say (bit for bit)")
    return True


def barrier_check(arrived: list[float], left: list[float]) -> bool:
    """Print whether every rank left the barrier after the last one arrived (clock-free)."""
    ok = min(left) >= max(arrived)
    print(f"{'PASS' if ok else 'FAIL'} barrier: every rank left after the last one arrived "
          f"(the last to arrive was rank {arrived.index(max(arrived))})")
    return ok


# ---------------------------------------------------------------- the ring's traffic


def traffic_per_rank(world_size: int, numel: int) -> dict[str, float]:
    """Elements sent for one all-reduce of `numel` elements: by every rank in a ring,
    2(N-1)/N * numel, and by rank 0 alone when everyone sends to it, (N-1) * numel."""
    return {"ring, every rank": 2 * (world_size - 1) * numel / world_size,
            "through rank 0, rank 0": (world_size - 1) * numel}


def traffic_table(sizes: tuple[int, ...] = (2, 4, 8, 16), numel: int = 1_000_000) -> None:
    """Print the elements each all-reduce sends per rank, ring against through rank 0."""
    print(f"{'ranks':>5} {'ring, every rank':>18} {'through rank 0, rank 0':>24}")
    for n in sizes:
        t = traffic_per_rank(n, numel)
        print(f"{n:>5} {t['ring, every rank']:>18,.0f} {t['through rank 0, rank 0']:>24,}")


def traffic_check(sent: list[int], numel: int) -> bool:
    """Print whether each rank sent exactly 2(N-1)/N of the `numel` elements in the ring."""
    want = traffic_per_rank(len(sent), numel)["ring, every rank"]
    ok = all(s == want for s in sent)
    print(f"{'PASS' if ok else 'FAIL'} traffic: each rank sent {sent} elements; "
          f"2(N-1)/N x {numel} = {want:g} with N = {len(sent)}")
    return ok


# ---------------------------------------------------------------- exercises (run on the ranks)

_COLLECTIVE_CALLS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                     "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_to_all", "all_to_all_single", "all_gather_object",
                     "broadcast_object_list")


@contextmanager
def point_to_point_only(exercise: str) -> Iterator[None]:
    """While the learner's function runs, the collectives of torch.distributed raise: the
    exercise is to build one from send/recv. Every rank runs the same code, so every rank
    raises at the same call and none is left waiting."""

    def refuse(name: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"{exercise} must move data with dist.send/recv or "
                               f"dist.isend/irecv only; it called dist.{name}")
        return refused

    saved = {name: getattr(dist, name) for name in _COLLECTIVE_CALLS if hasattr(dist, name)}
    try:
        for name in saved:
            setattr(dist, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _call(exercise: str, fn, *args):
    """Run the learner's function with collectives refused; (result, error text or None)."""
    try:
        with point_to_point_only(exercise):
            return fn(*args), None
    except Exception as e:  # noqa: BLE001 - the same error on every rank: report, go on
        return None, f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _all_reduce_inputs(rank: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [("10 random floats", torch.randn(10, generator=gen)),
            ("a 2x3 tensor of integers", torch.arange(6).reshape(2, 3) * (rank + 1)),
            ("one element", torch.tensor([float(rank + 1)]))]


@exercise_check("naive_all_reduce", "ranks")
def check_naive_all_reduce(namespace: dict) -> list[Case]:
    """naive_all_reduce(tensor) sums in place like dist.all_reduce, with send/recv only."""
    fn = require(namespace, "naive_all_reduce")
    cases = []
    for label, data in _all_reduce_inputs(dist.get_rank()):
        expected = data.clone()
        dist.all_reduce(expected)
        got = data.clone()
        _, error = _call("naive_all_reduce", fn, got)
        if error:
            return [*cases, Case(label, False, error)]
        cases.append(case(f"{label} (summed in place)", got, expected))
    return cases


@exercise_check("ring_all_gather", "ranks")
def check_ring_all_gather(namespace: dict) -> list[Case]:
    """ring_all_gather(tensor) returns every rank's tensor concatenated in rank order."""
    fn = require(namespace, "ring_all_gather")
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = []
    for label, mine in (("3 floats per rank", torch.arange(1.0, 4.0) + 10 * rank),
                        ("5 integers per rank", torch.arange(5) * (rank + 1))):
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine)
        got, error = _call("ring_all_gather", fn, mine.clone())
        if error:
            return [*cases, Case(label, False, error)]
        cases.append(case(label, got, torch.cat(parts)))
    return cases
