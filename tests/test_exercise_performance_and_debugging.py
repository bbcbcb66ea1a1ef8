"""Lesson 07's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. even_batches runs on 2 and 3 ranks, each told only its own batch count, and
its gradient all-reduces are counted on the Ledger; bus_bandwidth is checked on 2, 3, 4 and 8
ranks with float32, bfloat16 and float64 byte counts."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

from ddp_helpers import exercises

EVEN_2 = "2 ranks with [2, 3] batches, each told its own: "
MIN = "dist.all_reduce(steps, op=dist.ReduceOp.MIN)"
LOOP = "for _ in range(int(steps.item())):"
SUM_LOSS = "        dist.all_reduce(loss)  # the end-of-epoch collective every rank now reaches\n"

EVEN_WRONG = {  # label: (answer, text its FAIL must name)
    "no agreement: each rank its own count": (
        edit("even_batches", f"        {MIN}\n", ""),
        EVEN_2 + "Collectives do not match"),
    "agreed, but the loop runs its own count": (
        edit("even_batches", LOOP, "for _ in range(batches_per_rank[rank]):"),
        EVEN_2 + "Collectives do not match"),
    "MAX instead of MIN": (
        edit("even_batches", "ReduceOp.MIN", "ReduceOp.MAX"),
        EVEN_2 + "gradient all-reduces on ranks 0..1: at index 0: got 3,"
        " expected 2"),
    "SUM instead of MIN": (
        edit("even_batches", "op=dist.ReduceOp.MIN", "op=dist.ReduceOp.SUM"),
        EVEN_2 + "gradient all-reduces on ranks 0..1: at index 0: got 5"),
    "min of the list, no collective": (
        edit("even_batches", f"        {MIN}\n", "").replace(
            "torch.tensor([batches_per_rank[rank]], device=device)",
            "torch.tensor([min(batches_per_rank)], device=device)"),
        EVEN_2 + "rank "),  # 0 or 1, whichever raised first: see the test
    "the loss not summed over ranks": (
        edit("even_batches", SUM_LOSS, ""),
        EVEN_2 + "the loss each rank returned: at index 0: got 2, "
        "expected 4"),
    "the loss averaged, not summed": (
        edit("even_batches", SUM_LOSS, SUM_LOSS + "        loss /= world_size\n"),
        "the loss each rank returned: at index 0: got 2, expected 4"),
    "min(counts) x world_size, the loss never all-reduced": (
        edit("even_batches", SUM_LOSS, "        loss *= world_size  # every rank's is equal\n"),
        EVEN_2 + "rank 0 ends with the loss's all-reduce: rank 0's last collective was "
        "all_reduce of 7850 number(s)"),
    "one step too many": (
        edit("even_batches", LOOP, "for _ in range(int(steps.item()) + 1):"),
        "gradient all-reduces on ranks 0..1: at index 0: got 3, expected 2"),
}

BODY = ("        steps = torch.tensor([batches_per_rank[rank]], device=device)\n"
        f"        {MIN}\n")
EVEN_RIGHT = {
    "the counts gathered, min taken on each rank": edit(
        "even_batches", BODY,
        "        counts = [None] * world_size\n"
        "        dist.all_gather_object(counts, batches_per_rank[rank])\n"
        "        steps = torch.tensor([min(counts)])\n"),
    "a flag all-reduced every step (Join's idea)": edit(
        "even_batches", BODY + "        loss = torch.zeros(1, device=device)\n"
        f"        {LOOP}\n", "        loss = torch.zeros(1, device=device)\n"
        "        done = 0\n        while True:\n"
        "            more = torch.tensor([int(done < batches_per_rank[rank])], device=device)\n"
        "            dist.all_reduce(more, op=dist.ReduceOp.MIN)\n"
        "            if not more.item():\n                break\n            done += 1\n"),
    "the loss returned as a one-element tensor, not a float": edit(
        "even_batches", "        return loss.item()", "        return loss"),
    "an async MIN, waited on, over a float": edit(
        "even_batches", BODY,
        "        steps = torch.tensor([float(batches_per_rank[rank])], device=device)\n"
        "        dist.all_reduce(steps, op=dist.ReduceOp.MIN, async_op=True).wait()\n"),
}


def test_wrong_even_batches_fail_naming_the_case(tmp_path):
    lines = verdicts("even_batches", {k: src for k, (src, _) in EVEN_WRONG.items()}, tmp_path)
    assert_all_fail("even_batches", lines, {k: named for k, (_, named) in EVEN_WRONG.items()})
    assert " raised TypeError: '<' not supported" in lines["min of the list, no collective"]


def test_even_batches_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("even_batches"), **EVEN_RIGHT}
    assert_all_pass("even_batches", verdicts("even_batches", answers, tmp_path))


ALGBW = "algbw = nbytes / seconds / 1e9"
FACTOR = "return algbw * 2 * (world_size - 1) / world_size"
ON_2 = "float32[1,048,576] (4,194,304 bytes) all-reduced in 2 ms on 2 ranks: got "
ON_3 = "bfloat16[25,165,824] (50,331,648 bytes) all-reduced in 37.5 ms on 3 ranks: got "
BUS_WRONG = {  # label: (answer, text its FAIL must name)
    "algbw, no factor": (edit("bus_bandwidth", FACTOR, "return algbw"),
                         ON_3 + "1.34218 GB/s, expected 1.78957 = algbw 1.34218 GB/s x 2(N-1)/N"
                         " = 1.333 (yours is 0.75 times that)"),
    "N for N-1": (edit("bus_bandwidth", "(world_size - 1)", "world_size"),
                  ON_2 + "4.1943 GB/s, expected 2.09715 = algbw 2.09715 GB/s x 2(N-1)/N = 1 "
                  "(yours is 2 times that)"),
    "the factor inverted": (edit("bus_bandwidth", FACTOR,
                                 "return algbw * world_size / (2 * (world_size - 1))"),
                            ON_3 + "1.00663 GB/s, expected 1.78957"),
    "bits, not bytes": (edit("bus_bandwidth", ALGBW, "algbw = nbytes * 8 / seconds / 1e9"),
                        ON_2 + "16.7772 GB/s, expected 2.09715"),
    "seconds taken as milliseconds": (edit("bus_bandwidth", ALGBW,
                                           "algbw = nbytes / (seconds / 1e3) / 1e9"),
                                      ON_2 + "2097.15 GB/s"),
    "GiB, not GB": (edit("bus_bandwidth", ALGBW, "algbw = nbytes / seconds / 2**30"),
                    ON_2 + "1.95312 GB/s, expected 2.09715"),
    "all-gather's (N-1)/N": (edit("bus_bandwidth", FACTOR,
                                  "return algbw * (world_size - 1) / world_size"),
                             ON_2 + "1.04858 GB/s"),
    "nbytes taken for a float32 count": (edit("bus_bandwidth", ALGBW,
                                              "algbw = nbytes * 4 / seconds / 1e9"),
                                         ON_2 + "8.38861 GB/s"),
    "integer division in the factor": (
        edit("bus_bandwidth", FACTOR, "return algbw * (2 * (world_size - 1) // world_size)"),
        ON_3 + "1.34218 GB/s, expected 1.78957"),
}

BUS_RIGHT = {
    "one expression, bytes per second first": (
        "def bus_bandwidth(nbytes, seconds, world_size):\n"
        "    n = world_size\n    return nbytes * 2 * (n - 1) / (n * seconds) / 1e9\n"),
    "the lesson's bus_factor, GB as 1_000_000_000": (
        "from ddp_helpers.lessons.performance_and_debugging import bus_factor\n\n\n"
        "def bus_bandwidth(nbytes, seconds, world_size):\n"
        "    return nbytes / 1_000_000_000 / seconds * bus_factor(world_size)\n"),
}


def test_wrong_bus_bandwidths_fail_naming_the_case(tmp_path):
    lines = verdicts("bus_bandwidth", {k: src for k, (src, _) in BUS_WRONG.items()}, tmp_path)
    assert_all_fail("bus_bandwidth", lines, {k: named for k, (_, named) in BUS_WRONG.items()})


def test_bus_bandwidths_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("bus_bandwidth"), **BUS_RIGHT}
    assert_all_pass("bus_bandwidth", verdicts("bus_bandwidth", answers, tmp_path))
