"""Looking inside the ranks: pdb post-mortem on the rank that failed (its variables kept, the
other ranks' state too), each rank's stack now and as the kit saw it before it stopped them,
and values compared across ranks. Real gloo ranks, forked by the kit; the notebook's input box
is tested in test_kernel_cells.py, a script's stdin here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import ddp_helpers as dh

# Rank 1's loss is not finite (a bad shard): the cell raises there, rank 0 finishes it.
NAN_ON_RANK_1 = ("def step(batch):\n    loss = (batch.log() * 2).sum()\n"
                 "    if not torch.isfinite(loss):\n"
                 "        raise ValueError('loss is not finite')\n"
                 "    return loss\n"
                 "batch = torch.tensor([1.0, 2.0, 3.0]) - rank * torch.tensor([0.0, 3.0, 0.0])\n"
                 "loss = step(batch)")


@pytest.fixture
def pool():
    with dh.Ranks(2, timeout=60, output="none") as p:
        yield p


def failed(pool, code=NAN_ON_RANK_1, label="In [7]"):
    with pytest.raises(dh.RankRaised) as e:
        pool.run(code, label=label, first_line=2)
    return e.value


def test_post_mortem_reads_the_failing_ranks_locals_and_the_ranks_keep_their_state(pool, capsys):
    pool.run("kept = rank * 10")
    assert failed(pool).rank == 1
    capsys.readouterr()
    pool.debug(1, commands=["p loss", "p batch", "up", "p batch.shape", "where", "q"])
    out = capsys.readouterr().out
    assert "Post-mortem of rank 1, where In [7] raised" in out
    assert "ValueError: loss is not finite" in out
    assert "> In [7], line 5, step()" in out  # the frame that raised, in the learner's numbers
    assert "(Pdb rank 1) p loss\ntensor(nan)" in out
    assert "(Pdb rank 1) p batch\ntensor([ 1., -1.,  3.])" in out
    assert "(Pdb rank 1) p batch.shape\ntorch.Size([3])" in out
    assert "In [7], line 8, <module>()" in out  # `where` after `up`: the cell's own line
    assert "<cell " not in out  # the pool's cell names never reach the learner
    # every rank kept its namespace, and the group still works
    assert pool.run("kept") == [0, 10]
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]


def test_debug_without_a_rank_opens_the_rank_that_failed_and_others_say_there_is_nothing(
        pool, capsys):
    failed(pool)
    capsys.readouterr()
    pool.debug(commands=["p rank", "q"])
    assert "(Pdb rank 1) p rank\n1" in capsys.readouterr().out
    pool.debug(0)
    assert capsys.readouterr().out.strip() == (
        "Rank 0 has nothing to debug: none of its cells raised (rank 1's did: %ranks debug 1).")
    with pytest.raises(dh.LaunchRefused, match="give a rank from 0 to 1"):
        pool.debug(5)


def test_two_empty_lines_end_the_session_and_pdb_errors_do_not_end_it(pool, capsys):
    failed(pool)
    pool.debug(1, commands=["p no_such_name", "", "p loss", "", ""])
    out = capsys.readouterr().out
    assert "NameError" in out and "(Pdb rank 1) p loss\ntensor(nan)" in out
    assert pool.run("rank") == [0, 1]  # the session ended: the next cell runs


def test_the_snapshot_after_a_mismatch_holds_the_callers_locals(pool, capsys):
    code = ("def sync(grads, step):\n    if rank == 0 or step < 2:\n"
            "        dist.all_reduce(grads)\n    return grads\n"
            "for step in range(3):\n    g = sync(torch.full((4,), float(rank)), step)\n")
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(code, label="In [9]", first_line=2)
    where = e.value.where
    assert set(where) == {0, 1}
    rank0 = where.text(0)
    assert "in all_reduce (it entered all_reduce #3 float32[4] at In [9], line 4)" in rank0
    assert "In [9], line 4, in sync: dist.all_reduce(grads)" in rank0
    assert "grads = float32[4] cpu [0, 0, 0, 0]" in rank0 and "step = 2" in rank0
    # what was handed to the call is its arguments, not torch's own locals
    assert "handed tensor = float32[4] cpu [0, 0, 0, 0]" in rank0
    assert "relevant_args" not in rank0
    assert "rank 1: idle, between cells" in where.text(1)  # it had finished the cell
    # The stopped pool shows the snapshot, read-only, and says why
    capsys.readouterr()
    pool.debug(0)
    out = capsys.readouterr().out
    assert "The kit stopped every rank (the collectives did not match)" in out
    assert "grads = float32[4] cpu [0, 0, 0, 0]" in out
    assert "Each rank's stack when the kit stopped them" in str(pool.where())
    assert pool.run("rank") == [0, 1]  # and the next cell starts a fresh group


def test_where_shows_idle_ranks_and_the_failure_each_keeps(pool):
    failed(pool)
    text = str(pool.where())
    assert "rank 0: idle, between cells" in text
    assert "rank 1: idle, between cells\n  keeps for post-mortem (%ranks debug 1): ValueError: " \
        "loss is not finite" in text


def test_compare_names_what_differs_and_its_first_element(pool):
    pool.run("torch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))\n"
             "x = torch.arange(6.).reshape(2, 3)\nx[1, 2] += rank * 0.5\nsteps = 3")
    result = pool.compare("model", "x", "steps", "opt", "nothing_here")
    assert "model.0.weight" not in result.differs and "steps" not in result.differs
    assert "x" in result.differs and "opt.param_groups[0].lr" in result.differs
    assert "nothing_here" in result.differs
    assert (result.first.leaf, result.first.index) == ("x", (1, 2))
    assert result.first.values == {0: "5", 1: "5.5"} and result.first.largest == 0.5
    text = str(result)
    assert "model.1.running_mean" in text  # a buffer is compared like a parameter
    assert "First difference: x at index (1, 2) (rank 0: 5, rank 1: 5.5)" in text
    assert "NO: missing on rank 0, 1 (NameError" in text


def test_compare_finds_the_first_difference_of_a_large_tensor(pool):
    pool.run("big = torch.zeros(1_000_000)\nif rank == 1:\n    big[700_001] = 1.0")
    result = pool.compare("big")
    assert result.differs == ["big"]
    assert result.first.index == (700_001,) and result.first.values == {0: "0", 1: "1"}


def test_compare_of_equal_values_says_so(pool):
    pool.run("w = torch.ones(3, dtype=torch.bfloat16)\nn_ = [1, 2.5, 'a']")
    result = pool.compare("w", "n_")
    assert result.equal and "Every value is the same on ranks 0, 1 (bit for bit)." in str(result)


SCRIPT = textwrap.dedent('''
    import ddp_helpers as dh

    with dh.Ranks(2, timeout=60, output="none") as pool:
        try:
            pool.run("x = torch.tensor([1.0, 2.0]) * rank\\n"
                     "if rank == 1:\\n    raise KeyError('x')")
        except dh.RankRaised as e:
            print("raised on rank", e.rank)
        pool.debug(1)
        print("after:", pool.run("x.tolist()"))
''')


def test_post_mortem_from_a_script_reads_its_lines_from_stdin(tmp_path, no_leftovers):
    script = tmp_path / "debug_me.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], input="p x\np rank\nq\n",
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "raised on rank 1" in done.stdout
    # input() shows the prompt; what was typed is not echoed (a terminal would show it)
    assert "(Pdb rank 1) tensor([1., 2.])\n(Pdb rank 1) 1\n" in done.stdout
    assert "after: [[0.0, 0.0], [1.0, 2.0]]" in done.stdout
