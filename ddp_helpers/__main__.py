"""The command line: `python -m ddp_helpers mnist ...`, as `python -m ddp_helpers.mnist`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ddp_helpers` and the `ddp-helpers` command."""
    parser = argparse.ArgumentParser(prog="python -m ddp_helpers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("mnist", help="the seed's MNIST exercise (see python -m ddp_helpers.mnist -h)",
                   add_help=False)
    _, rest = parser.parse_known_args(argv)
    from .mnist import main as mnist_main

    return mnist_main(rest)


if __name__ == "__main__":
    sys.exit(main())
