"""The `%ranks` and `%%ranks` IPython magics: a thin layer on `Ranks` for notebooks.

    %load_ext ddp_helpers
    %ranks start 2 [--backend gloo] [--timeout 60] [--no-group] [--output by_rank]
                   [--env NAME=VALUE ...]
    %ranks status | stop | restart

    %%ranks [--targets 0,1] [--timeout S] [--output live|by_rank|none] [--return NAME[,NAME]]
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                      # shown per rank, as "[rank r] Out: ..."
"""

from __future__ import annotations

import argparse
import shlex

from .errors import LaunchRefused
from .options import OUTPUT_MODES, check_pool, check_targets
from .ranks import Ranks, current

_USAGE = ("Use `%ranks start 2` (options --backend, --timeout, --no-group, --output, --env), then "
          "`%%ranks` cells; `%ranks status`, `%ranks restart`, `%ranks stop`.")


class _Parser(argparse.ArgumentParser):
    """argparse that raises LaunchRefused (a clear message, nothing run) instead of exiting."""

    def error(self, message: str):
        raise LaunchRefused(f"{self.prog}: {message}. {_USAGE} Nothing was run.")


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
    return p


def ranks_line(line: str) -> object:
    """%ranks start N | stop | restart | status."""
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
    elif args.action == "restart":
        pool.restart()
    else:
        return pool.status()
    return None


def ranks_cell(line: str, cell: str, user_ns: dict, label: str | None = None) -> None:
    """%%ranks: run the cell on the ranks, show each rank's value, bring --return names back.
    `label` ("In [5]") names the cell in messages; its lines count from the %%ranks line."""
    args = _cell_parser().parse_args(shlex.split(line, comments=True))
    pool = current()
    if pool is None:
        raise LaunchRefused(f"%%ranks: no ranks are running. Start them first with "
                            f"`%ranks start 2` (after `%load_ext ddp_helpers`). {_USAGE}")
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


def load_ipython_extension(ipython) -> None:
    """Register %ranks / %%ranks (called by `%load_ext ddp_helpers`)."""

    def ranks(line: str, cell: str | None = None):
        if cell is None:
            return ranks_line(line)
        # IPython numbers the cell it runs by execution_count: the "In [5]" the learner sees.
        return ranks_cell(line, cell, ipython.user_ns, f"In [{ipython.execution_count}]")

    ipython.register_magic_function(ranks, magic_kind="line_cell", magic_name="ranks")
