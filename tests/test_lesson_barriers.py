"""Lesson 04: barriers, the rank-0-first race, monitored_barrier, mismatches and timeouts."""

import pytest

import ddp_helpers as dh
from ddp_helpers.lessons import barriers as b
from ddp_helpers.solutions.prepare_once import prepare_once

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def run(fn, *args, nprocs=2, **kw):
    kw.setdefault("timeout", 120)
    return dh.launch(fn, args=(nprocs, *args), nprocs=nprocs, output="none", **kw)


def test_nobody_leaves_the_barrier_before_the_last_arrives(no_leftovers):
    rows = b.timeline(run(b.skewed_arrivals, [0.0, 0.5, 0.2], nprocs=3))
    last_arrival = max(r["arrive"] for r in rows)
    assert max(rows, key=lambda r: r["arrive"])["rank"] == 1  # the most work arrives last
    assert all(r["leave"] >= last_arrival for r in rows)


def test_reader_sees_an_unfinished_file_without_barrier(tmp_path, no_leftovers):
    # A slow writer (6 x 0.3 s) and a reader that looks right after start-up: the reader
    # cannot find the whole file unless something makes it wait.
    found = run(b.prepare_without_barrier, str(tmp_path / "data.txt"), 0.3)
    assert found[0] == "complete"
    assert found[1] == "missing" or found[1].startswith("half-written")


@pytest.mark.parametrize("fn, extra", [(b.prepare_with_barrier, ()),
                                       (b.prepare_with, (prepare_once,))])
def test_barrier_removes_the_race(fn, extra, tmp_path, no_leftovers):
    path = str(tmp_path / "data.txt")
    args = (path, *extra, 0.3) if extra else (path, 0.3)
    assert run(fn, *args, nprocs=3) == ["complete"] * 3


def test_monitored_barrier_names_the_missing_ranks(no_leftovers):
    two = run(b.monitored_barrier_demo, [1], 1.0)
    assert "Ranks 1 failed to pass monitoredBarrier" in two[0]
    assert two[1].startswith("busy")
    three = run(b.monitored_barrier_demo, [1, 2], 1.0, nprocs=3)
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in three[0]


def test_detail_mode_names_mismatched_collectives(no_leftovers):
    recs = run(b.mismatched_collectives, 5.0, env=DETAIL)
    for rec in recs:
        assert "Detected mismatch between collectives" in rec["error"]
        assert "ALLREDUCE" in rec["error"] and "BROADCAST" in rec["error"]


def test_without_detail_a_mismatch_only_times_out(no_leftovers):
    recs = run(b.mismatched_collectives, 1.0)
    for rec in recs:
        assert "Timed out" in rec["error"] and "mismatch" not in rec["error"]


def test_process_group_timeout_ends_a_waiting_collective(no_leftovers):
    r0, r1 = run(b.collective_timeout, 1.0)
    assert "Timed out" in r0["error"]
    assert r1["error"] is None


def test_launch_timeout_stops_a_hung_run_and_the_next_launch_works(no_leftovers):
    with pytest.raises(dh.LaunchTimeout, match=r"rank\(s\) 0, 1 of 2 had not finished") as info:
        run(b.hang_forever, timeout=3)
    assert info.value.last_lines == {0: "rank 0: waiting in dist.barrier()",
                                     1: "rank 1: stuck in work that never ends"}
    rows = b.timeline(run(b.skewed_arrivals, [0.0, 0.0]))
    assert [r["rank"] for r in rows] == [0, 1]
