"""The command line: `python -m ddp_helpers {hello,mnist} ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ddp_helpers` and the `ddp-helpers` command."""
    parser = argparse.ArgumentParser(prog="python -m ddp_helpers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    hello = sub.add_parser("hello", help="start ranks that all-reduce and print per rank")
    hello.add_argument("--nprocs", type=int, default=2)
    hello.add_argument("--backend", default="auto")
    sub.add_parser("mnist", help="the seed's MNIST exercise (see python -m ddp_helpers.mnist -h)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "mnist":
        from .mnist import main as mnist_main

        return mnist_main(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    from .hello import run

    return run(args.nprocs, args.backend)


if __name__ == "__main__":
    sys.exit(main())
