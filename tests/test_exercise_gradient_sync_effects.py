"""Lesson 06's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. average_parameters runs on 3 ranks and on 2 (dividing by a written-in 2 or 3
is not the mean at the other size) whose parameters differ, with the collectives it called
named on a FAIL, then in a short training;
allreduce_calls' answer is the ledger's count of a real run."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import gradient_sync_effects as lesson

# ---------------------------------------------------------------- average_parameters

LOOP = ("    with torch.no_grad():  # an in-place change autograd must not record\n"
        "        for p in model.parameters():\n"
        "            dist.all_reduce(p)  # every rank gets the same sum, bit for bit\n"
        "            p /= world_size")
ONCE = "parameters of 15, 3, 3 and 1 numbers, different on every rank: rank 0's parameters " \
       "after one average: at index"


def _loop(new: str) -> str:
    return edit("average_parameters", LOOP, new)


AVERAGE_WRONG = {  # label: (answer, text its FAIL must name)
    "the sum, never divided": (
        _loop(LOOP.replace("\n            p /= world_size", "")),
        f"{ONCE} 0: got 0.372482, expected 0.124161; it called all_reduce #1 float32[3, 5], "
        "all_reduce #2 float32[3], all_reduce #3 float32[1, 3], all_reduce #4 float32[1]"),
    "divided by 2, the lesson's world size": (
        _loop(LOOP.replace("p /= world_size", "p /= 2")), f"{ONCE} 0:"),
    "divided by 3, the check's first world size": (
        _loop(LOOP.replace("p /= world_size", "p /= 3")),
        "2 ranks, parameters of 15, 3, 3 and 1 numbers, different on every rank: rank 0's "
        "parameters after one average: at index 0:"),
    "every entry of state_dict() averaged, buffers too": (
        _loop("    with torch.no_grad():\n        for t in model.state_dict().values():\n"
              "            dist.all_reduce(t)\n            t /= world_size\n"),
        "3 ranks, rank 0: Linear + BatchNorm1d (buffers beside the parameters): your function "
        "raised RuntimeError"),
    "the first parameter only": (
        _loop(LOOP.replace("in model.parameters()", "in list(model.parameters())[:1]")),
        f"{ONCE} 15:"),
    "the gradients averaged, not the parameters": (
        _loop(LOOP.replace("all_reduce(p)", "all_reduce(p.grad)").replace("p /=", "p.grad /=")),
        f"{ONCE} 0:"),
    "rank 0's parameters broadcast": (
        _loop(LOOP.replace("dist.all_reduce(p)", "dist.broadcast(p, src=0)")
              .replace("\n            p /= world_size", "")),
        "it called broadcast #1 float32[3, 5], broadcast #2 float32[3]"),
    "without torch.no_grad()": (
        _loop("    for p in model.parameters():\n        dist.all_reduce(p)\n"
              "        p /= world_size\n"),
        "rank 0's parameters after one average: your function raised RuntimeError: a leaf "
        "Variable that requires grad"),
    "new Parameters, which the optimizer never sees": (
        _loop("    for module in model.modules():\n"
              "        for name, p in list(module.named_parameters(recurse=False)):\n"
              "            mean = p.detach().clone()\n            dist.all_reduce(mean)\n"
              "            setattr(module, name, torch.nn.Parameter(mean / world_size))\n"),
        "6 steps with DDP's sync off, averaging every 3: rank 0's parameters after every step, "
        "against the kit's average_parameters: at index (3,"),
}

AVERAGE_RIGHT = {
    "the float entries of state_dict() averaged (BatchNorm's statistics too)": _loop(
        "    with torch.no_grad():\n        for t in model.state_dict().values():\n"
        "            if t.is_floating_point():\n                dist.all_reduce(t)\n"
        "                t /= world_size\n"),
    "ReduceOp.AVG (gloo has it too, on 2.9 and 2.14)": _loop(
        LOOP.replace("all_reduce(p)", "all_reduce(p, op=dist.ReduceOp.AVG)")
        .replace("\n            p /= world_size", "")),
    "one flat all_reduce, divided first": _loop(
        "    from torch.nn.utils import parameters_to_vector, vector_to_parameters\n"
        "    flat = parameters_to_vector(model.parameters()).detach() / world_size\n"
        "    dist.all_reduce(flat)\n    vector_to_parameters(flat, model.parameters())\n"),
    "all_gather imported by name, the mean copied into .data": _loop(
        "    from torch.distributed import all_gather, get_world_size\n"
        "    for p in model.parameters():\n"
        "        everyone = [torch.empty_like(p.data) for _ in range(get_world_size())]\n"
        "        all_gather(everyone, p.data)\n"
        "        p.data.copy_(torch.stack(everyone).mean(0))\n"),
}


def test_wrong_averages_fail_naming_the_case(tmp_path):
    lines = verdicts("average_parameters", {k: src for k, (src, _) in AVERAGE_WRONG.items()},
                     tmp_path)
    assert_all_fail("average_parameters", lines,
                    {k: named for k, (_, named) in AVERAGE_WRONG.items()})


def test_averages_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("average_parameters"),
               **AVERAGE_RIGHT}
    assert_all_pass("average_parameters", verdicts("average_parameters", answers, tmp_path))


# ---------------------------------------------------------------- scaled_lr

RULE = "base_lr * effective_batch / base_batch"

LR_WRONG = {  # label: (answer, text its FAIL must name)
    "times the world size only": (
        edit("scaled_lr", RULE, "base_lr * world_size"),
        "scaled_lr(0.1, 256, 32, 2): got 0.2, expected 0.025"),
    "the batch per rank, not the effective batch": (
        edit("scaled_lr", RULE, "base_lr * batch_per_rank / base_batch"),
        "scaled_lr(0.05, 64, 64, 4): got 0.05, expected 0.2"),
    "upside down": (edit("scaled_lr", RULE, "base_lr * base_batch / effective_batch"),
                    "scaled_lr(0.05, 64, 64, 4): got 0.0125, expected 0.2"),
    "the square-root rule": (edit("scaled_lr", RULE, "base_lr * (effective_batch / base_batch) "
                                                     "** 0.5"),
                             "scaled_lr(0.05, 64, 64, 4): got 0.1, expected 0.2"),
    "integer division of the batches": (
        edit("scaled_lr", RULE, "base_lr * (effective_batch // base_batch)"),
        "scaled_lr(0.1, 256, 32, 2): got 0, expected 0.025"),
    "not divided by the base batch": (edit("scaled_lr", RULE, "base_lr * effective_batch"),
                                      "scaled_lr(0.05, 64, 64, 1): got 3.2"),
    "divided by the world size": (edit("scaled_lr", RULE, "base_lr / world_size"),
                                  "scaled_lr(0.05, 64, 64, 4): got 0.0125"),
}

LR_RIGHT = {
    "the ratio first, in another order": edit(
        "scaled_lr", RULE, "(batch_per_rank * world_size / base_batch) * base_lr"),
    "base_lr / base_batch, times the batches": (
        "def scaled_lr(base_lr, base_batch, batch_per_rank, world_size):\n"
        "    per_sample = base_lr / base_batch\n"
        "    return per_sample * batch_per_rank * world_size\n"),
}


def test_wrong_scaling_rules_fail_naming_the_setting(tmp_path):
    lines = verdicts("scaled_lr", {k: src for k, (src, _) in LR_WRONG.items()}, tmp_path)
    assert_all_fail("scaled_lr", lines, {k: named for k, (_, named) in LR_WRONG.items()})


def test_scaling_rules_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("scaled_lr"), **LR_RIGHT}
    assert_all_pass("scaled_lr", verdicts("scaled_lr", answers, tmp_path))


# ---------------------------------------------------------------- allreduce_calls

SEED = "seed model: Linear(784, 10): got "

CALLS_WRONG = {  # label: (prediction, text its FAIL must name)
    "one call per average (flattened)": ((20, 20), SEED + "20, expected 40"),
    "one call per layer": ((20, 40), SEED + "20, expected 40"),
    "DDP's 100 gradient all-reduces counted too": ((140, 180), SEED + "140, expected 40"),
    "19 averages": ((38, 76), SEED + "38, expected 40"),
    "21 averages, step 0 too": ((42, 84), SEED + "42, expected 40"),
    "the MLP counted as three tensors": ((40, 60), "MLP 784-64-10: got 60"),
    "per average, not in all": ((2, 4), SEED + "2, expected 40"),
    "one number, not a pair": (120, "the answer is a pair (seed model, MLP)"),
}


def test_wrong_call_counts_fail_naming_the_model(tmp_path):
    lines = verdicts("allreduce_calls", {k: v for k, (v, _) in CALLS_WRONG.items()}, tmp_path)
    assert_all_fail("allreduce_calls", lines, {k: named for k, (_, named) in CALLS_WRONG.items()})
    exercises._CHECKED.discard("allreduce_calls")


def test_call_counts_spelt_differently_pass(tmp_path):
    answers = {"a tuple": (40, 80), "a list": [40, 80], "floats": (40.0, 80.0),
               "the arithmetic": (20 * 2, 20 * 4)}
    assert_all_pass("allreduce_calls", verdicts("allreduce_calls", answers, tmp_path))
    exercises._CHECKED.discard("allreduce_calls")


def test_the_predicted_counts_are_what_the_ledger_counts_in_a_real_run():
    # 100 steps with DDP's sync off (no_sync: DDP calls nothing), average_parameters every 5.
    counts = dh.launch(lesson.averaging_calls, args=(2, [None, 64]), nprocs=2, timeout=120,
                       output="none")
    expected = [{"all_reduce": n} for n in lesson.ALLREDUCE_CALLS]
    assert counts == [expected, expected]
