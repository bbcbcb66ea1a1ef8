"""`%ranks listen N [--host H] [--port P] [--nodes K] [--timeout S] [--backend B]
[--token-file PATH]`: listen for
N ranks that torchrun (or srun) starts, print the command lines to paste, and make the pool
the one `%%ranks` uses; the next `%%ranks` cell waits until every rank is in."""

from __future__ import annotations

import argparse
import shlex

from . import ranks
from .errors import LaunchRefused
from .served import ServedRanks

_USAGE = ("Use `%ranks listen 4` (options --host, --port, --nodes, --timeout, --backend), then "
          "start the printed torchrun line; `%%ranks` cells wait for the ranks.")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise LaunchRefused(f"%ranks listen: {message}. {_USAGE} Nothing was started.")


def _parser() -> _Parser:
    p = _Parser(prog="%ranks listen", add_help=False)
    p.add_argument("action", choices=["listen"])
    p.add_argument("nprocs", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--token-file", default=None)
    return p


def listen_line(line: str) -> ServedRanks:
    """Stop the running pool, listen for new ranks, and print how to start them; return the
    pool (`pool = %ranks listen 4` keeps it for pool.address, pool.token_file)."""
    args = _parser().parse_args(shlex.split(line, comments=True))
    old = ranks.current()
    # A served pool waiting for torchrun's restart is not running, but still listens: stop it.
    if old is not None and (old.running or isinstance(old, ServedRanks)):
        old.stop()
    pool = ServedRanks(args.nprocs, args.host, args.port, args.timeout, backend=args.backend,
                       token_file=args.token_file)
    ranks._current = pool
    lines = pool.command_lines(args.nodes)
    print(f"listening on {pool.address} for {args.nprocs} ranks (token in {pool.token_file}).\n"
          f"Start them with torchrun (on each of the {args.nodes} node(s)):\n"
          f"  {lines['torchrun']}\nor inside a Slurm allocation:\n  {lines['srun']}\n"
          "The next %%ranks cell waits until every rank is connected.")
    return pool
