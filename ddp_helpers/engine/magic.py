"""The `%ranks` and `%%ranks` IPython magics: a thin layer on `Ranks` for notebooks
(`HELP` below is what `%ranks?` and `%ranks --help` show).

    %load_ext ddp_helpers
    %ranks start 2 [--backend gloo] [--timeout 60] [--no-group] [--output by_rank]
                   [--env NAME=VALUE ...]
    %ranks status | stop | restart

    %%ranks [--targets 0,1] [--timeout S] [--output live|by_rank|none] [--return NAME[,NAME]]
            [--ledger]
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                      # shown per rank, as "[rank r] Out: ..."
"""

from __future__ import annotations

import argparse
import shlex

from .errors import LaunchRefused
from .ledger_table import ledger_table
from .options import OUTPUT_MODES, check_pool, check_targets
from .ranks import Ranks, current, start_command

_USAGE = ("Use `%ranks start 2` (options --backend, --timeout, --no-group, --output, --env), then "
          "`%%ranks` cells; `%ranks status`, `%ranks restart`, `%ranks stop`.")
_CELL_USAGE = ("%%ranks takes --targets 0,1, --timeout S, --output live|by_rank|none, "
               "--return NAME[,NAME] and --ledger, e.g. `%%ranks --targets 0 --timeout 30`.")

HELP = """Persistent ranks in a notebook: start them once, then run cells on every rank.

%ranks start N [options]     start N ranks (each with a process group), e.g. %ranks start 2
    --backend auto|gloo|nccl   the process group's backend (auto: NCCL when every rank has a GPU)
    --timeout S                seconds one cell may take, and the group's collective timeout (60)
    --no-group                 start the ranks without a process group
    --output live|by_rank|none how the ranks' prints are shown (live: as they come)
    --env NAME=VALUE           an environment variable for the ranks (repeatable)
%ranks status                what each rank is doing (pid, device, state)
%ranks restart               fresh ranks, same options (after a failure, or to start over)
%ranks stop                  stop every rank
%ranks listen N [options]    wait for N ranks that torchrun/srun starts elsewhere; prints the
                             command line to paste (options --host, --port, --nodes, --timeout,
                             --backend, --token-file)
%ranks --help                this text (also %ranks? and %%ranks?)

%%ranks [options]            run the cell on the ranks; `rank`, `world_size`, `device`, `torch`
    --targets 0,1              only these ranks (a collective then needs all of its group)
    --timeout S                seconds this cell may take (default: the pool's)
    --output live|by_rank|none this cell's output mode
    --return NAME[,NAME]       bring these variables back, as a list per name (rank order)
    --ledger                   then print the cell's collectives, one column per rank

Example:
    %load_ext ddp_helpers
    %ranks start 2
    %%ranks
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                          # shown per rank, as "[rank r] Out: ..."
"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises LaunchRefused (a clear message, nothing run) instead of exiting;
    the message lists the options of the magic that was used."""

    def error(self, message: str):
        usage = _CELL_USAGE if self.prog == "%%ranks" else _USAGE
        raise LaunchRefused(f"{self.prog}: {message}. {usage} `%ranks --help` shows every "
                            "option. Nothing was run.")


def _wants_help(line: str) -> bool:
    return bool(set(shlex.split(line, comments=True)) & {"--help", "-h", "help"})


def _start_parser() -> _Parser:
    p = _Parser(prog="%ranks", add_help=False)
    p.add_argument("action", choices=["start", "stop", "restart", "status"])
    p.add_argument("nprocs", nargs="?", default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--no-group", dest="group", action="store_false")
    p.add_argument("--output", choices=OUTPUT_MODES, default="live")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    return p


def _cell_parser() -> _Parser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("--targets", default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--output", choices=OUTPUT_MODES, default=None)
    p.add_argument("--return", dest="returns", default="")
    p.add_argument("--ledger", action="store_true")
    return p


def ranks_line(line: str) -> object:
    """%ranks start N | stop | restart | status | listen N | --help."""
    if _wants_help(line):
        print(HELP)
        return None
    if line.split()[:1] == ["listen"]:  # ranks that torchrun starts: listen_magic.py
        from .listen_magic import listen_line

        return listen_line(line)
    args = _start_parser().parse_args(shlex.split(line, comments=True))
    pool = current()
    if args.action == "start":
        n = _nprocs(args.nprocs)
        env = _env(args.env)
        check_pool(n, args.backend, args.timeout, args.output, env)  # before stopping any
        if pool is not None and pool.running:
            pool.stop()  # re-running a notebook from the top starts afresh
        Ranks(n, backend=args.backend, timeout=args.timeout, group=args.group,
              output=args.output, env=env)
        return None
    if pool is None:
        raise LaunchRefused(f"%ranks {args.action}: no ranks were started. {_USAGE}")
    if args.action == "stop":
        pool.stop()
        print(f"ddp_helpers: the {pool.nprocs} ranks were stopped. To use them again (the "
              f"exercises' %%ranks cells need them), run {start_command()}.")
    elif args.action == "restart":
        pool.restart()
    else:
        return pool.status()
    return None


def ranks_cell(line: str, cell: str, user_ns: dict, label: str | None = None) -> None:
    """%%ranks: run the cell on the ranks, show each rank's value, bring --return names back.
    `label` ("In [5]") names the cell in messages; its lines count from the %%ranks line."""
    if _wants_help(line):
        print(HELP)
        return None
    args = _cell_parser().parse_args(shlex.split(line, comments=True))
    pool = current()
    if pool is None:
        raise LaunchRefused(f"%%ranks: no ranks are running. Start them first with "
                            f"{start_command()} (after `%load_ext ddp_helpers`). {_USAGE}")
    targets = _targets(args.targets)
    names = [n for n in args.returns.split(",") if n]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise LaunchRefused(f"%%ranks --return {args.returns}: {bad[0]!r} is not a variable "
                            "name; give names separated by commas, e.g. --return loss,grads.")
    replies = pool.run(cell, targets=targets, timeout=args.timeout, output=args.output,
                       returns=tuple(names), label=label, first_line=2)
    for rank, reply in zip(check_targets(targets, pool.nprocs), replies):
        if reply.value is not None:
            _show(rank, reply.value)
    for name in names:
        user_ns[name] = [reply.returned[name] for reply in replies]
    if args.ledger:
        print(ledger_table(pool.collectives(), check_targets(targets, pool.nprocs),
                           f"Collectives of {label or 'this cell'}", pool.place))


def _show(rank: int, value) -> None:
    text = repr(value).replace("\n", "\n" + " " * len(f"[rank {rank}] Out: "))
    print(f"[rank {rank}] Out: {text}")


def _nprocs(text: str | None) -> int:
    if text is None:
        raise LaunchRefused("%ranks start: say how many ranks, e.g. `%ranks start 2`.")
    try:
        return int(text)
    except ValueError:
        raise LaunchRefused(f"%ranks start {text}: the number of ranks is a whole number, "
                            "e.g. `%ranks start 2`.") from None


def _env(pairs: list[str]) -> dict[str, str]:
    bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        raise LaunchRefused(f"%ranks start --env {bad[0]}: write NAME=VALUE, e.g. "
                            "--env TORCH_DISTRIBUTED_DEBUG=DETAIL.")
    return dict(p.split("=", 1) for p in pairs)


def _targets(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise LaunchRefused(f"%%ranks --targets {text}: give rank numbers separated by commas, "
                            "e.g. --targets 0,1.") from None


def prompt_number(ipython) -> int:
    """The number the running cell's prompt shows (`In [5]`, the execute_input count).
    IPython 9 has already counted the next cell by the time this one runs
    (`execution_count` is 6 inside `In [5]`); IPython 8 counts after it. The display hook's
    prompt_count is the prompt's number in both."""
    return ipython.displayhook.prompt_count


def load_ipython_extension(ipython) -> None:
    """Register %ranks / %%ranks (called by `%load_ext ddp_helpers`)."""

    def ranks(line: str, cell: str | None = None):
        if cell is None:
            return ranks_line(line)
        return ranks_cell(line, cell, ipython.user_ns, f"In [{prompt_number(ipython)}]")

    ranks.__doc__ = HELP  # what `%ranks?` and `%%ranks?` show
    ipython.register_magic_function(ranks, magic_kind="line_cell", magic_name="ranks")
