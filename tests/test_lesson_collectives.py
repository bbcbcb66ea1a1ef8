"""Lesson 01: init methods, point-to-point, every collective on 2 and 3 ranks, the ring."""

from __future__ import annotations

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers.lessons import collectives as c
from ddp_helpers.plots import collectives as plots
from ddp_helpers.solutions import naive_all_reduce, ring_all_gather


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_gives_the_documented_result(world_size):
    results = dh.launch(c.collective_tour, args=(world_size,), nprocs=world_size, output="none")
    tour = c.by_collective(results)
    assert set(tour) == set(c.DEMOS)
    for name in c.DEMOS:
        if name == "barrier":
            continue
        for rank, (got, want) in enumerate(zip(tour[name]["after"],
                                               c.expected_after(name, world_size), strict=True)):
            if want is None:
                assert got is None, f"{name}: rank {rank} should have no result"
            else:
                assert torch.equal(got, want), f"{name}: rank {rank} got {got}, want {want}"
    # Before: every rank started from its own rank_tensor (scatter: only rank 0 has data).
    assert torch.equal(tour["all_reduce SUM"]["before"][1], c.rank_tensor(1))
    assert tour["scatter"]["before"][1] is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_barrier_lets_nobody_leave_before_the_last_arrival(world_size):
    results = dh.launch(c.collective_tour, args=(world_size,), nprocs=world_size, output="none")
    barrier = c.by_collective(results)["barrier"]
    last_arrival = max(t.item() for t in barrier["before"])
    assert all(t.item() >= last_arrival for t in barrier["after"])
    # rank r slept 0.2 r seconds before arriving, so arrivals are in rank order
    arrivals = [t.item() for t in barrier["before"]]
    assert arrivals == sorted(arrivals)


@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_each_init_method_forms_a_working_group(method, tmp_path):
    args = (2, method, str(tmp_path / "rendezvous")) if method == "file" else (2, method)
    results = dh.launch(c.init_with, args=args, nprocs=2, output="none")
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)


def test_unknown_init_method_is_named_in_the_error():
    with pytest.raises(dh.RankRaised, match="unknown init method 'udp'"):
        dh.launch(c.init_with, args=(2, "udp"), nprocs=2, output="none", timeout=60)


def test_store_is_shared_by_every_rank():
    results = dh.launch(c.store_demo, args=(3,), nprocs=3, output="none")
    want = {r: f"hello from rank {r}" for r in range(3)}
    assert results == [want] * 3


def test_send_recv_moves_rank_0_tensor_to_rank_1():
    r0, r1 = dh.launch(c.send_recv, args=(2,), nprocs=2, output="none")
    assert torch.equal(r1["before"], torch.zeros(3))
    assert torch.equal(r1["after"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(r0["after"], r0["before"])


def test_irecv_buffer_is_stale_before_wait_and_filled_after():
    _, r1 = dh.launch(c.isend_irecv_peek, args=(2,), nprocs=2, output="none")
    assert torch.equal(r1["before_wait"], torch.zeros(3))
    assert torch.equal(r1["after_wait"], torch.tensor([7.0, 8.0, 9.0]))


def test_isend_irecv_ring_receives_from_left_neighbour():
    results = dh.launch(c.isend_overlap, args=(3, 1000), nprocs=3, output="none")
    assert [r["from"] for r in results] == [2, 0, 1]


def test_subgroups_reduce_only_their_members():
    results = dh.launch(c.subgroup_sums, args=(4,), nprocs=4, output="none")
    assert [r["group"] for r in results] == ["evens", "odds", "evens", "odds"]
    assert [r["group_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]  # 0+2 and 1+3
    assert [r["group_rank"] for r in results] == [0, 0, 1, 1]
    assert all(r["world_sum"] == 6.0 for r in results)


@pytest.mark.parametrize("world_size,numel", [(2, 4), (3, 6), (3, 7)])
def test_ring_all_reduce_equals_dist_all_reduce(world_size, numel):
    results = dh.launch(c.ring_demo, args=(world_size, numel), nprocs=world_size,
                        output="none")
    for r in results:
        assert torch.equal(r["ring"], r["all_reduce"])
        assert len(r["steps"]) == 1 + 2 * (world_size - 1)
    # the trace starts from each rank's own tensor and ends at the sum
    assert torch.equal(results[1]["steps"][0], c.rank_tensor(1, n=numel))
    assert torch.equal(results[1]["steps"][-1], results[1]["all_reduce"])


@pytest.mark.parametrize("impl", [c.ring_all_reduce, naive_all_reduce.naive_all_reduce])
def test_all_reduce_checker_accepts_correct_implementations(impl):
    results = dh.launch(c.check_all_reduce_impl, args=(3, impl, 10), nprocs=3, output="none")
    for r in results:
        assert torch.allclose(r["got"], r["expected"], rtol=1e-5, atol=1e-6)


def test_ring_all_gather_solution_matches_dist_all_gather():
    impl = ring_all_gather.ring_all_gather
    results = dh.launch(c.check_all_gather_impl, args=(3, impl), nprocs=3, output="none")
    for r in results:
        assert torch.equal(r["got"], r["expected"])


def test_timing_reports_every_size_and_implementation():
    timings = dh.launch(c.time_ring_vs_builtin, args=(2, [100, 1000], 2), nprocs=2,
                        output="none")[0]
    assert set(timings) == {100, 1000}
    for per_impl in timings.values():
        assert set(per_impl) == {"ring (send/recv)", "dist.all_reduce"}
        assert all(v > 0 for v in per_impl.values())


def test_traffic_formula():
    assert c.traffic_per_rank(2, 100) == {"ring, every rank": 100.0, "naive, rank 0": 100}
    assert c.traffic_per_rank(8, 800)["ring, every rank"] == 1400.0
    assert c.traffic_per_rank(8, 800)["naive, rank 0"] == 5600


def test_expected_after_rejects_unknown_names():
    with pytest.raises(ValueError, match="no expected result for 'all_to_all'"):
        c.expected_after("all_to_all", 2)


def test_init_with_file_needs_a_path():
    with pytest.raises(ValueError, match="needs file_path"):
        c.init_with(0, 1, "file")


def test_before_after_figure_labels_every_rank():
    before = [c.rank_tensor(r) for r in range(3)]
    fig = plots.before_after("all_reduce SUM", before, c.expected_after("all_reduce SUM", 3))
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert "33" in [t.get_text() for t in right.texts]
    assert right.get_title() == "after"
