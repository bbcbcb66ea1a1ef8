"""Lesson 01 (process groups): what the notebook checks in the parent, and its exercise checks.

The torch.distributed code of the lesson is typed in the notebook's `%%ranks` cells. This module
holds what those cells do not teach: the expected result of each collective, computed from the
ranks' starting tensors without any communication; the traffic of a ring all-reduce; and the
checks of the two exercises, which run on the persistent ranks (kind "ranks").
"""

from __future__ import annotations

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

class _Refused(RuntimeError):
    """A collective called where the exercise allows send/recv only."""


def _call(exercise: str, fn, *args):
    """Run the learner's function under a Ledger that refuses any collective before it runs
    (seen at torch's dispatch level, so `from torch.distributed import all_reduce as add`
    cannot bypass it; every rank runs the same code, so every rank refuses at the same call
    and none is left waiting). (result, error text or None, the send/recv calls made)."""
    from ..ledger import POINT_TO_POINT, Ledger

    def refuse(call) -> None:
        if call.op not in POINT_TO_POINT:
            raise _Refused(f"{exercise} must move data with dist.send/recv or dist.isend/irecv "
                           f"only; it called {call.text()}")

    with Ledger(on_call=refuse) as ledger:
        try:
            return fn(*args), None, ledger.calls
        except Exception as e:  # noqa: BLE001 - the same error on every rank: report, go on
            return None, f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}", \
                ledger.calls


def _all_reduce_inputs(rank: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [("10 random floats", torch.randn(10, generator=gen)),
            ("a 2x3 tensor of integers", torch.arange(6).reshape(2, 3) * (rank + 1)),
            ("one element", torch.tensor([float(rank + 1)]))]


@exercise_check("naive_all_reduce", "ranks")
def check_naive_all_reduce(namespace: dict) -> list[Case]:
    """naive_all_reduce(tensor) sums in place like dist.all_reduce, with send/recv only (the
    Ledger refuses any collective, whatever name it was imported under), through rank 0: the
    route the exercise asks for, not another one that gives the same sums."""
    fn = require(namespace, "naive_all_reduce")
    cases = []
    for label, data in _all_reduce_inputs(dist.get_rank()):
        expected = data.clone()
        dist.all_reduce(expected)
        got = data.clone()
        _, error, calls = _call("naive_all_reduce", fn, got)
        if error:
            return [*cases, Case(label, False, error)]
        cases.append(case(f"{label} (summed in place)", got, expected))
        cases.append(_through_rank_zero(label, calls))
    return cases


def _through_rank_zero(label: str, calls: list) -> Case:
    """Rank 0 receives once from every other rank and sends once to each; every other rank
    sends once to rank 0 and receives once from it (in any order, blocking or not)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    others = list(range(1, n))
    want = (sorted([("recv", r) for r in others] + [("send", r) for r in others]) if rank == 0
            else [("recv", 0), ("send", 0)])
    got = sorted((c.op, c.peer) for c in calls)
    called = ", ".join(c.text() for c in calls) or "no send/recv"
    return Case(f"{label}: through rank 0", got == want,
                f"called {called}; expected " + (
                    f"one recv from and one send to each of ranks {others}" if rank == 0
                    else "one send to rank 0 and one recv from rank 0"))


def _ring_case(label: str, calls: list, mine: torch.Tensor) -> Case:
    """The calls of one rank's ring_all_gather: every send to one neighbour, every receive
    from the other (either direction is a ring), and (n-1) chunks of this rank's size sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sends = {c.peer for c in calls if c.op == "send"}
    recvs = {c.peer for c in calls if c.op == "recv"}
    sent = sum(c.nbytes for c in calls if c.op == "send")
    chunk = mine.numel() * mine.element_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    ring = (sends, recvs) in (({right}, {left}), ({left}, {right}))
    ok = ring and sent == (n - 1) * chunk
    called = ", ".join(c.text() for c in calls) or "no send/recv"
    return Case(f"{label}: the ring", ok,
                f"called {called}; expected every send to one neighbour (rank {right} or "
                f"{left}) and every recv from the other, {n - 1} chunks of {chunk} bytes "
                f"({(n - 1) * chunk} bytes) sent in all, got {sent}")


@exercise_check("ring_all_gather", "ranks")
def check_ring_all_gather(namespace: dict) -> list[Case]:
    """ring_all_gather(tensor) returns every rank's tensor concatenated in rank order, moving
    them around a ring: send/recv to neighbours only, (n-1) chunks sent by each rank."""
    fn = require(namespace, "ring_all_gather")
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = []
    for label, mine in (("3 floats per rank", torch.arange(1.0, 4.0) + 10 * rank),
                        ("5 integers per rank", torch.arange(5) * (rank + 1)),
                        ("4 float64 per rank", torch.full((4,), rank + 0.5,
                                                          dtype=torch.float64))):
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine)
        got, error, calls = _call("ring_all_gather", fn, mine.clone())
        if error:
            return [*cases, Case(label, False, error)]
        cases.append(case(label, got, torch.cat(parts)))
        cases.append(_ring_case(label, calls, mine))
    return cases
