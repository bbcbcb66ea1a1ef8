"""The cost of the engine's ledger per collective, and the time to name each kind of
mismatched collective, beside what a plain timeout costs.

    python -m bench.mismatch

Cost: two persistent ranks run 2,000 all_reduces of a 4-float tensor, timed on the rank with
the engine's tapped Ledger on (as every cell has it) and with it switched off inside the cell;
the medians of 5 rounds and their ratio. Naming: each mismatch of tests/test_mismatch.py run
as a cell, wall time from sending the cell to the error (stopping the ranks included).
Both again on served ranks (`Ranks.listen`, one torchrun agent with two workers on this
machine), whose ledger lines travel over the connection; torchrun's --max-restarts gives a
fresh group after each mismatch, and its restart is not counted.
"""

from __future__ import annotations

import statistics
import time

import ddp_helpers as dh
from tests.test_mismatch import CELLS

COST_CELL = """
import time
from ddp_helpers import ledger as _ledger
t = torch.ones(4)
taps = list(_ledger._TAPPED)
if {off}:
    _ledger._TAPPED.clear()  # the engine's ledger switched off for this loop
dist.barrier()
start = time.perf_counter()
for _ in range(2000):
    dist.all_reduce(t)
per_call = (time.perf_counter() - start) / 2000
_ledger._TAPPED[:] = taps
per_call
"""


def cost(pool: dh.Ranks) -> tuple[float, float]:
    """Median seconds per all_reduce with the ledger on and off (rank 0's clock)."""
    on, off = [], []
    for _ in range(5):
        on.append(pool.run(COST_CELL.format(off=False))[0])
        off.append(pool.run(COST_CELL.format(off=True))[0])
    return statistics.median(on), statistics.median(off)


def time_to_name(pool: dh.Ranks) -> dict[str, float]:
    """Seconds from sending each mismatched cell to its CollectiveMismatch."""
    out = {}
    for kind, (code, _) in CELLS.items():
        pool.run("1")  # fresh ranks up before the clock starts
        start = time.monotonic()
        try:
            pool.run(code)
        except dh.CollectiveMismatch:
            out[kind] = time.monotonic() - start
    return out


def report(pool, what: str) -> None:
    on, off = cost(pool)
    print(f"all_reduce of float32[4], {what}, median of 5 x 2000 calls: "
          f"ledger on {on * 1e6:.1f} us, off {off * 1e6:.1f} us, ratio {on / off:.3f}")
    for kind, seconds in time_to_name(pool).items():
        print(f"  {kind:7s} named in {seconds:.2f} s (a plain %%ranks cell waits out its "
              f"timeout, {pool.timeout:g} s, or the 3 s stall rule where a rank finished)")


def main() -> None:
    from ddp_helpers.lessons import beyond_one_machine as lesson

    with dh.Ranks(2, timeout=60, output="none", backend="gloo") as pool:
        report(pool, "2 gloo ranks")
    served = dh.Ranks.listen(2, timeout=60, output="none")
    agents = lesson.served_agents(served, nnodes=1, nproc_per_node=2, max_restarts=len(CELLS))
    try:
        served.wait_ready(240, progress=False)
        report(served, "2 served gloo ranks (torchrun)")
    finally:
        served.stop()
        lesson.agents_ended(agents, timeout=60)


if __name__ == "__main__":
    main()
