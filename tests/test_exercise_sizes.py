"""A "ranks" check at a second world size (ddp_helpers.exercise_sizes): the learner's cells run
again on a pool of another size, so a written-in world size FAILs naming that size, while an
answer spread over cells (a global, a helper) is rebuilt and PASSes. Real ranks, real gloo."""

import pytest
from conftest import solution_edit
from exercise_support import judge

import ddp_helpers as dh
from ddp_helpers import exercise_sizes, exercises
from ddp_helpers.engine import current, make_current

SOLUTION = exercises.solution_source("naive_all_reduce")
WRITTEN_IN = SOLUTION.replace("range(1, world_size)", "range(1, 2)")
assert WRITTEN_IN != SOLUTION


@pytest.fixture(scope="module")
def two():
    with dh.Ranks(2, output="none", timeout=60) as p:
        yield p


@pytest.fixture(scope="module")
def three():
    with dh.Ranks(3, output="none", timeout=60) as p:
        yield p


def typed(pool, *cells: str) -> str:
    """Type `cells` on `pool` as %%ranks cells (fresh names each time), return the verdict."""
    pool.run("_ = globals().pop('naive_all_reduce', None)")
    for n, code in enumerate(cells):
        pool.run(code, label=f"In [{n + 1}]")
    return exercises.evaluate("naive_all_reduce", pool=pool).line


def test_a_written_in_world_size_fails_at_the_second_size(two):
    line = typed(two, WRITTEN_IN)
    assert line.startswith(
        "FAIL naive_all_reduce: world size 3: your answer failed on 3 ranks"), line


def test_the_solution_passes_at_both_sizes_and_the_ranks_stay_current(two):
    make_current(two)
    line = typed(two, SOLUTION)
    assert line.startswith("PASS naive_all_reduce: ") and line.endswith("at world sizes 2 and 3")
    assert current() is two


def test_an_answer_over_several_cells_is_rebuilt(two):
    helper = ("import torch\n\ndef _gather_to_zero(tensor, n):\n"
              "    inbox = torch.empty_like(tensor)\n    for s in range(1, n):\n"
              "        dist.recv(inbox, src=s)\n        tensor += inbox\n")
    answer = ("def naive_all_reduce(tensor):\n    if dist.get_rank() == 0:\n"
              "        _gather_to_zero(tensor, N)\n        for d in range(1, N):\n"
              "            dist.send(tensor, dst=d)\n    else:\n"
              "        dist.send(tensor, dst=0)\n        dist.recv(tensor, src=0)\n"
              "    return tensor\n")
    line = typed(two, "N = dist.get_world_size()", "x = 5", helper, answer)
    assert line.endswith("at world sizes 2 and 3"), line


def test_a_global_written_in_fails_at_the_second_size(two):
    answer = SOLUTION.replace("rank, world_size = dist.get_rank(), dist.get_world_size()",
                              "rank = dist.get_rank()")
    line = typed(two, "world_size = 2\n" + answer)
    assert line.startswith("FAIL naive_all_reduce: world size 3: "), line


def test_a_second_pool_of_two_beside_three(three, two):
    line = typed(three, SOLUTION)
    assert line.endswith("at world sizes 3 and 2"), line
    three.run("_ = globals().pop('naive_all_reduce', None)")
    three.run(SOLUTION)
    assert exercises.evaluate("naive_all_reduce", pool=three, other=two).line.endswith(
        "at world sizes 3 and 2")


def test_what_the_kit_cannot_rebuild_is_said_not_failed(two):
    # the function reads a name that no cell defines at top level: only exec made it
    answer = SOLUTION.replace("range(1, world_size)", "range(1, LIMIT)")
    line = typed(two, "exec('LIMIT = dist.get_world_size()')", answer)
    assert line.startswith("PASS naive_all_reduce: "), line
    assert "at world size 2 (not tried at 3: LIMIT is not defined at the top level" in line


def test_cells_are_chosen_by_the_names_they_define():
    cells = {1: "a = 1\nb = 2\n", 2: "def f():\n    return a + g() + math.pi\n",
             3: "def g():\n    x = 3\n    return x\n", 4: "x = 9\n", 5: "y = f()\n",
             6: "a = 7\n", 7: "import math\nworld_size = 5\n"}
    import math
    chosen = exercise_sizes.cells_for(["f"], {"math": math}, cells)
    # not 4: g's x is its own; not 5: y is not asked; a's last cell; math imported, not cell 7
    assert [n for n, _ in chosen] == [0, 2, 3, 6] and chosen[0][1] == "import math as math"
    top = {1: "k = 2\n", 2: "m = k * 2\n", 3: "k = 5\n", 4: "def f():\n    return m\n"}
    chosen = [n for n, _ in exercise_sizes.cells_for(["f"], {}, top)]
    assert chosen == [1, 2, 4]  # m was made from k as cell 1 left it


def test_the_second_size():
    assert [exercise_sizes.other_size(n) for n in (1, 2, 3, 4)] == [2, 3, 2, 2]
    assert exercise_sizes.other_size(2, fixed=4) == 4
    assert exercise_sizes.other_size(4, fixed=4) == 2


# Every "ranks" exercise with the world size (or the ranks) of the notebook's 2 ranks written
# in: right on 2 ranks, so only the second size can catch it (or, where the size is an
# argument, the check's own cases at other sizes: IN_ARGUMENTS).
WRITTEN_IN_ANSWERS = {  # exercise: (text in the kit's solution, the same with 2 written in)
    "naive_all_reduce": ("range(1, world_size)", "range(1, 2)"),
    "ring_all_gather": ("n = dist.get_rank(), dist.get_world_size()", "n = dist.get_rank(), 2"),
    "prepare_once": ("    dist.barrier()", "    if rank in (0, 1):\n        dist.barrier()"),
    "bucketed_average_gradients": ("bucket /= world_size", "bucket /= 2"),
    "shard_indices": ("indices[rank:total:world_size]", "indices[rank:total:2]"),
    "one_f_one_b": ("warmup = min(num_stages - 1 - stage", "warmup = min(1 - stage"),
    "naive_ddp": ("p.grad /= dist.get_world_size()", "p.grad /= 2"),
    "flat_ddp": ("flat /= dist.get_world_size()", "flat /= 2"),
    "overlapped_ddp": ("p.grad /= dist.get_world_size()", "p.grad /= 2"),
    "bucketed_ddp": ("flat /= dist.get_world_size()", "flat /= 2"),
    "zero1": ("shard.grad = mine / world", "shard.grad = mine / 2"),
    "row_parallel": ("    y = h_shard @ weight_shard.T\n    dist.all_reduce(y)\n"
                     "    return y + bias", "    y = h_shard @ weight_shard.T + bias / 2\n"
                     "    dist.all_reduce(y)\n    return y"),
}


@pytest.mark.parametrize("name", sorted(WRITTEN_IN_ANSWERS))
def test_an_answer_with_two_ranks_written_in_fails_naming_world_size_3(name, two, three,
                                                                      tmp_path):
    old, new = WRITTEN_IN_ANSWERS[name]
    answer = solution_edit(name, old, new)
    line = judge(name, answer, tmp_path, two, three).line
    named = IN_ARGUMENTS.get(name, "world size 3")
    assert line.startswith(f"FAIL {name}: ") and named in line, line


IN_ARGUMENTS = {"shard_indices": "world_size=3", "one_f_one_b": "stage 0 of 3"}


def test_every_ranks_exercise_is_tried_with_a_size_written_in():
    ranks = {n for n, ex in exercises.all_exercises().items() if ex.kind == "ranks"}
    assert ranks == set(WRITTEN_IN_ANSWERS)
