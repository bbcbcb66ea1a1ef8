"""%ranks / %%ranks in a real IPython shell, on real gloo ranks."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

import ddp_helpers as dh
from ddp_helpers.engine import ranks as ranks_module


@pytest.fixture
def shell(no_leftovers):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ddp_helpers")
    yield ip
    pool = ranks_module.current()
    if pool is not None:
        pool.stop()
    ranks_module.forget_current()


def run(ip, source):
    """Run a cell; return its error (or None) without printing IPython's traceback."""
    result = ip.run_cell(source, silent=True)
    return result.error_in_exec or result.error_before_exec


def test_a_cell_runs_on_every_rank_and_shows_each_value(shell, capsys):
    assert run(shell, "%ranks start 2 --output by_rank") is None
    assert run(shell, "%%ranks\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt") is None
    out = capsys.readouterr().out
    assert "[rank 0] process group: gloo on cpu, 2 ranks" in out
    assert "[rank 0] Out: tensor([3.])\n[rank 1] Out: tensor([3.])" in out


def test_return_brings_a_variable_back_as_a_rank_ordered_list(shell):
    run(shell, "%ranks start 2 --output none")
    assert run(shell, "%%ranks --return w,rank\nw = [rank] * 3") is None
    assert shell.user_ns["w"] == [[0, 0, 0], [1, 1, 1]]
    assert shell.user_ns["rank"] == [0, 1]


def test_a_comment_after_the_options_is_a_comment(shell):
    assert run(shell, "%ranks start 2 --output none   # two ranks, quiet") is None
    assert run(shell, "%%ranks --return w   # back as a list\nw = rank") is None
    assert shell.user_ns["w"] == [0, 1]


def test_targets_and_by_rank_output(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    assert run(shell, "%%ranks --targets 1 --output by_rank\nprint('only me')") is None
    out = capsys.readouterr().out
    assert "[rank 1] only me" in out and "[rank 0] only me" not in out


def test_targets_in_any_order_label_each_value_with_its_own_rank(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    assert run(shell, "%%ranks --targets 1,0,1\nrank * 100") is None
    out = capsys.readouterr().out
    assert "[rank 0] Out: 0\n[rank 1] Out: 100" in out, out


def test_a_bad_start_line_leaves_the_running_ranks_alone(shell):
    run(shell, "%ranks start 2 --output none")
    run(shell, "%%ranks\nkept = rank")
    for line in ("%ranks start 0", "%ranks start 2 --timeout 0", "%ranks start 2 --env X"):
        assert isinstance(run(shell, line), dh.LaunchRefused)
    assert ranks_module.current().running
    assert run(shell, "%%ranks --return kept\nkept") is None and shell.user_ns["kept"] == [0, 1]


def test_start_with_env_sets_it_for_the_ranks_only(shell):
    run(shell, "%ranks start 2 --output none --env TORCH_DISTRIBUTED_DEBUG=DETAIL --env X=a=b")
    assert run(shell, "%%ranks --return v\nimport os\nv = (os.environ['X'], "
                      "str(dist.get_debug_level()))") is None
    assert shell.user_ns["v"] == [("a=b", "DebugLevel.DETAIL")] * 2
    assert "X" not in __import__("os").environ


def test_status_stop_and_restart(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    run(shell, "s = %ranks status")
    assert "2 ranks running, 0 cells run" in str(shell.user_ns["s"])
    run(shell, "%ranks stop")
    err = run(shell, "%%ranks\n1")
    assert isinstance(err, dh.LaunchRefused) and "restart" in str(err)
    assert run(shell, "%ranks restart") is None
    assert run(shell, "%%ranks --return r\nr = rank") is None and shell.user_ns["r"] == [0, 1]


def test_a_failed_cell_keeps_the_kernel_and_the_next_cell_gets_a_fresh_group(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    err = run(shell, "%%ranks\nt = torch.ones(1)\nif rank == 1:\n    raise ValueError('x')\n"
                     "dist.all_reduce(t)")
    assert isinstance(err, dh.RankRaised) and "Every rank was stopped" in str(err)
    assert err._render_traceback_()[0].startswith("RankRaised: rank 1 of 2 raised ValueError")
    assert run(shell, "%%ranks --return r\nr = rank") is None
    assert "starting 2 fresh ranks" in capsys.readouterr().out


@pytest.mark.parametrize("cell, match", [
    ("%%ranks --bogus\n1", "unrecognized arguments: --bogus"),
    ("%%ranks --targets 5\n1", "give ranks from 0 to 1"),
    ("%%ranks --targets a\n1", "rank numbers separated by commas"),
    ("%%ranks --return 1x\n1", "is not a variable name"),
])
def test_bad_cell_options_are_refused_before_anything_runs(shell, cell, match):
    run(shell, "%ranks start 2 --output none")
    err = run(shell, cell)
    assert isinstance(err, dh.LaunchRefused) and match in str(err), err
    assert ranks_module.current().cells_run == 0


@pytest.mark.parametrize("line, match", [
    ("%ranks start", "say how many ranks"), ("%ranks start two", "whole number"),
    ("%ranks start 0", "at least 1 rank"), ("%ranks start 100000", "more than this machine"),
    ("%ranks launch 2", "invalid choice"), ("%ranks start 2 --env X", "write NAME=VALUE"),
])
def test_bad_start_lines_are_refused(shell, line, match):
    err = run(shell, line)
    assert isinstance(err, dh.LaunchRefused) and match in str(err), err


def test_a_ranks_cell_before_start_says_how_to_start(shell):
    ranks_module.forget_current()
    err = run(shell, "%%ranks\n1")
    assert isinstance(err, dh.LaunchRefused) and "%ranks start 2" in str(err)


def test_help_lists_every_subcommand_and_option(shell, capsys):
    from ddp_helpers.engine.magic import HELP

    for line in ("%ranks --help", "%ranks help", "%%ranks --help\nprint('not run')"):
        assert run(shell, line) is None
        assert capsys.readouterr().out.strip() == HELP.strip()
    for word in ("start", "status", "restart", "stop", "listen", "--backend", "--timeout",
                 "--no-group", "--output", "--env", "--targets", "--return", "Example", "debug",
                 "where", "compare", "--commands"):
        assert word in HELP, word
    assert ranks_module.current() is None  # help starts nothing


def test_ranks_question_mark_shows_the_usage(shell):
    info = shell.object_inspect("%ranks")
    assert "%ranks start N" in (info.get("docstring") or "")


def test_a_wrong_cell_option_names_the_cell_magics_options(shell):
    run(shell, "%ranks start 2 --output none")
    error = run(shell, "%%ranks --backend gloo\n1")
    assert isinstance(error, dh.LaunchRefused)
    assert "%%ranks takes --targets" in str(error) and "--no-group" not in str(error)


def test_ledger_prints_the_cells_collectives_one_column_per_rank(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    assert run(shell, "%%ranks --ledger\nt = torch.ones(4)\ndist.all_reduce(t)\n"
                      "if rank == 0:\n    dist.send(t.double(), dst=1)\n"
                      "else:\n    dist.recv(t.double(), src=0)\ndist.barrier()") is None
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("Collectives of ")]
    assert head, out
    table = lines[head[0]:]
    assert table[1].split() == ["rank", "0", "rank", "1"], out
    assert table[2].split()[:5] == ["1", "all_reduce", "#1", "float32[4]", "(line"], out
    assert "send #2 float64[4] to rank 1 (line 5)" in table[3], out
    assert "recv #2 float64[4] from rank 0 (line 7)" in table[3], out
    assert "barrier #3 (line 8)" in table[4], out
    assert table[5].strip() == "rank 0: 3 calls, 48 B; rank 1: 3 calls, 48 B", out


def test_ledger_of_a_cell_without_collectives_says_so(shell, capsys):
    run(shell, "%ranks start 2 --output none")
    assert run(shell, "%%ranks --ledger\nx = rank") is None
    assert "no collective or send/recv was called" in capsys.readouterr().out


def test_no_live_view_outside_a_jupyter_kernel(shell):
    from ddp_helpers.engine.live_view import display_factory

    assert display_factory() is None  # a terminal IPython has no display ids to update
