"""dh.launch: results, environment, output relay, failures, timeouts, clean-up, warm relaunch."""

import importlib
import os
import signal
import sys
import textwrap
import threading
import time

import pytest
import rank_fns
from conftest import rank_processes, wait_no_rank_processes

import ddp_helpers as dh
from ddp_helpers.engine.words.failures import timeout_error
from ddp_helpers.engine.words.tracebacks import main_thread_stack

# A launch that must hang: long enough for both ranks to start and print on a loaded machine.
HANG_TIMEOUT = 15


def test_results_come_back_in_rank_order(no_leftovers):
    assert dh.launch(rank_fns.rank_times_ten, nprocs=3, timeout=60) == [0, 10, 20]


def test_all_reduce_over_gloo(no_leftovers):
    assert dh.launch(rank_fns.all_reduce_sum, args=(2,), nprocs=2, timeout=60) == [3.0, 3.0]


def test_rendezvous_variables_set_for_ranks_not_for_caller(no_leftovers):
    before = dict(os.environ)
    first = dh.launch(rank_fns.rendezvous_env, nprocs=2, timeout=60)
    second = dh.launch(rank_fns.rendezvous_env, nprocs=2, timeout=60)
    assert dict(os.environ) == before
    assert [e["RANK"] for e in first] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in first] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in first} == {"2"}
    assert {e["MASTER_ADDR"] for e in first} == {"127.0.0.1"}
    assert int(first[0]["MASTER_PORT"]) > 0
    assert first[0]["MASTER_PORT"] == first[1]["MASTER_PORT"]
    assert int(second[0]["MASTER_PORT"]) > 0  # (the kernel may hand the same free port back)


def test_output_relayed_with_rank_prefix_including_fd_writes(capsys, no_leftovers):
    dh.launch(rank_fns.talk, nprocs=2, timeout=60)
    out, err = capsys.readouterr()
    for r in (0, 1):
        assert f"[rank {r}] python stdout {r}" in out
        assert f"[rank {r}] fd-level stdout {r}" in out
        assert f"[rank {r}] python stderr {r}" in err


def test_a_callable_output_receives_each_line_with_rank_and_stream(capsys, no_leftovers):
    lines = []
    dh.launch(rank_fns.talk, nprocs=2, timeout=60, output=lambda *a: lines.append(a))
    assert (0, "stdout", "python stdout 0") in lines
    assert (1, "stderr", "python stderr 1") in lines
    assert capsys.readouterr().out == ""  # nothing printed: the sink had every line


def test_by_rank_output_is_grouped_rank_zero_first(capsys, no_leftovers):
    dh.launch(rank_fns.talk, nprocs=2, timeout=60, output="by_rank")
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert [line[:8] for line in lines] == ["[rank 0]"] * 2 + ["[rank 1]"] * 2


@pytest.mark.parametrize("fn, match", [
    (lambda rank: rank, "lambda"),
    (None, "inside another function"),
])
def test_refuses_functions_ranks_cannot_import(fn, match):
    if fn is None:
        def nested(rank):
            return rank
        fn = nested
    with pytest.raises(dh.LaunchRefused, match=match) as info:
        dh.launch(fn, nprocs=2, timeout=10)
    assert "%%writefile" in str(info.value)


def test_refuses_a_function_defined_in_main():
    namespace = {"__name__": "__main__"}
    exec("def work(rank):\n    return rank\n", namespace)
    with pytest.raises(dh.LaunchRefused, match=r"defined in the notebook \(module __main__\)"):
        dh.launch(namespace["work"], nprocs=2, timeout=10)


@pytest.mark.parametrize("nprocs, match", [(0, "at least 1 rank"), (-2, "at least 1 rank"),
                                           (10**6, "more than this machine can hold"),
                                           (2.0, "as an int")])
def test_refuses_bad_nprocs(nprocs, match):
    with pytest.raises(dh.LaunchRefused, match=match):
        dh.launch(rank_fns.rank_times_ten, nprocs=nprocs, timeout=10)


@pytest.mark.parametrize("timeout", [0, -1])
def test_refuses_timeout_of_zero_or_less(timeout):
    with pytest.raises(dh.LaunchRefused, match="above 0"):
        dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=timeout)


def test_refuses_unpicklable_argument_and_names_it():
    with pytest.raises(dh.LaunchRefused, match=r"args\[1\] \(a lock\) cannot be pickled"):
        dh.launch(rank_fns.rank_times_ten, args=(1, threading.Lock()), nprocs=2, timeout=10)


def test_refuses_fork_and_names_the_hazard():
    with pytest.raises(dh.LaunchRefused, match="fork.*deadlock or crash"):
        dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=10, start_method="fork")


def test_rank_that_raises_is_named_and_others_stopped(no_leftovers):
    with pytest.raises(dh.RankRaised, match=r"rank 1 of 2 raised ValueError: boom on purpose") as e:
        dh.launch(rank_fns.raise_on_rank_one, args=(2,), nprocs=2, timeout=120)
    assert e.value.rank == 1 and e.value.exc_type == "ValueError"
    assert 'raise ValueError("boom on purpose")' in e.value.traceback_text
    assert isinstance(e.value, dh.LaunchError)
    # rank 0 sat in a barrier forever: waiting for it would have ended in LaunchTimeout, so a
    # RankRaised with rank 0 unfinished means it was stopped (no wall clock needed to tell)
    assert e.value.finished == []


def test_rank_that_calls_os_exit_is_named_with_its_code(no_leftovers):
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 exited with code 3") as e:
        dh.launch(rank_fns.exit_on_rank_one, args=(3,), nprocs=2, timeout=60)
    assert e.value.exitcode == 3 and e.value.rank == 1


def test_rank_killed_by_sigkill_is_named_with_the_signal(no_leftovers):
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 was killed by signal SIGKILL") as e:
        dh.launch(rank_fns.sigkill_rank_one, nprocs=2, timeout=60)
    assert e.value.signal_name == "SIGKILL"
    assert "about to be killed" in str(e.value)  # its last line of output


def test_timeout_names_unfinished_ranks_and_their_last_lines(no_leftovers):
    with pytest.raises(dh.LaunchTimeout, match=r"rank\(s\) 0, 1 of 2 had not finished") as e:
        dh.launch(rank_fns.rank_one_skips_barrier, args=(2,), nprocs=2, timeout=HANG_TIMEOUT)
    assert e.value.last_lines[0] == "rank 0 waiting in the barrier"
    assert e.value.last_lines[1] == "rank 1 sleeping instead of the barrier"


def test_a_peer_abort_does_not_hide_the_rank_that_was_killed(no_leftovers):
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 was killed by signal SIGKILL"):
        dh.launch(rank_fns.abort_after_peer_killed, args=(2,), nprocs=2, timeout=60)


def test_an_abort_alone_is_reported(no_leftovers):
    with pytest.raises(dh.RankDied, match=r"rank 1 of 2 was killed by signal SIGABRT"):
        dh.launch(rank_fns.abort_alone, args=(2,), nprocs=2, timeout=60)


def test_timeout_shows_where_each_rank_was(no_leftovers):
    with pytest.raises(dh.LaunchTimeout) as e:
        dh.launch(rank_fns.rank_one_skips_barrier, args=(2,), nprocs=2, timeout=HANG_TIMEOUT)
    stacks = e.value.stacks
    assert "in rank_one_skips_barrier" in stacks[0] and "inside torch: barrier" in stacks[0]
    assert "in rank_one_skips_barrier" in stacks[1] and "inside torch" not in stacks[1]
    assert "Where each rank was when it was stopped" in str(e.value)
    assert "engine/rank/entry.py" not in str(e.value)  # the kit's plumbing is left out


# faulthandler's dump of a rank that hung after its function returned, while freeing the DDP
# model that held a destroyed gloo group (seen on torch 2.9.1): no frame below rank_entry.
RETURNED_DUMP = """Thread 0x00007f701b7fe6c0 (most recent call first):
  <no Python frame>

Thread 0x00007f70307ff6c0 (most recent call first):
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 395 in _recv
  File "/kit/ddp_helpers/engine/rank/entry.py", line 116 in watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f714148ab80 (most recent call first):
  File "/kit/ddp_helpers/engine/rank/entry.py", line 82 in rank_entry
  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/spawn.py", line 95 in _wrap
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


def test_a_rank_stuck_after_its_function_returned_is_said_so():
    where = main_thread_stack(RETURNED_DUMP)
    assert "its function had returned" in where and "freeing" in where
    text = str(timeout_error([1], 2, {1: "epoch 1 step 10/10"}, stacks={1: RETURNED_DUMP}))
    assert "Where each rank was" in text and "its function had returned" in text
    assert main_thread_stack("") == ""  # no dump at all: nothing to say


def test_ranks_that_returned_but_did_not_exit_are_named_with_their_results(no_leftovers):
    with pytest.raises(dh.LaunchTimeout) as info:
        dh.launch(rank_fns.returns_but_leaves_a_thread, nprocs=2, timeout=5, output="none")
    text = str(info.value)
    assert "rank(s) 0, 1 of 2 had not finished" in text, text
    assert "had returned a value but their process did not exit" in text, text
    assert info.value.results == [0, 10]


def test_a_fixed_master_port_can_be_used_again_right_after_a_run(no_leftovers):
    port = dh.free_port()
    for _ in range(2):  # the first run's connections leave the port in TIME_WAIT
        assert dh.launch(rank_fns.all_reduce_sum, args=(2,), nprocs=2, timeout=60,
                         master_port=port) == [3.0, 3.0]


@pytest.mark.parametrize("port", [70000, 0, "29500", True])
def test_refuses_a_master_port_that_is_no_port(port):
    with pytest.raises(dh.LaunchRefused, match=r"give a port number from 1 to 65535"):
        dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=10, master_port=port)


def test_results_of_finished_ranks_survive_a_failure(tmp_path, no_leftovers):
    with pytest.raises(dh.RankRaised, match="KeyError") as e:
        dh.launch(rank_fns.finish_then_other_raises, args=(str(tmp_path / "rank0.pid"),),
                  nprocs=2, timeout=60)
    assert e.value.finished == [0]
    assert e.value.results[0] == "rank 0 finished"


def test_unpicklable_return_value_is_reported(no_leftovers):
    # Both ranks return a lambda; which one is reported first depends on timing.
    with pytest.raises(dh.RankRaised, match="rank [01] of 2 raised"):
        dh.launch(rank_fns.returns_unpicklable, nprocs=2, timeout=60)


def test_keyboard_interrupt_stops_every_rank():
    main = threading.main_thread().ident
    timer = threading.Timer(2.0, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        dh.launch(rank_fns.sleep_forever, nprocs=2, timeout=120)
    timer.cancel()
    assert wait_no_rank_processes(3.0) == []
    assert dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=60) == [0, 10]


def test_twenty_launches_leave_no_process_behind(no_leftovers):
    dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=60)  # starts the forkserver
    for _ in range(20):
        assert dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=60) == [0, 10]
    assert wait_no_rank_processes() == []
    assert rank_processes() == []


def test_next_launch_works_after_each_failure(no_leftovers):
    for fn, args, err in [(rank_fns.raise_on_rank_one, (2,), dh.RankRaised),
                          (rank_fns.exit_on_rank_one, (3,), dh.RankDied)]:
        with pytest.raises(err):
            dh.launch(fn, args=args, nprocs=2, timeout=60)
        assert dh.launch(rank_fns.all_reduce_sum, args=(2,), nprocs=2, timeout=60) == [3.0, 3.0]


def test_edited_module_is_picked_up_by_the_next_launch(tmp_path, monkeypatch, no_leftovers):
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "edited_by_learner.py"
    source.write_text("def answer(rank):\n    return 'first'\n")
    module = importlib.import_module("edited_by_learner")
    assert dh.launch(module.answer, nprocs=2, timeout=60) == ["first", "first"]
    source.write_text(textwrap.dedent("""\
        def answer(rank):
            return 'second, edited'
    """))
    os.utime(source, (time.time() + 5, time.time() + 5))  # a new mtime even within one second
    module = importlib.reload(module)
    assert dh.launch(module.answer, nprocs=2, timeout=60) == ["second, edited"] * 2
    sys.modules.pop("edited_by_learner", None)


def test_process_group_is_destroyed_on_error(no_leftovers):
    assert dh.launch(rank_fns.group_destroyed_after_error, args=(2,), nprocs=2,
                     timeout=60) == [False, False]


def test_backend_forced_through_launch(no_leftovers):
    assert dh.launch(rank_fns.backend_seen, args=(2,), nprocs=2, timeout=60,
                     backend="gloo") == ["gloo", "gloo"]


def test_spawn_start_method_still_works(no_leftovers):
    assert dh.launch(rank_fns.rank_times_ten, nprocs=2, timeout=120,
                     start_method="spawn") == [0, 10]


def test_refuses_a_closure_and_a_method_of_a_notebook_class():
    def make(offset):
        def closure(rank):
            return rank + offset
        return closure

    with pytest.raises(dh.LaunchRefused, match="nested function or closure"):
        dh.launch(make(1), nprocs=2, timeout=10)
    namespace = {"__name__": "__main__"}
    exec("class Trainer:\n    def step(self, rank):\n        return rank\n", namespace)
    with pytest.raises(dh.LaunchRefused, match=r"Trainer.step is defined in the notebook"):
        dh.launch(namespace["Trainer"]().step, nprocs=2, timeout=10)


def test_refuses_an_argument_whose_class_lives_in_the_notebook(monkeypatch):
    namespace = {"__name__": "__main__"}
    exec("class Config:\n    lr = 0.1\n", namespace)
    monkeypatch.setattr(sys.modules["__main__"], "Config", namespace["Config"], raising=False)
    with pytest.raises(dh.LaunchRefused, match=r"args\[0\] \(a Config\) refers to __main__.Config"):
        dh.launch(rank_fns.rank_times_ten, args=(namespace["Config"](),), nprocs=2, timeout=10)


def test_refuses_an_unknown_backend_before_starting():
    with pytest.raises(dh.LaunchRefused, match=r"unknown backend 'ncl'.*Nothing was started"):
        dh.launch(rank_fns.backend_seen, args=(2,), nprocs=2, timeout=10, backend="ncl")


def test_ranks_die_with_a_killed_kernel(tmp_path):
    """A kernel killed outright (no clean-up code runs) takes its ranks with it."""
    import subprocess

    import psutil

    script = ("import ddp_helpers as dh, rank_fns\n"
              "dh.launch(rank_fns.print_pid_then_sleep, nprocs=2, timeout=600)\n")
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(rank_fns.__file__))
    guard = threading.Timer(120, kernel.kill)  # ranks that never print: readline sees EOF
    guard.start()
    pids = []
    try:
        while len(pids) < 2:
            line = kernel.stdout.readline()
            assert line, "the launching process ended before its ranks started"
            if "pid " in line:
                pids.append(int(line.rsplit("pid ", 1)[1]))
    finally:
        guard.cancel()
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert alive == [], f"ranks {alive} outlived their killed parent"


def test_env_reaches_the_ranks_including_torch_distributed_debug(monkeypatch, no_leftovers):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    before = dict(os.environ)
    levels = dh.launch(rank_fns.debug_level, nprocs=2, timeout=60,
                       env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert all(level.endswith("DETAIL") for level in levels), levels
    assert dict(os.environ) == before  # the ranks' environment only, not the caller's


def test_ranks_get_the_callers_start_method_and_local_world_size(no_leftovers):
    import multiprocessing

    expected = multiprocessing.get_start_method()
    assert dh.launch(rank_fns.start_method_and_local_world, nprocs=2,
                     timeout=60) == [(expected, "2")] * 2


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_spawned_ranks_start_with_env_so_import_time_variables_work(no_leftovers):
    before = dict(os.environ)
    assert dh.launch(rank_fns.env_at_process_start, nprocs=2, timeout=120, start_method="spawn",
                     env={"DH_TEST_AT_START": "1"}) == [True, True]
    assert dict(os.environ) == before
