"""Lesson 04: the notebook's own `%%ranks` cells, run on real gloo ranks, show what the notebook
prints (the barrier's ordering, the race and its fix, monitored_barrier's names, the timeouts,
the stall recovery, DETAIL's mismatch); the exercise checks pass the solutions and fail wrong
answers."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import barriers as lesson
from ddp_helpers.plots import barriers as plots
from ddp_helpers.solutions import monitored_barrier_names, prepare_once

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "04_barriers.ipynb"
_SOURCES = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
            if c["cell_type"] == "code"]


def cell(needle: str) -> tuple[str, tuple[str, ...]]:
    """The notebook's one `%%ranks` cell containing `needle`: its code and --return names."""
    found = [s for s in _SOURCES if s.startswith("%%ranks") and needle in s]
    assert len(found) == 1, f"{len(found)} %%ranks cells contain {needle!r}"
    magic, _, body = found[0].partition("\n")
    args = shlex.split(magic)
    names = args[args.index("--return") + 1].split(",") if "--return" in args else []
    return body, tuple(names)


def run_cell(pool: dh.Ranks, needle: str, **kw) -> list:
    """Run the cell on `pool`; each rank's (last value, {returned name: value})."""
    body, names = cell(needle)
    return pool.run(body, returns=names, **kw)


def values(replies: list) -> list:
    return [value for value, _ in replies]


def returned(replies: list, name: str) -> list:
    return [named[name] for _, named in replies]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("barriers")


@pytest.fixture(scope="module")
def two(workdir):
    with dh.Ranks(2, timeout=60, output="none", env={"WORKDIR": str(workdir)}) as pool:
        run_cell(pool, "from ddp_helpers.lessons import barriers as lesson")
        yield pool


def test_nobody_leaves_the_barrier_before_the_last_arrives(two, capsys):
    rows = lesson.timeline(returned(run_cell(two, "times = {"), "times"))
    lesson.timeline_facts(rows)
    assert capsys.readouterr().out == ("order of arrival: [0, 1]\n"
                                       "every rank left after the last one arrived: True\n"
                                       "the rank that waited longest: 0\n")
    assert rows[0]["waited"] > rows[1]["waited"]
    fig = plots.barrier_timeline_plot(rows)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]


def test_without_a_barrier_rank_1_reads_an_unfinished_file(two):
    found = returned(run_cell(two, '"no_barrier.txt"'), "found")
    assert found[0] == "complete"
    assert found[1] == "missing" or found[1].startswith("half-written")


def test_rank_zero_first_removes_the_race(two):
    assert values(run_cell(two, "dh.rank_zero_first()")) == ["complete", "complete"]


def test_monitored_barrier_names_the_late_rank(two):
    report = values(run_cell(two, "dist.monitored_barrier("))
    assert lesson.named_ranks(report[0]) == [1] and "failed to pass" in report[0]
    assert report[1] == "busy: never reached the barrier"


@pytest.mark.parametrize("wait_all_ranks", [True, False])
def test_the_prediction_matches_monitored_barrier_on_three_ranks(wait_all_ranks):
    late = ("if rank > 0:\n    time.sleep(1.5)\n    report = ''\nelse:\n    try:\n"
            "        dist.monitored_barrier(group=gloo, timeout=timedelta(seconds=1), "
            f"wait_all_ranks={wait_all_ranks})\n    except RuntimeError as e:\n"
            "        report = str(e)\nreport")
    with dh.Ranks(3, timeout=60, output="none") as pool:
        pool.run("import time\nfrom datetime import timedelta\n"
                 "gloo = dist.new_group(backend='gloo')")
        message = pool.run(late)[0]
    assert lesson.named_ranks(message) == lesson.MONITORED_NAMES[wait_all_ranks]
    assert monitored_barrier_names.answer == lesson.MONITORED_NAMES


def test_a_short_group_timeout_ends_mismatched_collectives(two, capsys):
    replies = run_cell(two, "timedelta(seconds=2)")
    assert values(replies) == [True, True]
    lesson.timeout_facts(returned(replies, "error"), returned(replies, "waited"), 2.0)
    assert capsys.readouterr().out == (
        "every rank's collective raised: True\n"
        "gloo's message where it timed out: Timed out waiting 2000ms for recv operation to "
        "complete\n"
        "the longest wait reached the group's 2 s timeout: True\n")
    assert two.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]


def test_timeout_facts_when_the_peer_lost_its_connection_first(capsys):
    lesson.timeout_facts(["[x/pair.cc:561] Connection closed by peer", "Timed out waiting"],
                         [1.99, 2.01], 2.0)
    assert "gloo's message where it timed out: Timed out waiting\n" in capsys.readouterr().out


def test_a_skipped_barrier_stops_the_ranks_and_the_next_cell_carries_on(capsys):
    with dh.Ranks(2, timeout=60, output="none") as pool:
        pool.run("found = 1")
        with pytest.raises(dh.CollectiveMismatch, match=r"Collectives do not match") as e:
            run_cell(pool, "rank 1 never comes")
        assert "rank 0 is in barrier #1" in str(e.value) and "variables are gone" in str(e.value)
        assert values(run_cell(pool, '"found" in globals()')) == [(2, False), (2, False)]
    assert "starting 2 fresh ranks" in capsys.readouterr().out


def test_detail_names_the_mismatched_collectives(workdir):
    env = {"WORKDIR": str(workdir), "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    with dh.Ranks(2, timeout=60, output="none", env=env) as pool:
        messages = returned(run_cell(pool, "the same bug, on the default group"), "message")
        waited = pool.get("waited")
    assert [lesson.mismatch_summary(m) for m in messages] == [
        "mismatch detected: rank 0 ran ALLREDUCE, rank 1 ran BROADCAST"] * 2
    assert max(waited) < 30  # named at once, not after the group's 60 s timeout


def test_three_ranks_in_a_monitored_barrier(capsys):
    """Going deeper: whom rank 0 names, and the other caller pointed to rank 0's logs (the
    timing facts are the notebook's; here only what holds however loaded the machine is)."""
    both = dh.launch(lesson.monitored_barrier_on_ranks, args=((1, 2), 1.0, True), nprocs=3,
                     output="none")
    one = dh.launch(lesson.monitored_barrier_on_ranks, args=((1,), 1.0, False), nprocs=3,
                    output="none")
    assert lesson.named_ranks(both[0][0]) == [1, 2] and both[1][0] == both[2][0] == "busy"
    assert lesson.named_ranks(one[0][0]) == [1] and "rank 0 logs" in one[2][0]
    lesson.monitored_barrier_facts([both], [one], timeout_s=1.0)
    out = capsys.readouterr().out
    assert "rank 0 named [1, 2] in 1 of 1 rounds" in out and "rank 0 named [1] in 1 of 1" in out
    assert "rank 2 raised, pointing to rank 0's logs, in 1 of 1 rounds" in out


def test_a_peer_that_exits_ends_the_barrier_with_connection_closed(capsys):
    runs = [dh.launch(lesson.barrier_after_a_peer_exits, nprocs=2, output="none")]
    assert "Connection closed by peer" in runs[0][0][0]
    assert runs[0][1][0] == "skipped the barrier and exited"
    lesson.peer_exit_facts(runs)
    assert "'Connection closed by peer' in 1 of 1 rounds" in capsys.readouterr().out


def test_the_timing_facts_on_made_up_rounds(capsys):
    named = "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms"
    late = [("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms", 2.02),
            ("busy", 3.0), ("busy", 3.0)]  # one timeout per missing rank: not what gloo does
    other = [("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms", 1.01),
             ("busy", 3.0), ("received errors ... from rank 0. Please check rank 0 logs", 5.0)]
    lesson.monitored_barrier_facts([[(named, 1.01), ("busy", 3), ("busy", 3)], late], [other], 1.0)
    out = capsys.readouterr().out
    assert "in 2 of 2 rounds" in out and "not one per missing rank): False" in out
    assert "long before its own 5 s: False" in out
    lesson.peer_exit_facts([[("Connection closed by peer [x]", 1800.0), ("exited", 0.5)]])
    assert "minutes): False" in capsys.readouterr().out


def test_message_summaries():
    assert lesson.named_ranks("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms") \
        == [1, 2]
    assert lesson.named_ranks("something else") == []
    assert lesson.first_line("[/a/b/unbound_buffer.cc:78] Timed out waiting\nmore") == \
        "Timed out waiting"
    assert lesson.mismatch_summary("boom") == "no mismatch reported: boom"


# ---------------------------------------------------------------- exercises

_TEMPLATE = 'def prepare_once(rank, path, write):\n    """Not yet."""\n    ...\n'
_RETURNS_NONE = "def prepare_once(rank, path, write):\n    return None\n"
_NO_BARRIER = "def prepare_once(rank, path, write):\n    if rank == 0:\n        write(path)\n"
_EVERY_RANK_WRITES = ("def prepare_once(rank, path, write):\n    write(path)\n"
                      "    dist.barrier()\n")


def _verdict(pool: dh.Ranks, code: str | None = None, **push) -> exercises.Verdict:
    pool.run("_ = globals().pop('prepare_once', None)")
    if code is not None:
        pool.run(code)
    if push:
        pool.push(**push)
    return exercises.evaluate("prepare_once", pool=pool)


def test_prepare_once_passes_the_solution_and_fails_wrong_answers(two):
    assert _verdict(two, prepare_once=prepare_once.prepare_once).outcome == "PASS"
    assert _verdict(two).outcome == "NOT ATTEMPTED"
    assert _verdict(two, _TEMPLATE).outcome == "NOT ATTEMPTED"
    missing = _verdict(two, _RETURNS_NONE)
    assert missing.outcome == "FAIL" and "got 'missing', expected 'complete'" in missing.line
    racy = _verdict(two, _NO_BARRIER)
    assert racy.outcome == "FAIL" and "rank 1: a slow writer: the file" in racy.line, racy.line
    assert _verdict(two, _EVERY_RANK_WRITES).outcome == "FAIL"  # two writes (and a torn file)


def test_the_prediction_check():
    assert exercises.evaluate("monitored_barrier_names",
                              monitored_barrier_names.answer).outcome == "PASS"
    assert exercises.evaluate("monitored_barrier_names", None).outcome == "NOT ATTEMPTED"
    wrong = exercises.find("monitored_barrier_names").wrong_answer
    verdict = exercises.evaluate("monitored_barrier_names", wrong)
    assert verdict.outcome == "FAIL" and "wait_all_ranks=False" in verdict.line
    assert exercises.evaluate("monitored_barrier_names", [1, 2]).outcome == "FAIL"
