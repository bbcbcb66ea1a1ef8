"""dh.Ranks: persistent ranks run cells with state kept, and fail the kit's way (real gloo)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import wait_no_rank_processes

import ddp_helpers as dh
from ddp_helpers.engine.sets.census import pid_alive


@pytest.fixture
def pool(no_leftovers):
    with dh.Ranks(2, timeout=30, output="none") as p:
        yield p


class _FailsToUnpickle:
    """Pickles fine here; unpickling it on a rank raises (eval of 1/0)."""

    def __reduce__(self):
        return (eval, ("1/0",))


def test_a_push_a_rank_cannot_rebuild_is_an_error_and_every_rank_keeps_its_state(pool):
    pool.run("kept = rank + 10")
    with pytest.raises(dh.RankRaised, match=r"(?s)ZeroDivisionError.*every rank keeps its state"):
        pool.push(bad=_FailsToUnpickle())
    assert pool.running and pool.get("kept") == [10, 11]


def test_push_refuses_a_class_defined_in_the_notebook(pool, monkeypatch):
    namespace = {"__name__": "__main__"}
    exec("class Config:\n    lr = 0.1\n", namespace)
    monkeypatch.setattr(sys.modules["__main__"], "Config", namespace["Config"], raising=False)
    with pytest.raises(dh.LaunchRefused, match=r"push: cfg \(a Config\) refers to __main__.Config"):
        pool.push(cfg=namespace["Config"]())
    assert pool.run("rank") == [0, 1] and pool.cells_run == 1  # nothing was sent


def test_an_infinite_timeout_is_refused_before_anything_starts():
    with pytest.raises(dh.LaunchRefused, match="finite timeout"):
        dh.Ranks(2, timeout=float("inf"))


def test_a_rank_that_exits_in_a_cell_is_said_to_have_exited(pool):
    with pytest.raises(dh.RankDied) as info:
        pool.run("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(30)")
    text = str(info.value)
    assert "rank 1 had exited" in text and "did not answer" not in text, text


def test_state_persists_across_cells(pool):
    pool.run("t = torch.tensor([rank + 1.0])")
    pool.run("dist.all_reduce(t)")
    assert pool.run("t.item()") == [3.0, 3.0]
    assert pool.run("rank, world_size, device.type") == [(0, 2, "cpu"), (1, 2, "cpu")]


def test_a_cell_without_a_final_expression_returns_none(pool):
    assert pool.run("x = 1\nif x:\n    y = 2") == [None, None]


def test_targets_run_only_on_those_ranks(pool):
    pool.run("y = -1")
    assert pool.run("y = 5\ny", targets=[1]) == [5]
    assert pool.get("y") == [-1, 5]


def test_push_get_and_returns(pool):
    pool.push(lr=0.5, steps=[1, 2])
    assert pool.get("lr") == [0.5, 0.5]
    replies = pool.run("w = torch.full((2,), float(rank)) * lr\nw.sum()", returns=("w",))
    values = [v for v, _ in replies]
    assert [v.item() for v in values] == [0.0, 1.0]
    assert [named["w"].tolist() for _, named in replies] == [[0.0, 0.0], [0.5, 0.5]]


def test_functions_defined_in_a_cell_live_on_the_ranks(pool):
    pool.run("def double(x):\n    return 2 * x\nclass Box:\n    size = 3")
    assert pool.run("double(rank) + Box.size") == [3, 5]


def test_a_rank_that_raises_is_named_and_every_rank_keeps_its_state(pool):
    pool.run("kept = rank * 10")
    with pytest.raises(dh.RankRaised, match=r"rank 1 of 2 raised ValueError: bad batch") as e:
        pool.run("if rank == 1:\n    raise ValueError('bad batch')\nx = 1")
    text = str(e.value)
    assert "every rank keeps its state" in text
    assert 'File "<cell 2>", line 2' in text and "raise ValueError('bad batch')" in text
    assert "cell_server" not in text and "supervisor" not in text  # no kit frames
    assert pool.get("kept") == [0, 10]


def test_a_long_error_on_every_rank_is_said_whole_once(pool):
    # DDP's unused-parameter error is ~900 characters over five lines, the same on every rank:
    # the headline gives its first line, the other ranks are "the same", the traceback says it all.
    code = ("words = ' '.join(['word'] * 60)\n"
            "raise RuntimeError(words + '\\nsecond line for rank ' + str(rank))")
    with pytest.raises(dh.RankRaised) as e:
        pool.run(code)
    text = str(e.value)
    headline = text.splitlines()[0]
    assert headline.startswith("rank 0 of 2 raised RuntimeError: word word") and \
        headline.endswith(" ...") and len(headline) < 220, headline
    assert "Rank 1 raised too (rank 1: the same RuntimeError)" in text
    assert text.count("second line for rank 0") == 1  # in the traceback, not twice
    assert "second line for rank 1" not in text


def test_different_errors_on_two_ranks_are_each_named(pool):
    with pytest.raises(dh.RankRaised) as e:
        pool.run("raise ValueError(f'bad batch on {rank}')")
    assert "Rank 1 raised too (rank 1: ValueError: bad batch on 1)" in str(e.value)


def test_a_rank_that_raises_while_the_other_waits_in_all_reduce_stops_both(pool, capsys):
    pool.run("kept = rank")
    old = pool.status().ranks
    with pytest.raises(dh.RankRaised) as e:
        pool.run("t = torch.ones(1)\nif rank == 1:\n    raise RuntimeError('loss is NaN')\n"
                 "dist.all_reduce(t)", timeout=60)
    text = str(e.value)
    assert "rank 1 of 2 raised RuntimeError: loss is NaN" in text
    assert "Every rank was stopped" in text and "variables are gone" in text
    assert "rank 0 was in all_reduce, at this cell, line 4: dist.all_reduce(t)" in text
    assert not any(pid_alive(r.pid) for r in old)
    # the message points at the snapshot, and the snapshot is there: rank 0's t, as it was
    assert "what each held when stopped: `%ranks debug R`" in text
    assert pool.snapshot is not None and "t =" in pool.snapshot.text(0)
    with pytest.raises(dh.RankRaised, match="NameError"):  # a fresh group: kept is gone
        pool.run("kept")
    assert "starting 2 fresh ranks" in capsys.readouterr().out
    assert pool.run("rank") == [0, 1]


def test_a_collective_only_some_ranks_call_is_stopped_as_stalled(pool):
    with pytest.raises(dh.CollectiveMismatch, match=r"Collectives do not match") as e:
        pool.run("if rank == 0:\n    dist.barrier()", timeout=60)
    assert "rank 0 is in barrier #1 (this cell, line 2)" in str(e.value)
    assert pool.run("1") == [1, 1]


def test_a_collective_called_on_one_target_only_is_stalled(pool):
    with pytest.raises(dh.LaunchTimeout, match="stalled"):
        pool.run("dist.barrier()", targets=[1], timeout=60)


def test_a_cell_past_its_timeout_stops_every_rank(pool):
    old = [r.pid for r in pool.status().ranks]
    with pytest.raises(dh.LaunchTimeout, match=r"timeout after 5 s: rank\(s\) 0, 1 of 2") as e:
        pool.run("import time\nprint('working', flush=True)\ntime.sleep(60)", timeout=5)
    assert "working" in str(e.value)  # the last line each rank printed
    assert "the cell ran past its timeout" in str(e.value)
    assert not any(pid_alive(p) for p in old)
    assert pool.run("rank") == [0, 1]


def test_keyboard_interrupt_stops_every_rank_and_the_next_cell_works(pool, capsys):
    old = [r.pid for r in pool.status().ranks]
    main = threading.main_thread().ident
    threading.Timer(1.0, signal.pthread_kill, args=(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as e:
        pool.run("import time\ntime.sleep(60)")
    assert "Every rank was stopped (the cell was interrupted)" in str(e.value)
    # IPython shows this one line instead of a traceback through the kit's frames
    assert e.value._render_traceback_() == [f"KeyboardInterrupt: {e.value}"]
    assert not any(pid_alive(p) for p in old)
    assert pool.run("rank") == [0, 1]


def test_a_rank_killed_between_cells_is_reported_as_died(pool):
    pid = pool.status().ranks[1].pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 was killed by signal SIGKILL"):
        pool.run("1")
    assert pool.run("rank") == [0, 1]


def test_a_rank_killed_in_a_cell_while_the_other_waits_is_reported_as_died(pool):
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 was killed by signal SIGKILL"):
        pool.run("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                 "dist.barrier()", timeout=60)


def test_errors_keep_state_for_syntax_errors_and_unsendable_values(pool):
    pool.run("kept = 7")
    with pytest.raises(dh.RankRaised, match="SyntaxError"):
        pool.run("x = (")
    with pytest.raises(dh.RankRaised, match="cannot be sent back to the notebook"):
        pool.run("import threading\nthreading.Lock()")
    assert pool.get("kept") == [7, 7]


def test_without_a_group_the_learner_calls_init_process_group():
    with dh.Ranks(2, group=False, output="none") as pool:
        assert pool.run("dist.is_initialized()") == [False, False]
        pool.run("dist.init_process_group('gloo', init_method='env://', rank=rank, "
                 "world_size=world_size)")
        pool.run("t = torch.tensor([1.0 + rank])\ndist.all_reduce(t)")
        assert pool.run("t.item()") == [3.0, 3.0]
    assert not wait_no_rank_processes()


@pytest.mark.parametrize("kwargs, match", [
    ({"nprocs": 0}, "at least 1 rank"), ({"nprocs": "2"}, "as an int"),
    ({"timeout": 0}, "above 0"), ({"backend": "tcp"}, "unknown backend"),
    ({"output": "loud"}, "output='loud'")])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, match, no_leftovers):
    with pytest.raises(dh.LaunchRefused, match=match):
        dh.Ranks(**kwargs)


@pytest.mark.parametrize("targets", [[2], [-1], [], [0.5]])
def test_targets_out_of_range_are_refused(pool, targets):
    with pytest.raises(dh.LaunchRefused, match="give ranks from 0 to 1"):
        pool.run("1", targets=targets)


def test_stopped_ranks_refuse_cells_until_restarted(pool):
    pool.stop()
    with pytest.raises(dh.LaunchRefused, match=r"restart\(\)"):
        pool.run("1")
    pool.restart()
    assert pool.run("rank") == [0, 1]


def test_status_names_pids_device_and_cells(pool):
    pool.run("1")
    status = pool.status()
    assert status.cells_run == 1 and status.running
    assert [r.alive for r in status.ranks] == [True, True]
    assert {r.device for r in status.ranks} == {"cpu"} and {r.backend for r in status.ranks} == {
        "gloo"}
    assert "rank 1: alive, pid" in str(status)


def test_two_hundred_cells_leave_no_growth(pool):
    for _ in range(10):
        pool.run("t = torch.ones(4)\ndist.all_reduce(t)\nt.sum().item()")
    me = psutil.Process()
    before = (me.num_fds(), me.num_threads(), len(me.children(recursive=True)))
    for _ in range(200):
        assert pool.run("t = torch.ones(4)\ndist.all_reduce(t)\nt.sum().item()") == [8.0, 8.0]
    after = (me.num_fds(), me.num_threads(), len(me.children(recursive=True)))
    assert after == before, f"(fds, threads, processes) grew from {before} to {after}"


PARENT = textwrap.dedent("""
    import os, sys, time
    import ddp_helpers as dh
    if __name__ == "__main__":
        pool = dh.Ranks(2, output="none")
        print(" ".join(str(r.pid) for r in pool.status().ranks), flush=True)
        pool.run("import time") and None
        os.kill(os.getpid(), 9)  # the kernel dies without cleaning up
""")


def test_ranks_die_with_their_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=os.getcwd())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "ranks outlived their parent"


def test_cells_given_the_same_label_keep_their_own_source(pool):
    """A batch runner (nbval) may give every cell the same In [N]: each cell still has its own
    source for tracebacks and inspect (a check reads a learner's function that way)."""
    pool.run("def f():\n    return 1\n", label="In [1]", first_line=2)
    pool.run("x = 2", label="In [1]", first_line=2)
    assert pool.run("import inspect\ninspect.getsource(f)")[0].strip().endswith("return 1")
    with pytest.raises(dh.RankRaised) as e:
        pool.run("x = 3\nraise ValueError('named')", label="In [1]", first_line=2)
    assert 'File "<cell In [1]>", line 3' in str(e.value)
