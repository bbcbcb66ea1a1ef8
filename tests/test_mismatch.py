"""Mismatched collectives named from the ranks' ledgers, through `dh.Ranks` (a `%%ranks`
cell) and through `dh.launch`: each kind of mismatch ends in a CollectiveMismatch that names
what differs, side by side, and the next cell (or launch) works. Real gloo ranks."""

from __future__ import annotations

import pytest

import ddp_helpers as dh
from tests import mismatch_fns

# kind -> (a cell a learner would type, what the message must say)
CELLS = {
    "ops": ("t = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n"
            "    dist.broadcast(t, src=0)",
            ["rank 0 is in all_reduce #1 float32[4] (In [5], line 4)",
             "rank 1 is in broadcast #1 float32[4] (In [5], line 6)", "same order"]),
    "order": ("a, b = torch.ones(4), torch.ones(2)\nif rank == 0:\n    dist.all_reduce(a)\n"
              "    dist.broadcast(b, src=0)\nelse:\n    dist.broadcast(b, src=0)\n"
              "    dist.all_reduce(a)",
              ["rank 0 is in all_reduce #1 float32[4] (In [5], line 4)",
               "rank 1 is in broadcast #1 float32[2] (In [5], line 7)", "another order"]),
    # gloo may abort a rank whose data did not fit (then "gloo aborted rank 0 ... in"):
    "shapes": ("t = torch.ones(4 + rank)\ndist.all_reduce(t)",
               ["0 (", "all_reduce #1 float32[4] (In [5], line 3)",
                "all_reduce #1 float32[5] (In [5], line 3)",
                "float32[4] on rank 0, float32[5] on rank 1"]),
    "dtypes": ("t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)\n"
               "dist.all_reduce(t)",
               ["float32[4] on rank 0, float64[4] on rank 1"]),
    "roots": ("t = torch.ones(4) * rank\ndist.broadcast(t, src=rank)",
              ["rank 0 is in broadcast #1 float32[4] (In [5], line 3)",
               "rank 1 is in broadcast #1 float32[4] (In [5], line 3)",
               "a different root on each rank: 0 on rank 0, 1 on rank 1"]),
    "fewer": ("t = torch.ones(4)\nfor step in range(4 - rank):\n    dist.all_reduce(t)",
              ["rank 0 is in all_reduce #4 float32[4] (In [5], line 4)",
               "rank 1 finished the cell after 3 collectives (3 against 4)"]),
    "never": ("if rank == 0:\n    dist.barrier()",
              ["rank 0 is in barrier #1 (In [5], line 3)",
               "rank 1 finished the cell without calling it", "never reached the barrier"]),
    "group": ("g = dist.new_group([0, 1])\nt = torch.ones(4)\n"
              "dist.all_reduce(t, group=g if rank == 1 else None)",
              ["rank 0 is in all_reduce #1 float32[4] in the world group (In [5], line 4)",
               "rank 1 is in all_reduce #1 float32[4] in ranks [0, 1] (In [5], line 4) "
               "(another group of the same ranks", "different groups"]),
    # uneven data: one batch fewer on rank 0, then a barrier meets rank 1's last all_reduce
    "uneven": ("t = torch.ones(4)\nfor step in range(3 + rank):\n    dist.all_reduce(t)\n"
               "dist.barrier()",
               ["rank 0 is in barrier #4 (In [5], line 5)",
                "rank 1 is in all_reduce #4 float32[4] (In [5], line 4)",
                "Rank 0 made fewer all_reduce calls than rank 1", "uneven data", "Join"]),
    "p2p": ("t = torch.ones(4)\nif rank == 0:\n    dist.recv(t, src=1)\nelse:\n"
            "    dist.all_reduce(t)",
            ["rank 0 is in recv #1 float32[4] from rank 1 (In [5], line 4)",
             "rank 1 is in all_reduce #1 float32[4] (In [5], line 6)",
             "every send needs a recv"]),
}
KINDS = {"order": "ops", "dtypes": "shapes", "uneven": "ops"}


@pytest.fixture
def pool():
    # One pool per test: a mismatch stops the ranks, and the fresh ones the next cell starts
    # must be gone when the test ends.
    with dh.Ranks(2, timeout=60, output="none") as p:
        yield p


@pytest.mark.parametrize("kind", list(CELLS))
def test_a_mismatch_in_a_cell_is_named_and_the_next_cell_works(pool, kind):
    code, expected = CELLS[kind]
    with pytest.raises(dh.CollectiveMismatch, match=r"^Collectives do not match \(seen after "
                       ) as e:
        pool.run(code, label="In [5]", first_line=2)
    text = str(e.value)
    for part in expected:
        assert part in text
    assert "enforce fail" not in text and "pair.cc" not in text  # gloo's C++ line is not quoted
    assert e.value.finding.kind == KINDS.get(kind, kind)
    assert "Every rank was stopped (the collectives did not match)" in text
    assert pool.run("t = torch.ones(2)\ndist.all_reduce(t)\nt.tolist()") == [[2.0, 2.0]] * 2


def test_a_sound_cell_with_many_collectives_is_not_called_a_mismatch(pool):
    code = ("g = dist.new_group([0, 1])\nt = torch.ones(3)\nfor i in range(50):\n"
            "    dist.all_reduce(t, group=g if i % 2 else None)\n"
            "    dist.broadcast(t, src=i % 2)\n"
            "    if rank == 0:\n        dist.send(t, 1)\n    else:\n        dist.recv(t, 0)\n"
            "dist.barrier()\nint(t[0])")
    assert pool.run(code) == [pool.run(code)[0]] * 2


@pytest.mark.parametrize("kind,expected", [
    ("ops", ["rank 0 is in all_reduce #1 float32[4] (tests/mismatch_fns.py, line 16)",
             "rank 1 is in broadcast #1 float32[4] (tests/mismatch_fns.py, line 18)"]),
    ("shapes", ["float32[4] on rank 0, float32[5] on rank 1"]),
    ("fewer", ["rank 0 is in all_reduce #4 float32[4]", "rank 1 returned after 3 collectives "
               "(3 against 4)"]),
    ("never", ["rank 0 is in barrier #1", "rank 1 returned without calling it"]),
    ("group", ["in the world group", "in ranks [0, 1]"]),
    ("roots", ["a different root on each rank: 0 on rank 0, 1 on rank 1"]),
])
def test_a_mismatch_in_a_launched_function_is_named(no_leftovers, kind, expected):
    with pytest.raises(dh.CollectiveMismatch, match=r"^Collectives do not match") as e:
        dh.launch(mismatch_fns.mismatched, args=(2, kind), nprocs=2, timeout=60,
                  output="none")
    for part in expected:
        assert part in str(e.value)
    assert "Every rank was stopped." in str(e.value)


def test_a_group_mismatch_is_named_whichever_rank_is_in_the_subgroup(pool):
    code = ("g = dist.new_group([0, 1])\nt = torch.ones(4)\n"
            "dist.all_reduce(t, group=g if rank == 0 else None)")
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(code)
    assert e.value.finding.kind == "group"
    assert "in ranks [0, 1]" in str(e.value) and "in the world group" in str(e.value)


def test_a_mismatch_within_a_learners_group_is_named_after_its_grace(pool):
    """Not at once (the group may have a shorter timeout of its own, which a lesson shows
    ending by itself), but long before the cell's 60 s timeout."""
    code = ("g = dist.new_group([0, 1])\nt = torch.ones(4)\n"
            "dist.all_reduce(t, group=g) if rank == 0 else dist.broadcast(t, 0, group=g)")
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(code)
    assert e.value.finding.kind == "ops" and e.value.finding.call.group == "ranks [0, 1]"
    assert "all_reduce #1 float32[4] in ranks [0, 1]" in str(e.value)


def test_an_aborted_rank_is_said_to_be_aborted_before_where_it_was():
    """gloo aborts (SIGABRT) a rank whose collective's data did not fit: the message leads
    with that, where it names the rank (whether gloo aborts is up to gloo, so this reads the
    words for a finding as the rules make it)."""
    import signal

    from ddp_helpers.engine.rules.mismatch import Finding
    from ddp_helpers.engine.words.mismatch import explain
    from ddp_helpers.ledger import Call

    mine = Call(1, "all_reduce", "world", ((4,),), ("float32",), 16, ("<cell 3>", 2))
    theirs = Call(1, "all_reduce", "world", ((5,),), ("float32",), 20, ("<cell 3>", 2))
    f = Finding("shapes", 0, 1, mine, theirs, 1, 0.0)
    text = explain(f, 2, lambda w: f"line {w[1]}", 0.5, exitcodes={0: -signal.SIGABRT})
    assert "gloo aborted rank 0 (SIGABRT: the data that arrived did not fit) in all_reduce #1 " \
        "float32[4] (line 2); rank 1 is in all_reduce #1 float32[5]" in text, text
    assert "rank 0 is in" not in text


def test_collectives_that_do_not_pair_in_a_cell_every_rank_finished_are_warned_of(pool,
                                                                                  capsys):
    """An async all-reduce on one rank only returns at once (as NCCL's collectives all do):
    every rank finishes the cell, and the kit says that the ledgers do not pair."""
    pool.run("t = torch.ones(4)\nif rank == 0:\n    work = dist.all_reduce(t, async_op=True)",
             label="In [5]", first_line=2)
    out = capsys.readouterr().out
    assert "warning: every rank finished this cell, but their collectives do not pair" in out
    assert "rank 0 called all_reduce #1 float32[4] (In [5], line 4) where rank 1 made only 0 " \
        "collectives" in out, out
    pool.restart()  # rank 0's all-reduce is still pending: a fresh group
    pool.run("t = torch.ones(4)\ndist.all_reduce(t)")
    assert "warning" not in capsys.readouterr().out  # a sound cell says nothing
