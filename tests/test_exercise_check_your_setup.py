"""Lesson 00's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. sum_of_squares is checked on the ranks' collectives, not only the number."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

from ddp_helpers import exercises

ALL_REDUCE = "dist.all_reduce(t)  # SUM is the default op"

SUM_WRONG = {  # label: (answer, text its FAIL must name)
    "closed form, no collective": (
        edit("sum_of_squares", ALL_REDUCE,
             "t.fill_(world_size * (world_size + 1) * (2 * world_size + 1) / 6)"),
        "2 ranks: rank 0 calls all_reduce: rank 0 called no collective"),
    "reduce to rank 0 only": (
        edit("sum_of_squares", ALL_REDUCE, "dist.reduce(t, dst=0)"),
        "2 ranks: rank 0 calls all_reduce: rank 0 called reduce"),
    "rank ** 2, off by one": (
        edit("sum_of_squares", "(rank + 1) ** 2", "rank ** 2"), "2 ranks: rank 0's total"),
    "MAX instead of SUM": (
        edit("sum_of_squares", ALL_REDUCE, "dist.all_reduce(t, op=dist.ReduceOp.MAX)"),
        "2 ranks: rank 0's total: got 4"),
    "the value read before the all-reduce": (
        edit("sum_of_squares", f"{ALL_REDUCE}\n        return t.item()",
             f"mine = t.item()\n        {ALL_REDUCE}\n        return mine"),
        "2 ranks: rank 0's total: got 1"),
    "sum of (rank + 1), squared after": (
        edit("sum_of_squares", f"(rank + 1) ** 2)], device=device)\n        {ALL_REDUCE}\n"
             "        return t.item()",
             f"rank + 1)], device=device)\n        {ALL_REDUCE}\n        return t.item() ** 2"),
        "2 ranks: rank 0's total: got 9"),
    "a dummy all_reduce beside the closed form": (
        edit("sum_of_squares", f"{ALL_REDUCE}\n        return t.item()",
             "dist.all_reduce(torch.zeros(1, device=device))\n"
             "        return world_size * (world_size + 1) * (2 * world_size + 1) / 6"),
        "2 ranks: rank 0 all-reduces (rank + 1) ** 2: rank 0's all_reduce was handed [[0.0]]"),
    "three ranks hard-coded": (
        edit("sum_of_squares", ALL_REDUCE, "t.fill_(14.0)\n        dist.all_reduce(t.mul_(0))"
             "\n        t += 14.0"), "2 ranks: rank 0's total: got 14"),
}

SUM_RIGHT = {
    "imported under another name, op spelled out": edit(
        "sum_of_squares", ALL_REDUCE,
        "from torch.distributed import ReduceOp, all_reduce as reduce_all\n"
        "        reduce_all(t, op=ReduceOp.SUM)"),
    "an int64 tensor, async and waited": edit(
        "sum_of_squares", f"t = torch.tensor([float((rank + 1) ** 2)], device=device)\n"
        f"        {ALL_REDUCE}\n        return t.item()",
        "t = torch.tensor([(rank + 1) ** 2], dtype=torch.int64, device=device)\n"
        "        dist.all_reduce(t, async_op=True).wait()\n        return float(t.item())"),
    "a 0-d float64 tensor": edit(
        "sum_of_squares", f"t = torch.tensor([float((rank + 1) ** 2)], device=device)\n"
        f"        {ALL_REDUCE}\n        return t.item()",
        "t = torch.tensor((rank + 1.0) ** 2, dtype=torch.float64, device=device)\n"
        "        dist.all_reduce(t)\n        return float(t)"),
}


def test_wrong_sums_of_squares_fail_naming_the_case(tmp_path):
    lines = verdicts("sum_of_squares", {k: src for k, (src, _) in SUM_WRONG.items()}, tmp_path)
    assert_all_fail("sum_of_squares", lines, {k: named for k, (_, named) in SUM_WRONG.items()})


def test_sums_of_squares_written_differently_pass(tmp_path):
    assert_all_pass("sum_of_squares", verdicts("sum_of_squares", SUM_RIGHT, tmp_path))


THREE_WRONG = {"two ranks' sum": 3.0, "one rank's own value": 1.0, "the count of ranks": 3,
               "sum of squares": 14.0, "the mean": 2.0}


def test_wrong_three_rank_predictions_fail_naming_the_rank(tmp_path):
    lines = verdicts("three_rank_sum", THREE_WRONG, tmp_path)
    assert_all_fail("three_rank_sum", lines, dict.fromkeys(THREE_WRONG, "rank 0: got"))
    exercises._CHECKED.discard("three_rank_sum")


def test_three_rank_prediction_written_as_an_int_passes(tmp_path):
    assert_all_pass("three_rank_sum", verdicts("three_rank_sum", {"int": 6}, tmp_path))
    exercises._CHECKED.discard("three_rank_sum")
