"""Lesson 02: rank environments, start methods, a notebook-defined function, failures, torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddp_helpers as dh
from ddp_helpers.lessons import spawning
from ddp_helpers.plots import spawning as splots
from ddp_helpers.solutions import env_report

ROOT = Path(__file__).resolve().parents[1]


def test_launched_ranks_see_the_rendezvous_variables():
    envs = dh.launch(spawning.rank_environment, args=(3,), nprocs=3, output="none")
    assert [e["env"]["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["env"]["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({e["env"]["MASTER_PORT"] for e in envs}) == 1
    assert len({e["pid"] for e in envs}) == 3
    table = spawning.describe_environments(envs)
    assert "every rank has the same MASTER_PORT: True" in table
    assert "(a free port)" in table and envs[0]["env"]["MASTER_PORT"] not in table


def test_notebook_function_fails_under_plain_spawn_with_attribute_error(tmp_path):
    # `python -c` has no importable __main__, exactly like a notebook kernel.
    code = ("import torch.multiprocessing as mp\n"
            "def square(rank, world_size):\n"
            "    print(rank * rank)\n"
            "if __name__ == '__main__':\n"
            "    mp.spawn(square, args=(2,), nprocs=2)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "AttributeError: Can't get attribute 'square' on <module '__main__'" in proc.stderr
    assert "ProcessExitedException" in proc.stderr


def test_launch_refuses_a_main_module_function():
    def square(rank, world_size):
        return rank * rank

    square.__module__ = "__main__"
    square.__qualname__ = "square"
    with pytest.raises(dh.LaunchRefused, match="defined in the notebook"):
        dh.launch(square, args=(2,), nprocs=2)


def test_start_methods_each_start_and_join():
    times = spawning.measure_start_methods(("forkserver", "fork"), nprocs=2, repeats=1)
    assert set(times) == {"forkserver", "fork"}
    assert all(t > 0 for t in times.values())


@pytest.mark.slow
def test_spawn_start_method_runs_a_module_function():
    assert spawning.time_start("spawn", nprocs=1) > 0


def test_start_method_chart_has_one_bar_per_method():
    fig = splots.start_method_bars({"spawn": 3.0, "forkserver": 0.1, "fork": 0.01})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["spawn", "forkserver", "fork"]
    assert len(ax.patches) == 3


def test_by_rank_output_is_grouped_by_rank(capsys):
    assert dh.launch(spawning.chatty, args=(2,), nprocs=2, output="by_rank") == [3, 3]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[rank")]
    assert lines == [f"[rank {r}] step {i}" for r in range(2) for i in range(3)]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_failing_rank_is_named_with_its_traceback(bad_rank):
    with pytest.raises(dh.RankRaised, match=f"rank {bad_rank} found a corrupt batch") as info:
        dh.launch(spawning.raises_on, args=(2, bad_rank), nprocs=2, output="none", timeout=120)
    assert info.value.rank == bad_rank
    assert info.value.exc_type == "ValueError"
    assert "in raises_on" in info.value.traceback_text


def test_hung_rank_is_stopped_by_the_timeout():
    with pytest.raises(dh.LaunchTimeout, match="had not finished") as info:
        dh.launch(spawning.hangs_on, args=(2, 1), nprocs=2, output="none", timeout=15)
    assert 1 in info.value.unfinished
    assert info.value.last_lines[1] == "waiting for a message from rank 0..."


def test_torchrun_report_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="run this under torchrun"):
        spawning.torchrun_report()


@pytest.mark.slow
def test_torchrun_sets_the_variables_the_table_shows():
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "ddp_helpers.lessons.spawning"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert rows["RANK"] == ["0", "1"]
    assert rows["LOCAL_WORLD_SIZE"] == ["2", "2"]
    assert rows["TORCHELASTIC_RESTART_COUNT"] == ["0", "0"]


def test_env_report_solution():
    reports = dh.launch(env_report.env_report, args=(3,), nprocs=3, output="none")
    assert [r["RANK"] for r in reports] == [0, 1, 2]
    assert {r["WORLD_SIZE"] for r in reports} == {3}
    assert len({r["MASTER_PORT"] for r in reports}) == 1
