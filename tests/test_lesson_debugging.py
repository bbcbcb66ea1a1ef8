"""Lesson 07, second half: a desync on purpose and the tools that find it."""

import os

import pytest

import ddp_helpers as dh
from ddp_helpers.lessons import debugging


def test_even_batches_finish_with_every_ending(no_leftovers):
    for end, expected in (("monitored_barrier", [2.0, 2.0]), ("barrier", [2.0, 2.0]),
                          ("loss", [4.0, 4.0])):
        got = dh.launch(debugging.uneven_batches, args=(2, [2, 2], end), nprocs=2,
                        output="none", timeout=60)
        assert got == expected, end


def test_unknown_ending_is_refused_on_the_rank(no_leftovers):
    with pytest.raises(dh.RankRaised, match="rank 0: end must be one of monitored_barrier"):
        dh.launch(debugging.uneven_batches, args=(2, [1, 1], "wait"), nprocs=2, output="none",
                  timeout=60)


def test_monitored_barrier_names_the_rank_stuck_in_the_all_reduce(no_leftovers):
    with pytest.raises(dh.RankRaised, match="failed to pass monitoredBarrier") as e:
        dh.launch(debugging.uneven_batches, args=(2, [2, 3], "monitored_barrier"), nprocs=2,
                  output="none", timeout=60)
    assert e.value.rank == 0
    assert debugging.ranks_named_by_monitored_barrier(e.value.exc_message) == [1]


def test_detail_names_both_collectives(no_leftovers):
    with pytest.raises(dh.RankRaised, match="Detected mismatch between collectives") as e:
        dh.launch(debugging.uneven_batches, args=(2, [2, 3], "loss"), nprocs=2, output="none",
                  timeout=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert debugging.collective_mismatch(e.value.exc_message) == [
        (0, "ALLREDUCE [1]"), (1, f"ALLREDUCE [{debugging.GRAD_NUMEL}]")]


def test_timeout_carries_each_ranks_last_line(no_leftovers):
    with pytest.raises(dh.LaunchTimeout, match=r"rank\(s\) 0, 1 of 2 had not finished") as e:
        dh.launch(debugging.uneven_batches, args=(2, [2, 3], "barrier"), nprocs=2,
                  output="none", timeout=5)
    assert e.value.last_lines == {0: "end of epoch: barrier",
                                  1: "step 2: all_reduce of the gradients"}


def test_cpp_log_level_reaches_spawned_ranks_only(no_leftovers):
    _, warm = debugging.launch_captured(dh.launch, debugging.tiny_all_reduce, (2,), nprocs=2,
                                        timeout=60, env={"TORCH_CPP_LOG_LEVEL": "INFO"})
    assert debugging.cpp_log_lines(warm) == {}  # read at import, in the start server: too late
    with debugging.startup_env({"TORCH_CPP_LOG_LEVEL": "INFO"}):
        results, spawned = debugging.launch_captured(dh.launch, debugging.tiny_all_reduce, (2,),
                                                     nprocs=2, timeout=120,
                                                     start_method="spawn")
    assert results == [[2.0, 2.0], [2.0, 2.0]]
    assert sorted(debugging.cpp_log_lines(spawned)) == [0, 1]
    assert debugging.cpp_log_sources(spawned)


def test_startup_env_restores_the_environment():
    os.environ.pop("KIT_TEST_UNSET", None)
    os.environ["KIT_TEST_SET"] = "before"
    try:
        with debugging.startup_env({"KIT_TEST_UNSET": "1", "KIT_TEST_SET": "during"}):
            assert os.environ["KIT_TEST_UNSET"] == "1"
            assert os.environ["KIT_TEST_SET"] == "during"
        assert "KIT_TEST_UNSET" not in os.environ
        assert os.environ["KIT_TEST_SET"] == "before"
    finally:
        os.environ.pop("KIT_TEST_SET", None)


@pytest.mark.parametrize("message, ranks", [
    ("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 2000 ms", [1]),
    ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 2000 ms", [1, 3]),
    ("Connection closed by peer", []),
])
def test_ranks_named_by_monitored_barrier(message, ranks):
    assert debugging.ranks_named_by_monitored_barrier(message) == ranks


def test_even_batches_solution_ends_together(no_leftovers):
    from ddp_helpers.solutions.even_batches import even_batches

    assert dh.launch(even_batches, args=(2, [2, 3]), nprocs=2, output="none",
                     timeout=60) == [4.0, 4.0]
