"""Lesson 01: the notebook's own `%%ranks` cells, run on real gloo ranks (2 and 3), give the
results the notebook prints; the exercise checks pass the kit's solutions and fail wrong ones."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import process_groups as lesson
from ddp_helpers.plots import process_groups as plots
from ddp_helpers.solutions import naive_all_reduce, ring_all_gather

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_process_groups.ipynb"
_SOURCES = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
            if c["cell_type"] == "code"]


def cell(needle: str) -> tuple[str, tuple[str, ...], list[int] | None]:
    """The notebook's one `%%ranks` cell containing `needle`: its code, its --return names and
    its --targets."""
    found = [s for s in _SOURCES if s.startswith("%%ranks") and needle in s]
    assert len(found) == 1, f"{len(found)} %%ranks cells contain {needle!r}"
    magic, _, body = found[0].partition("\n")
    args = shlex.split(magic)

    def option(flag: str) -> list[str]:
        return args[args.index(flag) + 1].split(",") if flag in args else []

    targets = [int(t) for t in option("--targets")] or None
    return body, tuple(option("--return")), targets


def run_cell(pool: dh.Ranks, needle: str) -> list:
    """Run the cell on `pool`; each rank's (last value, {returned name: value})."""
    body, names, targets = cell(needle)
    return pool.run(body, targets=targets, returns=names)


def values(replies: list) -> list:
    return [value for value, _ in replies]


def returned(replies: list, name: str) -> list:
    return [named[name] for _, named in replies]


@pytest.fixture(scope="module")
def two():
    with dh.Ranks(2, timeout=60, output="none") as pool:
        pool.run("import os, time\nfrom datetime import timedelta\nfrom ddp_helpers import compat")
        yield pool


@pytest.fixture(scope="module")
def three():
    with dh.Ranks(3, timeout=60, output="none") as pool:
        pool.run("import os, time\nfrom ddp_helpers import compat")
        yield pool


@pytest.fixture(scope="module")
def pools(two, three) -> dict[str, dh.Ranks]:
    """Both pools by name, made before any test's process snapshot (they outlive the test)."""
    return {"two": two, "three": three}


# ---------------------------------------------------------------- making a group


def test_env_init_the_store_and_the_ranks_place():
    with dh.Ranks(2, group=False, output="none") as pool:
        env, initialised = zip(*values(run_cell(pool, '"RANK", "WORLD_SIZE", "MASTER_ADDR"')))
        assert [e["RANK"] for e in env] == ["0", "1"] and initialised == (False, False)
        assert {e["WORLD_SIZE"] for e in env} == {"2"}
        run_cell(pool, 'init_method="env://"')
        assert values(run_cell(pool, "dist.get_rank(), dist.get_world_size()")) == [
            (0, 2, "gloo"), (1, 2, "gloo")]
        greetings = ["hello from rank 0", "hello from rank 1"]
        assert values(run_cell(pool, "store.wait(")) == [greetings, greetings]


def test_tcp_then_file_init_each_form_a_working_group(tmp_path):
    env = {"INIT_FILE": str(tmp_path / "rendezvous")}
    with dh.Ranks(2, group=False, output="none", env=env) as pool:
        assert [t.item() for t in values(run_cell(pool, 'f"tcp://'))] == [3.0, 3.0]
        assert [t.item() for t in values(run_cell(pool, 'f"file://'))] == [3.0, 3.0]
        assert pool.run("dist.get_backend()") == ["gloo", "gloo"]


# ---------------------------------------------------------------- point to point


def test_send_recv_and_gloo_send_waits_for_the_recv(two):
    assert [t.tolist() for t in values(run_cell(two, "dist.send(t, dst=1)"))] == [
        [1.0, 2.0, 3.0]] * 2
    stamps = returned(run_cell(two, '"recv posted"'), "stamps")
    assert stamps[0]["send returned"] >= stamps[1]["recv posted"]


def test_a_ring_of_blocking_sends_deadlocks_on_gloo(two):
    replies = run_cell(two, "impatient = dist.new_group")
    assert values(replies) == [True, True]  # every rank's send failed
    assert any("timed out" in e.lower() for e in returned(replies, "error"))
    assert two.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]


def test_irecv_buffer_is_stale_before_wait_and_filled_after(two):
    run_cell(two, "peek = inbox.clone()")
    (peek, inbox), = values(run_cell(two, "peek, inbox"))  # rank 1 only
    assert peek.tolist() == [0.0, 0.0, 0.0] and inbox.tolist() == [7.0, 8.0, 9.0]


def test_async_all_reduce_and_its_future(two):
    assert [(t.item(), m.item()) for t, m in values(run_cell(two, "get_future()"))] == [
        (3.0, 1.5), (3.0, 1.5)]


# ---------------------------------------------------------------- collectives

_COLLECTIVE_CELLS = {
    "broadcast": "dist.broadcast(t, src=0)",
    "all_reduce SUM": "dist.all_reduce(t, op=dist.ReduceOp.SUM)\nafter",
    "all_reduce AVG": "compat.gloo_supports_avg()",
    "all_reduce MAX": "op=dist.ReduceOp.MAX",
    "reduce": "dist.reduce(t, dst=0",
    "all_gather": "dist.all_gather(parts, t)",
    "gather": "dist.gather(t, gather_list=parts",
    "scatter": "dist.scatter(",
    "reduce_scatter": "compat.gloo_supports_reduce_scatter()",
}


@pytest.mark.parametrize("world", ["two", "three"])
def test_every_collective_cell_gives_the_documented_result(world, pools, capsys):
    pool = pools[world]
    assert set(_COLLECTIVE_CELLS) == set(lesson.COLLECTIVES)
    for name, needle in _COLLECTIVE_CELLS.items():
        replies = run_cell(pool, needle)
        before, after = returned(replies, "before"), returned(replies, "after")
        assert lesson.check_collective(name, before, after), capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count("PASS") == len(lesson.COLLECTIVES) and "FAIL" not in out


def test_the_documented_results_on_two_ranks():
    before = [torch.arange(1.0, 5.0) + 10 * r for r in range(2)]
    assert lesson.expected_after("all_reduce AVG", before)[1].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert lesson.expected_after("reduce", before)[1] is None
    assert lesson.expected_after("reduce_scatter", before)[1].tolist() == [16.0, 18.0]
    assert lesson.expected_after("scatter", [torch.arange(1.0, 5.0), None])[1].tolist() == [
        3.0, 4.0]
    with pytest.raises(ValueError, match="no expected result for 'all_to_all'"):
        lesson.expected_after("all_to_all", before)


def test_check_collective_names_the_first_wrong_rank(capsys):
    before = [torch.tensor([1.0]), torch.tensor([2.0])]
    after = [torch.tensor([3.0]), torch.tensor([2.0])]
    assert not lesson.check_collective("all_reduce SUM", before, after)
    out = capsys.readouterr().out
    assert "FAIL all_reduce SUM: rank 1: at index 0: got 2, expected 3" in out


@pytest.mark.parametrize("world", ["two", "three"])
def test_nobody_leaves_the_barrier_before_the_last_arrival(world, pools, capsys):
    replies = run_cell(pools[world], "time.sleep(0.5 * rank)")
    arrived, left = returned(replies, "arrived"), returned(replies, "left")
    assert lesson.barrier_check(arrived, left)
    assert f"the last to arrive was rank {len(arrived) - 1}" in capsys.readouterr().out


def test_new_group_reduces_only_its_members(three):
    got = values(run_cell(three, "dist.new_group([1, 2])"))
    assert [(t.item(), r) for t, r in got] == [(0.0, -1), (30.0, 0), (30.0, 1)]


# ---------------------------------------------------------------- the ring


def define_the_ring(pool: dh.Ranks) -> None:
    """Run the cells that define the ring's move and its two phases."""
    for needle in ('"""Send `outgoing`', "def reduce_scatter_phase", "def all_gather_phase"):
        run_cell(pool, needle)


@pytest.mark.parametrize("world", ["two", "three"])
def test_the_ring_cells_equal_dist_all_reduce_and_send_2_n_minus_1_over_n(world, pools, capsys):
    pool = pools[world]
    n = pool.nprocs
    define_the_ring(pool)
    run_cell(pool, "reduce_scatter_phase(chunks, trace)\nx")
    replies = run_cell(pool, "all_gather_phase(chunks, trace)\nx")
    traces, sent = returned(replies, "trace"), returned(replies, "sent")
    replies = run_cell(pool, "expected = torch.arange(1.0, 7.0)")
    x, expected = returned(replies, "x"), returned(replies, "expected")
    assert all(torch.equal(a, b) for a, b in zip(x, expected))
    assert all(len(t) == 1 + 2 * (n - 1) and torch.equal(t[-1], x[0]) for t in traces)
    assert lesson.traffic_check(sent, 6) and sent == [2 * (n - 1) * 6 / n] * n
    assert "PASS traffic" in capsys.readouterr().out
    run_cell(pool, "dist.batch_isend_irecv(ops)")
    assert values(run_cell(pool, "torch.equal(y, expected)")) == [True] * n
    fig = plots.ring_steps(traces)
    assert len(fig.axes) == 1 + 2 * (n - 1)


def test_the_timing_cell_measures_both_for_every_size(three):
    define_the_ring(three)
    timings = returned(run_cell(three, "median_seconds"), "timings")
    for per_rank in timings:
        assert list(per_rank) == [1_000, 100_000, 1_000_000]
        assert all(s > 0 for t in per_rank.values() for s in t.values())


def test_traffic_formula(capsys):
    assert lesson.traffic_per_rank(2, 100) == {"ring, every rank": 100.0,
                                               "through rank 0, rank 0": 100}
    assert lesson.traffic_per_rank(8, 800)["ring, every rank"] == 1400.0
    lesson.traffic_table()
    assert "   16          1,875,000               15,000,000" in capsys.readouterr().out


def test_before_after_figure_labels_every_rank():
    before = [torch.arange(1.0, 5.0) + 10 * r for r in range(3)]
    fig = plots.before_after("all_reduce SUM", before,
                             lesson.expected_after("all_reduce SUM", before))
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert "33" in [t.get_text() for t in right.texts] and right.get_title() == "after"


# ---------------------------------------------------------------- exercises

_TEMPLATE = 'def {name}(tensor):\n    """Not written yet."""\n    ...\n'
_RETURNS_NONE = "def {name}(tensor):\n    return None\n"
_FORGETS_THE_LAST_RANK = '''
def naive_all_reduce(tensor):
    last = world_size - 1
    if rank == 0:
        inbox = torch.empty_like(tensor)
        for src in range(1, last):  # off by one: the last rank's tensor is never added
            dist.recv(inbox, src=src)
            tensor += inbox
        for dst in range(1, world_size):
            dist.send(tensor, dst=dst)
    else:
        if rank != last:
            dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
'''
_USES_ALL_REDUCE = "def naive_all_reduce(tensor):\n    dist.all_reduce(tensor)\n"
_RING_WITH_ALL_GATHER = '''
def ring_all_gather(tensor):
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)
'''


def _verdict(pool: dh.Ranks, name: str, code: str | None = None, **push) -> exercises.Verdict:
    pool.run(f"_ = globals().pop({name!r}, None)")
    if code is not None:
        pool.run(code)
    if push:
        pool.push(**push)
    return exercises.evaluate(name, pool=pool)


@pytest.mark.parametrize("name, solution", [
    ("naive_all_reduce", naive_all_reduce.naive_all_reduce),
    ("ring_all_gather", ring_all_gather.ring_all_gather)])
def test_each_exercise_passes_the_solution_and_fails_wrong_answers(name, solution, three):
    assert _verdict(three, name, **{name: solution}).outcome == "PASS"
    assert _verdict(three, name).outcome == "NOT ATTEMPTED"
    assert _verdict(three, name, _TEMPLATE.format(name=name)).outcome == "NOT ATTEMPTED"
    wrong = _verdict(three, name, _RETURNS_NONE.format(name=name))
    assert wrong.outcome == "FAIL" and "rank 0:" in wrong.line, wrong.line


def test_naive_all_reduce_that_forgets_a_rank_fails_with_the_value(three):
    wrong = _verdict(three, "naive_all_reduce", _FORGETS_THE_LAST_RANK)
    assert wrong.outcome == "FAIL" and "10 random floats (summed in place)" in wrong.line
    assert "expected" in wrong.line, wrong.line


@pytest.mark.parametrize("name, code", [("naive_all_reduce", _USES_ALL_REDUCE),
                                        ("ring_all_gather", _RING_WITH_ALL_GATHER)])
def test_an_answer_that_calls_a_collective_fails(name, code, three):
    wrong = _verdict(three, name, code)
    assert wrong.outcome == "FAIL" and "send/recv" in wrong.line, wrong.line
    assert three.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [3.0] * 3
