"""Persistent ranks, side by side in one run: starting two ranks, a trivial cell's round trip,
and a dist.all_reduce cell against the all-reduce's own time on the ranks; ipyparallel's engines
and its %%px round trip beside them when ipyparallel is installed (`pip install ipyparallel`);
and served ranks (two torchrun agents as two "nodes", attached through dh.Ranks.listen): the
time from listen to ready, a trivial cell's round trip over the socket, and, under
`torchrun --max-restarts`, the time from a killed worker's report to the next cell's answer
from the group torchrun restarted.

    python -m bench.ranks [--starts 10] [--cells 200] [--served-starts 3] [--served-restarts 3]
"""

from __future__ import annotations

import argparse
import time

import ddp_helpers as dh
from bench.common import median, timed, write_table

# The all-reduce's own time, measured on the ranks inside the cell (the slower rank counts).
TIMED_CELL = "t0 = time.perf_counter(); dist.all_reduce(t); time.perf_counter() - t0"
# ...and back to back in one cell, where the ranks run in lockstep.
TIGHT_LOOP = """
times = []
for _ in range(200):
    t0 = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - t0)
sorted(times)[100]
"""


def ranks_rows(starts: int, cells: int) -> dict[str, list[float]]:
    """Seconds per operation on dh.Ranks (two gloo ranks on the CPU)."""
    cold = timed(lambda: dh.Ranks(2, output="none").stop(), 1)  # may start the start server
    rows = {"dh.Ranks(2): first start in this process": cold,
            "dh.Ranks(2): start, warm": timed(lambda: dh.Ranks(2, output="none").stop(), starts)}
    with dh.Ranks(2, output="none") as pool:
        rows["dh.Ranks: trivial cell round trip"] = timed(lambda: pool.run("1"), cells, warmup=20)
        pool.run("import time\nt = torch.ones(256)")
        inside: list[float] = []
        rows["dh.Ranks: dist.all_reduce(t) cell"] = timed(
            lambda: inside.append(max(pool.run(TIMED_CELL))), cells, warmup=20)
        rows["all_reduce's own time inside that cell"] = inside[20:]
        rows["all_reduce back to back on the ranks"] = [max(pool.run(TIGHT_LOOP))]
    return rows


def served_rows(starts: int, cells: int) -> dict[str, list[float]]:
    """Served ranks: two torchrun agents (c10d on loopback, one worker each) attach to
    dh.Ranks.listen; seconds from listen to every rank ready, and per trivial cell."""
    from ddp_helpers.lessons import beyond_one_machine as lesson

    ready, trivial = [], []
    for i in range(starts):
        t0 = time.perf_counter()
        pool = dh.Ranks.listen(2, timeout=60, output="none")
        agents = lesson.served_agents(pool, nnodes=2, nproc_per_node=1)
        try:
            pool.wait_ready(240, progress=False)
            ready.append(time.perf_counter() - t0)
            if i == 0:
                trivial = timed(lambda p=pool: p.run("1"), cells, warmup=20)
        finally:
            pool.stop()
            lesson.agents_ended(agents)
    return {"served: listen to ready, 2 torchrun nodes": ready,
            "served: trivial cell round trip (socket)": trivial}


KILL_RANK_1 = ("import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(60)")


def restart_rows(restarts: int) -> dict[str, list[float]]:
    """Two torchrun agents with --max-restarts: kill rank 1 in a cell, `restarts` times; seconds
    from the RankDied to the answer of the next cell, which runs on the restarted group."""
    from ddp_helpers.lessons import beyond_one_machine as lesson

    if restarts < 1:
        return {}
    pool = dh.Ranks.listen(2, timeout=60, output="none")
    agents = lesson.served_agents(pool, max_restarts=restarts)
    seconds = []
    try:
        pool.wait_ready(240, progress=False)
        for _ in range(restarts):
            try:
                pool.run(KILL_RANK_1, timeout=120)
                raise RuntimeError("rank 1 was not killed")
            except dh.RankDied:
                t0 = time.perf_counter()
            pool.run("t = torch.ones(1)\ndist.all_reduce(t)")
            seconds.append(time.perf_counter() - t0)
    finally:
        pool.stop()
        lesson.agents_ended(agents)
    return {"served: torchrun restart, death to next cell": seconds}


def ipyparallel_rows(cells: int) -> dict[str, list[float]]:
    """The same figures for ipyparallel's engines (%%px runs view.execute(cell, block=True))."""
    try:
        import ipyparallel as ipp
    except ImportError:
        print("ipyparallel is not installed: `pip install ipyparallel` to compare with it.")
        return {}
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(2, timeout=120)
    start = time.perf_counter() - t0
    try:
        view = client[:]
        trivial = timed(lambda: view.execute("a = 1", block=True), cells, warmup=20)
    finally:
        cluster.stop_cluster_sync()
    return {"ipyparallel: start 2 engines": [start],
            "ipyparallel: trivial %%px round trip": trivial}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print medians and comparisons; return the medians by row name."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--starts", type=int, default=10, help="timed warm starts")
    p.add_argument("--cells", type=int, default=200, help="timed cells per row")
    p.add_argument("--served-starts", type=int, default=3, help="timed torchrun attaches")
    p.add_argument("--served-restarts", type=int, default=3, help="timed torchrun restarts")
    a = p.parse_args(argv)
    rows = {**ranks_rows(a.starts, a.cells), **served_rows(a.served_starts, a.cells),
            **restart_rows(a.served_restarts), **ipyparallel_rows(a.cells)}
    medians = {k: median(v) for k, v in rows.items()}
    table = [[name, str(len(rows[name])), _ms(m)] for name, m in medians.items()]
    overhead = (medians["dh.Ranks: dist.all_reduce(t) cell"]
                - medians["all_reduce's own time inside that cell"])
    notes = [f"A dist.all_reduce cell costs {_ms(overhead)} more than the all-reduce inside it "
             "(target: at most 2 ms). The all-reduce itself is slower in a cell than back to "
             "back: the ranks start it a little apart and wake from idle."]
    socket_cell, pipe_cell = (medians["served: trivial cell round trip (socket)"],
                              medians["dh.Ranks: trivial cell round trip"])
    notes.append(f"Served ranks: a trivial cell over the socket takes "
                 f"{socket_cell / pipe_cell:.1f}x the pipe's; attaching two torchrun nodes takes "
                 f"{medians['served: listen to ready, 2 torchrun nodes']:.1f} s from listen to "
                 "ready (torchrun's rendezvous and a fresh Python + torch per worker).")
    if "served: torchrun restart, death to next cell" in medians:
        notes.append("Under torchrun --max-restarts, the cell after a killed worker's report "
                     "answered from the restarted group "
                     f"{medians['served: torchrun restart, death to next cell']:.1f} s later "
                     "(the agents stop and restart every worker: a fresh Python + torch each).")
    if "ipyparallel: trivial %%px round trip" in medians:
        px, ours = (medians["ipyparallel: trivial %%px round trip"],
                    medians["dh.Ranks: trivial cell round trip"])
        start = medians["ipyparallel: start 2 engines"] / medians["dh.Ranks(2): start, warm"]
        notes.append(f"Trivial cell: dh.Ranks is {px / ours:.1f}x faster than ipyparallel's "
                     f"%%px (served ranks: {px / socket_cell:.1f}x); a warm start of two ranks "
                     f"is {start:.0f}x faster than starting two ipyparallel engines.")
    notes.append("Targets: a warm start under 1 s, a trivial cell at most 5 ms median.")
    write_table("ranks", ["operation (two ranks, CPU, gloo)", "runs", "median"], table,
                notes=" ".join(notes))
    return medians


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


if __name__ == "__main__":
    main()
