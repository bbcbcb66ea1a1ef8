"""Lesson 02: rank environments, start methods, a notebook-defined function, failures under
torch's own process context and under dh.launch, torchrun, and the exercises' checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import spawning as lesson
from ddp_helpers.plots import spawning as splots
from ddp_helpers.solutions import env_report, root_cause_rank

ROOT = Path(__file__).resolve().parents[1]


def test_launched_ranks_see_the_rendezvous_variables():
    envs = dh.launch(lesson.rank_environment, args=(3,), nprocs=3, output="none")
    assert [e["env"]["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["env"]["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({e["env"]["MASTER_PORT"] for e in envs}) == 1
    assert len({e["pid"] for e in envs}) == 3
    table = lesson.describe_environments(envs)
    assert "every rank has the same MASTER_PORT: True" in table
    assert "(a free port)" in table and envs[0]["env"]["MASTER_PORT"] not in table


def _run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    # `python -c` has no importable __main__, exactly like a notebook kernel.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_spawned_children_output_is_collected_and_a_notebook_function_fails(tmp_path):
    proc = _run_python("""
        import torch.multiprocessing as mp
        from ddp_helpers.lessons import spawning as lesson
        def square(rank, world_size):
            print(rank * rank)
        if __name__ == "__main__":
            with lesson.children_output() as ok:
                mp.spawn(lesson.print_environment, args=(2,), nprocs=2)
            print("OK", ok.lines)
            with lesson.children_output() as children:
                try:
                    mp.spawn(square, args=(2,), nprocs=2)
                except mp.ProcessExitedException as e:
                    print("EXIT", e.exit_code)
            print("CHILDREN", children.text)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "rank argument 0: pid" in out and "rank argument 1: pid" in out
    assert "EXIT 1" in out
    assert "AttributeError: Can't get attribute 'square' on <module '__main__'" in out
    assert "^^^" not in out.split("CHILDREN", 1)[1]  # caret lines cleaned away


def test_launch_refuses_a_main_module_function():
    def square(rank, world_size):
        return rank * rank

    square.__module__ = "__main__"
    square.__qualname__ = "square"
    with pytest.raises(dh.LaunchRefused, match="defined in the notebook"):
        dh.launch(square, args=(2,), nprocs=2)


def test_start_methods_each_start_and_join():
    times = lesson.measure_start_methods(("forkserver", "fork"), nprocs=2, repeats=1)
    assert set(times) == {"forkserver", "fork"}
    assert all(t > 0 for t in times.values())


@pytest.mark.slow
def test_spawn_start_method_runs_a_module_function():
    assert lesson.time_start("spawn", nprocs=1) > 0


def test_start_method_chart_has_one_bar_per_method():
    fig = splots.start_method_bars({"spawn": 3.0, "forkserver": 0.1, "fork": 0.01})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["spawn", "forkserver", "fork"]
    assert len(ax.patches) == 3


def test_by_rank_output_is_grouped_by_rank(capsys):
    assert dh.launch(lesson.chatty, args=(2,), nprocs=2, output="by_rank") == [3, 3]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[rank")]
    assert lines == [f"[rank {r}] step {i}" for r in range(2) for i in range(3)]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_failing_rank_is_named_with_its_traceback(bad_rank):
    with pytest.raises(dh.RankRaised, match=f"rank {bad_rank} found a corrupt batch") as info:
        dh.launch(lesson.raises_on, args=(2, bad_rank), nprocs=2, output="none", timeout=120)
    assert info.value.rank == bad_rank
    assert info.value.exc_type == "ValueError"
    assert "in raises_on" in info.value.traceback_text


def test_torch_join_reports_one_of_the_two_failures():
    # Which one is a race (the notebook counts it); either way it is one of the two.
    reported = lesson.reported_by_start_processes(dh.free_port())
    assert reported in ("rank 1: its own ValueError",
                        "rank 0: a knock-on RuntimeError (caused by a failed peer)")


def test_launch_reports_the_root_cause():
    assert lesson.reported_by_launch(lesson.raises_on) == "rank 1: its own ValueError"


@pytest.mark.parametrize("line, described", [
    ("ValueError: corrupt batch", "rank 1: its own ValueError"),
    ("RuntimeError: Connection closed by peer [127.0.0.1]:1234",
     "rank 1: a knock-on RuntimeError (caused by a failed peer)"),
    ("DistBackendError: wait timed out", "rank 1: a knock-on DistBackendError (caused by a "
                                          "failed peer)"),
])
def test_describe_failure(line, described):
    assert lesson.describe_failure(1, line) == described


def test_rank_blocked_in_cpp_with_a_sigterm_handler_outlives_sigterm():
    context = mp.start_processes(lesson.outlives_sigterm, args=(2, dh.free_port()), nprocs=2,
                                 join=False, start_method="forkserver")
    with pytest.raises(mp.ProcessRaisedException, match="bad config") as info:
        lesson.join_like_spawn(context, grace_seconds=1)
    assert info.value.error_index == 1
    assert [p.exitcode for p in context.processes] == [-9, 1]  # rank 0 needed SIGKILL


def test_launch_stops_the_blocked_rank_and_names_the_failing_one():
    with pytest.raises(dh.RankRaised, match="rank 1 of 2 raised ValueError: rank 1: bad config"):
        dh.launch(lesson.outlives_sigterm, args=(2, dh.free_port()), nprocs=2, output="none")


def test_finished_ranks_results_are_kept():
    with pytest.raises(dh.RankRaised, match="rank 1 ran out of memory") as info:
        dh.launch(lesson.finishes_then_other_fails, args=(2,), nprocs=2, output="none")
    assert info.value.finished == [0]
    assert info.value.results == [{"rank": 0, "evaluated_samples": 5000}, None]


def test_hung_rank_is_stopped_by_the_timeout():
    with pytest.raises(dh.LaunchTimeout, match="had not finished") as info:
        dh.launch(lesson.hangs_on, args=(2, 1), nprocs=2, output="none", timeout=15)
    assert 1 in info.value.unfinished
    assert info.value.last_lines[1] == "waiting for a file that rank 0 never writes..."


def test_all_reduce_once_is_a_whole_program():
    assert dh.launch(lesson.all_reduce_once, args=(2,), nprocs=2, output="none") == [3.0, 3.0]


def test_torchrun_report_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="run this under torchrun"):
        lesson.torchrun_report()


@pytest.mark.slow
def test_torchrun_sets_the_variables_the_table_shows(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path), "-m",
                           "ddp_helpers.lessons.spawning"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert rows["RANK"] == ["0", "1"]
    assert rows["LOCAL_WORLD_SIZE"] == ["2", "2"]
    assert rows["TORCHELASTIC_RESTART_COUNT"] == ["0", "0"]


# -- exercises: the kit's solution passes, a stub is not attempted, a wrong answer fails -----


class _Module:
    """Stands in for an attempts/<name>.py module."""

    def __init__(self, **functions):
        self.__dict__.update(functions)


def _stub(rank=None, world_size=None):
    ...


def _wrong(*args):
    return None


@pytest.mark.parametrize("name, solution", [("env_report", env_report.env_report),
                                            ("root_cause_rank", root_cause_rank.root_cause_rank)])
def test_exercise_checks(name, solution):
    check = exercises.find(name).check
    assert all(c.ok for c in check(_Module(**{name: solution})))
    with pytest.raises(exercises.NotAttempted):
        check(_Module(**{name: _stub}))
    cases = check(_Module(**{name: _wrong}))
    assert len(cases) >= 2 and not any(c.ok for c in cases[:1])
    assert "got None" in next(c for c in cases if not c.ok).detail


def fixed_port(rank, world_size):
    """A wrong env_report: a port written in instead of read from the environment."""
    return {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_PORT": 29500}


def test_env_report_check_fails_a_hard_coded_port():
    cases = exercises.find("env_report").check(_Module(env_report=fixed_port))
    assert not any(c.ok for c in cases)
    assert "'MASTER_PORT': 29500" in cases[0].detail


def test_a_recv_nobody_sends_is_named_as_a_mismatch_before_the_timeout():
    # The contrast with hangs_on: the stuck rank is inside torch.distributed, so the kit compares
    # its recv with the other rank's barrier and stops the run long before the 120 s timeout.
    with pytest.raises(dh.CollectiveMismatch, match=r"rank 1 is in recv #1") as info:
        dh.launch(lesson.waits_in_recv, args=(2, 1), nprocs=2, output="none", timeout=120)
    assert "rank 0 is in barrier #1" in str(info.value)


def test_slowest_in_every_round():
    assert lesson.slowest_in_every_round({"spawn": [3.0, 4.0], "fork": [0.1, 0.2]}) == "spawn"
    assert lesson.slowest_in_every_round({"spawn": [3.0, 0.1], "fork": [0.1, 0.2]}) is None


def test_start_method_rounds_times_every_method_every_round():
    rounds = lesson.start_method_rounds(("forkserver", "fork"), nprocs=1, rounds=2)
    assert {m: len(t) for m, t in rounds.items()} == {"forkserver": 2, "fork": 2}
    fig = splots.start_method_bars(rounds)
    assert len(fig.axes[0].patches) == 2 and "fastest to slowest" in fig.axes[0].get_title()
