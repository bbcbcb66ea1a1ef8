"""Lesson 04's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. prepare_once is checked on each rank's collectives (a sleep is no barrier,
whatever its length) with rank 0 made late, so that no verdict rests on timing luck."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh
from ddp_helpers import exercises

BODY = "    if rank == 0:\n        write(path)\n    dist.barrier()"


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(3, output="none", timeout=60) as p:
        yield p


def body(new: str) -> str:
    """The kit's prepare_once with its body replaced (imports kept)."""
    return edit("prepare_once", BODY, new)


PREPARE_WRONG = {  # label: (answer, text its FAIL must name)
    "a sleep instead of the barrier": (
        body("    import time\n    if rank == 0:\n        write(path)\n    else:\n"
             "        time.sleep(3)"),
        "rank 1: a slow writer: rank 1 waits for rank 0 in a collective: rank 1 called no "
        "collective"),
    "the barrier before write": (  # the file half-written, else rank 0's barrier named
        body("    dist.barrier()\n    if rank == 0:\n        write(path)"),
        "rank 1: a slow writer: "),
    "every rank writes": (
        body("    write(path)\n    dist.barrier()"),
        "a slow writer: calls of write on all ranks together: got 3, expected 1"),
    "the last rank writes": (
        body("    if rank == dist.get_world_size() - 1:\n        write(path)\n"
             "    dist.barrier()"),
        "a slow writer: write runs on rank 0: write ran [0, 0, 1] times"),
    "an async barrier never waited": (
        body("    if rank == 0:\n        write(path)\n    dist.barrier(async_op=True)"),
        "a slow writer: the file when prepare_once returned on rank 1: got 'missing'"),
    "the others wait only until the file exists": (
        body("    import os, time\n    if rank == 0:\n        write(path)\n    else:\n"
             "        while not os.path.exists(path):\n            time.sleep(0.01)"),
        "a slow writer: the file when prepare_once returned on rank 1: got 'half-written"),
}

PREPARE_RIGHT = {
    "rank_zero_first": body("    with dh.rank_zero_first() as first:\n        if first:\n"
                            "            write(path)"),
    "a broadcast from rank 0 after writing": body(
        "    done = [None]\n    if rank == 0:\n        write(path)\n        done = [True]\n"
        "    dist.broadcast_object_list(done, src=0)"),
    "an all_reduce of a flag, rank as get_rank()": body(
        "    import torch\n    if dist.get_rank() == 0:\n        write(path)\n"
        "    dist.all_reduce(torch.ones(1))"),
}


def test_wrong_prepare_once_fail_naming_the_case(pool, tmp_path):
    lines = verdicts("prepare_once", {k: src for k, (src, _) in PREPARE_WRONG.items()},
                     tmp_path, pool)
    assert_all_fail("prepare_once", lines,
                    {k: named for k, (_, named) in PREPARE_WRONG.items()})


def test_prepare_once_written_differently_passes(pool, tmp_path):
    pool.run("import ddp_helpers as dh")
    assert_all_pass("prepare_once", verdicts("prepare_once", PREPARE_RIGHT, tmp_path, pool))


MONITORED_WRONG = {"fail fast names every rank too": {True: [1, 2], False: [1, 2]},
                   "fail fast names the last rank": {True: [1, 2], False: [2]},
                   "waiting for all names rank 1 only": {True: [1], False: [1]},
                   "swapped": {True: [1], False: [1, 2]},
                   "rank 0 named too": {True: [0, 1, 2], False: [1]},
                   "a list, not a dict": [1, 2]}


def test_wrong_monitored_barrier_predictions_fail_naming_the_key(tmp_path):
    lines = verdicts("monitored_barrier_names", MONITORED_WRONG, tmp_path)
    named = dict.fromkeys(MONITORED_WRONG, "wait_all_ranks=")
    named["a list, not a dict"] = "the prediction: write a dict"
    assert_all_fail("monitored_barrier_names", lines, named)
    exercises._CHECKED.discard("monitored_barrier_names")


def test_monitored_barrier_prediction_in_another_order_passes(tmp_path):
    lines = verdicts("monitored_barrier_names", {"reversed lists": {False: [1], True: [2, 1]}},
                     tmp_path)
    assert_all_pass("monitored_barrier_names", lines)
    exercises._CHECKED.discard("monitored_barrier_names")
