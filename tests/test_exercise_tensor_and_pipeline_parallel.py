"""Lesson 11's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS, on 2 ranks and 3. row_parallel is checked on the Ledger (one all_reduce of
the output, whatever it was imported as; an all_gather or a gather to rank 0 is named), on 48
hidden features and on 7, which neither world size divides, and it must train: backward gives
the unsplit layer's gradients, with no collective and not through a bare all_reduce
(.detach(), torch.no_grad(), a functional all_reduce and a bias only rank 0 uses FAIL).
one_f_one_b runs a step in the learner's order with 5 micro-batches and compares each rank's
sends and receives, in order with their peers, with 1F1B's: GPipe's order gives the same
gradients and FAILs there."""

from fractions import Fraction

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import tensor_and_pipeline_parallel as lesson


@pytest.fixture(scope="module")
def two():
    with dh.Ranks(2, output="none", timeout=90) as p:
        yield p


@pytest.fixture(scope="module")
def three():
    with dh.Ranks(3, output="none", timeout=90) as p:
        yield p


# ---------------------------------------------------------------- row_parallel

SUM = "    y = SumOverRanks.apply(h_shard @ weight_shard.T)\n"


def rows(new: str) -> str:
    """The kit's row_parallel_forward with its product and sum replaced."""
    return edit("row_parallel", SUM, new)


def row_wrong(n: int) -> dict[str, tuple[str, str]]:
    """label: (answer, text its FAIL must name) on n ranks."""
    first = f"batch 8, 48 hidden features over {n} ranks"
    return {
        "the bias added on every rank before the sum": (
            rows("    y = SumOverRanks.apply(h_shard @ weight_shard.T + bias)\n    bias = 0\n"),
            f"rank 0: {first}: the output: at index"),
        "no all-reduce": (rows("    y = h_shard @ weight_shard.T\n"),
                          f"rank 0: {first}: the output: at index"),
        "averaged instead of summed": (
            rows(SUM + "    y = y / dist.get_world_size()\n"),
            f"rank 0: {first}: the output: at index"),
        "only rank 0 adds the bias": (
            edit("row_parallel", "    return y + bias",
                 "    return y + bias if dist.get_rank() == 0 else y"),
            f"rank 1: {first}: the output: at index"),
        "the partial sums all-gathered and added (right values)": (
            rows("    y = h_shard @ weight_shard.T\n"
                 "    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]\n"
                 "    dist.all_gather(parts, y)\n    y = torch.stack(parts).sum(0)\n"),
            f"rank 0: {first}: the collectives: got all_gather #1 float32[8, 16], expected "
            "one all_reduce of the output's 512 B"),
        "the whole input and weight all-gathered (right values)": (
            rows("    n = dist.get_world_size()\n"
                 "    hs = [torch.empty_like(h_shard) for _ in range(n)]\n"
                 "    ws = [torch.empty_like(weight_shard) for _ in range(n)]\n"
                 "    dist.all_gather(hs, h_shard)\n    dist.all_gather(ws, weight_shard)\n"
                 "    y = torch.cat(hs, 1) @ torch.cat(ws, 1).T\n"),
            f"rank 0: {first}: the collectives: got all_gather #1 float32[8, {48 // n}], "
            f"all_gather #2 float32[16, {48 // n}]"),
        "gathered to rank 0, summed there, broadcast back (right values)": (
            rows("    y = h_shard @ weight_shard.T\n    rank = dist.get_rank()\n"
                 "    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]\n"
                 "    dist.gather(y, parts if rank == 0 else None, dst=0)\n"
                 "    if rank == 0:\n        y = torch.stack(parts).sum(0)\n"
                 "    dist.broadcast(y, src=0)\n"),
            f"rank 0: {first}: the collectives: got gather #1 float32[8, 16]"),
        "the bias's share all-reduced too (right values, two all-reduces)": (
            edit("row_parallel", "    return y + bias",
                 "    b = bias / dist.get_world_size()\n    dist.all_reduce(b)\n"
                 "    return y + b"),
            f"rank 0: {first}: the collectives: got all_reduce #1 float32[8, 16], all_reduce "
            "#2 float32[16]"),
        # right values, but the layer cannot train (issue 38: answers that build a layer train)
        ".detach() before the product (right values)": (
            rows("    y = h_shard.detach() @ weight_shard.detach().T\n    dist.all_reduce(y)\n"),
            f"rank 0: {first}: the gradient of h_shard: got None: no gradient reaches it"),
        "under torch.no_grad() (right values)": (
            rows("    with torch.no_grad():\n"
                 "        y = SumOverRanks.apply(h_shard @ weight_shard.T)\n"),
            f"rank 0: {first}: the gradient of h_shard: got None: no gradient reaches it"),
        "a bare dist.all_reduce (right values and gradients here; autograd cannot see it)": (
            rows("    y = h_shard @ weight_shard.T\n    dist.all_reduce(y)\n"),
            f"rank 0: {first}: a sum autograd knows how to differentiate: your allreduce_ ran "
            "on a tensor that requires a gradient"),
        "a functional all_reduce (right values; its backward sums dL/dy again)": (
            rows("    import torch.distributed._functional_collectives as funcol\n"
                 "    y = funcol.all_reduce(h_shard @ weight_shard.T, 'sum', dist.group.WORLD)\n"),
            # without a formula (2.9.1) the dispatch mode sees it under grad mode; with one
            # (2.14.1) it all-reduces dL/dy in backward (backward's collectives FAIL)
            f"rank 0: {first}: " + (
                "backward's collectives: got all_reduce"
                if lesson.functional_all_reduce_has_backward() else
                "a sum autograd knows how to differentiate: your all_reduce is the functional "
                "collective: this torch has no autograd formula for it")),
        "g with an all-reduce in backward too (right values)": (
            edit("row_parallel", "    def backward(ctx, grad):\n        return grad",
                 "    def backward(ctx, grad):\n        grad = grad.clone()\n"
                 "        dist.all_reduce(grad)\n        return grad"),
            f"rank 0: {first}: backward's collectives: got all_reduce #1 float32[8, 16], "
            "expected none"),
        "the bias added on rank 0 before the sum (right values; rank 1's bias learns nothing)": (
            "import torch.nn.functional as F\n\n"
            + exercises.solution_source("row_parallel").split("\n\ndef row_parallel_forward")[0]
            + "\n\ndef row_parallel_forward(h_shard, weight_shard, bias):\n"
            "    b = bias if dist.get_rank() == 0 else None\n"
            "    return SumOverRanks.apply(F.linear(h_shard, weight_shard, b))\n",
            f"rank 1: {first}: the gradient of bias: got None"),
        "a share of the bias on every rank (right values; each copy learns 1/N)": (
            rows("    y = SumOverRanks.apply(h_shard @ weight_shard.T + bias / "
                 "dist.get_world_size())\n    bias = 0\n"),
            f"rank 0: {first}: the gradient of bias: at index"),
    }


FUNCTION = (
    "class Sum(torch.autograd.Function):\n"
    "    @staticmethod\n    def forward(ctx, partial, bias):\n"
    "        partial = partial.clone()\n"
    "        dist.all_reduce(partial, op=dist.ReduceOp.SUM, async_op=True).wait()\n"
    "        return partial + bias\n"
    "    @staticmethod\n    def backward(ctx, grad):\n"
    "        return grad, grad.sum(0)\n\n")
ROW_RIGHT = {
    "an alias of all_reduce inside a Function, the bias added inside it": (
        FUNCTION.replace("dist.all_reduce(partial, op=dist.ReduceOp.SUM, async_op=True).wait()",
                         "sum_all(partial)")
        .replace("class Sum", "from torch.distributed import all_reduce as sum_all\n\n"
                              "class Sum")
        + "def row_parallel_forward(h_shard, weight_shard, bias):\n"
        "    return Sum.apply(h_shard @ weight_shard.t(), bias)\n"),
    "async_op waited inside a Function, einsum": (
        FUNCTION + "def row_parallel_forward(h_shard, weight_shard, bias):\n"
        "    return Sum.apply(torch.einsum('bk,ok->bo', h_shard, weight_shard), bias)\n"),
    "a Function that copies the gradient, F.linear": (
        "import torch.nn.functional as F\n\n"
        "class G(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n"
        "        out = x.detach().clone()\n        dist.all_reduce(out)\n        return out\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return grad.clone()\n\n"
        "def row_parallel_forward(h_shard, weight_shard, bias):\n"
        "    return G.apply(F.linear(h_shard, weight_shard)) + bias\n"),
}


@pytest.mark.parametrize("n", [2, 3])
def test_wrong_row_parallel_fail_naming_the_case(n, two, three, tmp_path):
    wrong = row_wrong(n)
    lines = verdicts("row_parallel", {k: src for k, (src, _) in wrong.items()}, tmp_path,
                     {2: two, 3: three}[n])
    assert_all_fail("row_parallel", lines, {k: named for k, (_, named) in wrong.items()})


@pytest.mark.parametrize("n", [2, 3])
def test_row_parallel_written_differently_passes(n, two, three, tmp_path):
    pool, other = {2: (two, three), 3: (three, two)}[n]
    answers = dict(ROW_RIGHT, kit=exercises.solution_source("row_parallel"))
    lines = verdicts("row_parallel", answers, tmp_path, pool, other)
    assert_all_pass("row_parallel", lines)
    cases = 14 * (2 + 3)  # two inputs; per input the output, the forward's and backward's
    # collectives, the autograd warning and three gradients, on every rank of both sizes
    assert lines["kit"] == (f"PASS row_parallel: {cases} of {cases} cases at world sizes "
                            f"{n} and {5 - n}")


def test_row_parallel_template_is_not_attempted(two, tmp_path):
    line = verdicts("row_parallel", {"template": "def row_parallel_forward(h_shard, "
                                     "weight_shard, bias):\n    ...\n"}, tmp_path, two)
    assert line["template"].startswith("NOT ATTEMPTED row_parallel")


# ---------------------------------------------------------------- one_f_one_b

RUN2 = "a step on 2 ranks, 5 micro-batches of 4, 3, 3, 3, 3"
ORDER_WRONG = {  # label: (answer, text its FAIL must name), on 2 ranks
    "GPipe's order (the same gradients)": (
        edit("one_f_one_b", '    order = [("F", i) for i in range(warmup)]\n',
             '    return [("F", i) for i in range(num_microbatches)] + '
             '[("B", i) for i in range(num_microbatches)]\n'),
        f"rank 0: {RUN2}: stage 0's sends and receives, in order: call 3: got send #3 "
        "float32[3, 64] to rank 1, expected recv from rank 1 (backward of micro-batch 0)"),
    "one forward too many in warm-up (p - s)": (
        edit("one_f_one_b", "min(num_stages - 1 - stage,", "min(num_stages - stage,"),
        f"rank 0: {RUN2}: stage 0's sends and receives, in order: call 3: got send"),
    "every stage warms up with p - 1": (
        edit("one_f_one_b", "min(num_stages - 1 - stage,", "min(num_stages - 1,"),
        f"rank 1: {RUN2}: stage 1's sends and receives, in order: call 2: got recv #2 "
        "float32[3, 64] from rank 0, expected send to rank 0 (backward of micro-batch 0)"),
    "warm-up counted from the wrong end (s): a deadlock, never run": (
        edit("one_f_one_b", "min(num_stages - 1 - stage,", "min(stage,"),
        f"rank 0: {RUN2}: your orders: not run: ValueError: the orders deadlock"),
    "a backward before its forward": (
        edit("one_f_one_b", 'order += [("F", warmup + i), ("B", i)]',
             'order += [("B", i), ("F", warmup + i)]'),
        "your orders: not run: ValueError: stage 1: ('B', 0) comes before ('F', 0)"),
    "warm-up not capped at m": (
        edit("one_f_one_b", "warmup = min(num_stages - 1 - stage, num_microbatches)",
             "warmup = num_stages - 1 - stage"),
        "rank 1: stage 0 of 4, 2 micro-batches: at position 2: got ('F', 2), expected "
        "('B', 0)"),
    "the last backwards newest first": (
        edit("one_f_one_b",
             'order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]',
             'order += [("B", i) for i in reversed(range(num_microbatches - warmup, '
             'num_microbatches))]'),
        "rank 1: stage 0 of 3, 5 micro-batches: at position 8: got ('B', 4), expected "
        "('B', 3)"),
    "the rank, not the stage asked for": (
        edit("one_f_one_b", "    warmup = min(", "    stage = dist.get_rank()\n    warmup = min("),
        f"rank 0: {RUN2}: your orders: not run: the ranks' functions gave different orders"),
}
ORDER_RIGHT = {
    "greedy: a forward while this stage may hold one more": (
        "def one_f_one_b(stage, num_stages, num_microbatches):\n"
        "    order, f, b = [], 0, 0\n    while b < num_microbatches:\n"
        "        if f < num_microbatches and f - b < num_stages - stage:\n"
        "            order.append(('F', f))\n            f += 1\n        else:\n"
        "            order.append(('B', b))\n            b += 1\n    return order\n"),
    "a generator of lists": (
        "def one_f_one_b(stage, num_stages, num_microbatches):\n"
        "    w = max(0, min(num_stages - stage - 1, num_microbatches))\n"
        "    for i in range(w):\n        yield ['F', i]\n"
        "    for i in range(num_microbatches - w):\n        yield ['F', i + w]\n"
        "        yield ['B', i]\n"
        "    for i in range(num_microbatches - w, num_microbatches):\n        yield ['B', i]\n"),
    "three phases, a tuple": (
        "def one_f_one_b(stage, num_stages, num_microbatches):\n"
        "    w = min(num_stages - stage - 1, num_microbatches)\n"
        "    steady = [op for i in range(num_microbatches - w) "
        "for op in (('F', i + w), ('B', i))]\n"
        "    return tuple([('F', i) for i in range(w)] + steady + "
        "[('B', i) for i in range(num_microbatches - w, num_microbatches)])\n"),
}


def test_wrong_one_f_one_b_fail_naming_the_case(two, tmp_path):
    two.run("import torch.distributed as dist")
    lines = verdicts("one_f_one_b", {k: src for k, (src, _) in ORDER_WRONG.items()}, tmp_path,
                     two)
    assert_all_fail("one_f_one_b", lines, {k: named for k, (_, named) in ORDER_WRONG.items()})


def test_wrong_one_f_one_b_fail_on_three_ranks_on_the_ledger(three, tmp_path):
    run3 = "a step on 3 ranks, 5 micro-batches of 4, 3, 3, 3, 3"
    picked = {  # on 3 stages the tail's order shows in stage 0's run too, as held micro-batches
        "GPipe's order (the same gradients)":
            f"rank 0: {run3}: stage 0's sends and receives, in order: call 4: got send #4 "
            "float32[3, 64] to rank 1, expected recv from rank 1 (backward of micro-batch 0)",
        "one forward too many in warm-up (p - s)":
            f"rank 0: {run3}: stage 0's sends and receives, in order: call 4: got send",
        "every stage warms up with p - 1":
            f"rank 1: {run3}: stage 1's sends and receives, in order: call 5: got recv",
        "the rank, not the stage asked for": "the ranks' functions gave different orders",
    }
    lines = verdicts("one_f_one_b", {k: ORDER_WRONG[k][0] for k in picked}, tmp_path, three)
    assert_all_fail("one_f_one_b", lines, picked)


@pytest.mark.parametrize("n", [2, 3])
def test_one_f_one_b_written_differently_passes(n, two, three, tmp_path):
    answers = dict(ORDER_RIGHT, kit=exercises.solution_source("one_f_one_b"))
    assert_all_pass("one_f_one_b", verdicts("one_f_one_b", answers, tmp_path,
                                            {2: two, 3: three}[n]))


def test_one_f_one_b_template_is_not_attempted_and_nonsense_fails(two, tmp_path):
    lines = verdicts("one_f_one_b", {
        "template": "def one_f_one_b(stage, num_stages, num_microbatches):\n    ...\n",
        "None": "def one_f_one_b(*args):\n    return None\n"}, tmp_path, two)
    assert lines["template"].startswith("NOT ATTEMPTED one_f_one_b")
    assert lines["None"].startswith(f"FAIL one_f_one_b: rank 0: {RUN2}: your orders: not run: "
                                    "ValueError: stage 0: the order is NoneType"), lines["None"]


# ---------------------------------------------------------------- bubble_fraction


def _ones_bubble(p, m):
    return 0 if p == 1 else (p - 1) / (m + p - 1)  # an int for one stage: the same answer


BUBBLE_WRONG = {  # label: (answer, text its FAIL must name)
    "idle over busy, (p - 1) / m": (lambda p, m: (p - 1) / m,
                                    "p=2, m=1: got 1, expected 0.5 (yours is (p - 1)/m, the "
                                    "idle time over the ideal time 2m"),
    "(p - 1) / (m + p)": (lambda p, m: (p - 1) / (m + p), "p=2, m=1: got 0.333333"),
    "p / (m + p - 1)": (lambda p, m: p / (m + p - 1), "p=2, m=1: got 1, expected 0.5"),
    "(p - 1) / (m p)": (lambda p, m: (p - 1) / (m * p), "p=2, m=4: got 0.125, expected 0.2"),
    "only the forwards' fill": (lambda p, m: (p - 1) / (2 * (m + p - 1)),
                                "p=2, m=1: got 0.25, expected 0.5"),
    "integer division": (lambda p, m: (p - 1) // (m + p - 1), "p=2, m=1: got 0, expected 0.5"),
    "a percentage": (lambda p, m: 100 * (p - 1) / (m + p - 1), "p=2, m=1: got 50, expected 0.5"),
    "a string": (lambda p, m: f"{p - 1}/{m + p - 1}",
                 "p=2, m=1: got '1/2', expected a number such as 0.5"),
    "a number, not the function": (0.2, "the answer: got 0.2, expected the function"),
}
BUBBLE_RIGHT = {
    "the kit's": exercises.solution_module("bubble_fraction").answer,
    "1 - busy / step": lambda p, m: 1 - 2 * m / (2 * (m + p - 1)),
    "a Fraction": lambda p, m: Fraction(p - 1, m + p - 1),
    "an int 0 for one stage": _ones_bubble,
}


def test_wrong_bubble_fraction_fail_naming_the_case(tmp_path):
    lines = verdicts("bubble_fraction", {k: a for k, (a, _) in BUBBLE_WRONG.items()}, tmp_path)
    assert_all_fail("bubble_fraction", lines, {k: n for k, (_, n) in BUBBLE_WRONG.items()})
    exercises._CHECKED.discard("bubble_fraction")


def test_bubble_fraction_written_differently_passes(tmp_path):
    lines = verdicts("bubble_fraction", BUBBLE_RIGHT, tmp_path)
    assert_all_pass("bubble_fraction", lines)
    n = len(lesson.BUBBLE_CASES)
    assert set(lines.values()) == {f"PASS bubble_fraction: {n} of {n} cases"}
    exercises._CHECKED.discard("bubble_fraction")


def test_bubble_fraction_no_answer_is_not_attempted():
    def bubble_fraction(p, m):
        ...
    assert exercises.evaluate("bubble_fraction", None).outcome == "NOT ATTEMPTED"
    assert exercises.evaluate("bubble_fraction", bubble_fraction).outcome == "NOT ATTEMPTED"
