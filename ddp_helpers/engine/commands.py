"""The `%ranks` and `%%ranks` commands and their options, declared once: the parsers, the usage
line a refusal ends with and the help `%ranks?` shows are all built from COMMANDS below, and
each parsed value is checked by options.py, as the Python API's are.
"""

from __future__ import annotations

import argparse
import shlex
import textwrap
from dataclasses import dataclass, field

from .options import OUTPUT_MODES
from .words.errors import LaunchRefused


@dataclass(frozen=True)
class Option:
    """One option of a command: its flag, what it takes, what it does."""

    flag: str
    help: str
    metavar: str = ""  # what it takes ("S", "0,1"); "" for a switch
    default: object = None
    choices: tuple = ()
    repeat: bool = False  # may be given several times (a list)
    number: type | None = None  # float or int: parsed as one

    @property
    def dest(self) -> str:
        return {"--no-group": "group", "--return": "returns"}.get(
            self.flag, self.flag.lstrip("-").replace("-", "_"))


@dataclass(frozen=True)
class Command:
    """One subcommand (`%ranks start`, ...) or the cell magic ("cell")."""

    usage: str  # how it is written, e.g. "%ranks start N"
    help: str
    options: tuple[Option, ...] = ()
    takes: str = ""  # what follows it: "count" (N ranks), "rank" (an optional R), "names"
    examples: tuple[str, ...] = field(default_factory=tuple)


_BACKEND = Option("--backend", "the process group's backend (auto: NCCL when every rank has a "
                  "GPU)", "auto|gloo|nccl", default="auto")
_TIMEOUT = Option("--timeout", "seconds one cell may take, and the group's collective timeout",
                  "S", default=60.0, number=float)
_OUTPUT = Option("--output", "how the ranks' prints are shown (live: as they come)",
                 "live|by_rank|none", default="live", choices=OUTPUT_MODES)

COMMANDS: dict[str, Command] = {
    "start": Command("%ranks start N", "start N ranks (each with a process group), e.g. "
                     "%ranks start 2", takes="count", options=(
                         _BACKEND, _TIMEOUT,
                         Option("--no-group", "start the ranks without a process group",
                                default=True),
                         _OUTPUT,
                         Option("--env", "an environment variable for the ranks (repeatable)",
                                "NAME=VALUE", default=(), repeat=True))),
    "status": Command("%ranks status", "what each rank is doing (pid, device, state)"),
    "restart": Command("%ranks restart", "fresh ranks, same options (after a failure, or to "
                       "start over)"),
    "stop": Command("%ranks stop", "stop every rank"),
    "listen": Command("%ranks listen N", "wait for N ranks that torchrun/srun starts "
                      "elsewhere; prints the command lines to paste", takes="count", options=(
                          Option("--host", "the address to listen on (loopback unless said)",
                                 "H", default="127.0.0.1"),
                          Option("--port", "the port (0: a free one)", "P", default=0,
                                 number=int),
                          Option("--nodes", "how many nodes the printed lines start", "K",
                                 default=1, number=int),
                          _TIMEOUT, _BACKEND, _OUTPUT,
                          Option("--token-file", "keep the token in this file (mode 0600)",
                                 "PATH"))),
    "debug": Command("%ranks debug [R]", "pdb post-mortem on rank R's last failing cell (R: the "
                     "rank that failed first); after the kit stopped the ranks, R's stack and "
                     "variables then", takes="rank", options=(
                         Option("--commands", "pdb commands to run, separated by ;; (instead "
                                "of typing them)", "'p x;; up'"),)),
    "where": Command("%ranks where", "every rank's stack, each frame's variables summarised "
                     "(after a stop: as they were then)"),
    "compare": Command("%ranks compare NAME [NAME ...]", "each value on every rank (tensors, "
                       "modules, optimizers, numbers, lists): dtype, shape, a digest, the same "
                       "or not, and the first element that differs", takes="names"),
    "cell": Command("%%ranks", "run the cell on the ranks; `rank`, `world_size`, `device`, "
                    "`torch`, `dist`, `nn` are defined", options=(
                        Option("--targets", "only these ranks (a collective then needs all of "
                               "its group)", "0,1"),
                        Option("--timeout", "seconds this cell may take (default: the pool's)",
                               "S", number=float),
                        Option("--output", "this cell's output mode", "live|by_rank|none",
                               choices=OUTPUT_MODES),
                        Option("--return", "bring these variables back, as a list per name "
                               "(rank order)", "NAME[,NAME]", default=""),
                        Option("--ledger", "then print the cell's collectives, one column per "
                               "rank", default=False))),
}

_EXAMPLE = """Example:
    %load_ext ddp_helpers
    %ranks start 2
    %%ranks
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                          # shown per rank, as "[rank r] Out: ..."
"""


def _line(left: str, text: str) -> str:
    """`left` in a column of 29, then `text` wrapped to 96 characters a line."""
    lines = textwrap.wrap(text, 96 - 29)
    first = f"{left:<29}" if len(left) < 28 else f"{left}\n{'':<29}"
    return first + f"\n{'':<29}".join(lines)


def help_text() -> str:
    """What `%ranks?`, `%ranks --help` and `%%ranks --help` show."""
    out = ["Persistent ranks in a notebook: start them once, then run cells on every rank.", ""]
    for cmd in COMMANDS.values():
        out.append(_line(cmd.usage + (" [options]" if cmd.options else ""), cmd.help))
        out += [_line(f"    {o.flag} {o.metavar}".rstrip(), o.help) for o in cmd.options]
    out.append(_line("%ranks --help", "this text (also %ranks? and %%ranks?)"))
    return "\n".join(out) + "\n\n" + _EXAMPLE


def usage(name: str) -> str:
    """The sentence a refusal of `name`'s line ends with: its options, and the other commands."""
    cmd = COMMANDS[name]
    flags = ", ".join(o.flag for o in cmd.options)
    if name == "cell":
        return (f"%%ranks takes {flags}, e.g. `%%ranks --targets 0 --timeout 30`.")
    others = ", ".join(f"`{c.usage}`" for n, c in COMMANDS.items() if n not in (name, "cell"))
    return (f"Use `{cmd.usage}`" + (f" (options {flags})" if flags else "")
            + f"; the others: {others}; `%%ranks` cells run on the ranks.")


class _Parser(argparse.ArgumentParser):
    """argparse that raises LaunchRefused (a clear message, nothing run) instead of exiting."""

    def __init__(self, name: str):
        super().__init__(prog=COMMANDS[name].usage.split(" [")[0].split(" N")[0],
                         add_help=False)
        self.command = name

    def error(self, message: str):
        raise LaunchRefused(f"{self.prog}: {message}. {usage(self.command)} `%ranks --help` "
                            "shows every option. Nothing was run.")


def parse(name: str, words: list[str]) -> argparse.Namespace:
    """The options of command `name` from the words after it (a count first, where it takes
    one); refused with the command's usage."""
    cmd = COMMANDS[name]
    p = _Parser(name)
    if cmd.takes == "count":
        p.add_argument("nprocs", nargs="?", default=None)
    elif cmd.takes == "rank":
        p.add_argument("rank", nargs="?", default=None)
    elif cmd.takes == "names":
        p.add_argument("names", nargs="*")
    for o in cmd.options:
        if not o.metavar:
            p.add_argument(o.flag, dest=o.dest, action="store_false" if o.default else
                           "store_true")
        elif o.repeat:
            p.add_argument(o.flag, dest=o.dest, action="append", default=list(o.default),
                           metavar=o.metavar)
        else:
            p.add_argument(o.flag, dest=o.dest, default=o.default, metavar=o.metavar,
                           choices=o.choices or None, type=o.number)
    args = p.parse_args(words)
    if cmd.takes == "count":
        args.nprocs = _count(name, args.nprocs)
    elif cmd.takes == "rank" and args.rank is not None:
        args.rank = _rank(name, args.rank)
    elif cmd.takes == "names" and not args.names:
        raise LaunchRefused(f"%ranks {name}: name what to compare, e.g. `%ranks {name} model x`.")
    return args


def _rank(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise LaunchRefused(f"%ranks {name} {text}: give a rank number, e.g. "
                            f"`%ranks {name} 1`.") from None


def split(line: str) -> list[str]:
    """A magic's line as words, comments dropped."""
    return shlex.split(line, comments=True)


def wants_help(line: str) -> bool:
    return bool(set(split(line)) & {"--help", "-h", "help"})


def _count(name: str, text: str | None) -> int:
    if text is None:
        raise LaunchRefused(f"%ranks {name}: say how many ranks, e.g. `%ranks {name} 2`.")
    try:
        return int(text)
    except ValueError:
        raise LaunchRefused(f"%ranks {name} {text}: the number of ranks is a whole number, "
                            f"e.g. `%ranks {name} 2`.") from None


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """--env NAME=VALUE ... as a dict."""
    bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        raise LaunchRefused(f"%ranks start --env {bad[0]}: write NAME=VALUE, e.g. "
                            "--env TORCH_DISTRIBUTED_DEBUG=DETAIL.")
    return dict(p.split("=", 1) for p in pairs)


def rank_list(text: str | None) -> list[int] | None:
    """--targets 0,1 as a list of ranks (None: every rank)."""
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise LaunchRefused(f"%%ranks --targets {text}: give rank numbers separated by commas, "
                            "e.g. --targets 0,1.") from None


def names(text: str) -> tuple[str, ...]:
    """--return a,b as names (checked, with the Python API's, by options.check_returns)."""
    return tuple(n for n in text.split(",") if n)
