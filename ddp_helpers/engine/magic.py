"""The `%ranks` and `%%ranks` IPython magics: a thin layer on `Ranks` for notebooks. Their
commands and options are declared in commands.py (what `%ranks?` shows); every value is
checked by options.py before anything starts or runs.

    %load_ext ddp_helpers
    %ranks start 2 [--backend gloo] [--timeout 60] [--no-group] [--output by_rank]
    %%ranks [--targets 0,1] [--timeout S] [--output live|by_rank|none] [--return NAME[,NAME]]
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    t                      # shown per rank, as "[rank r] Out: ..."
"""

from __future__ import annotations

from . import commands, ranks
from .options import check_pool, check_targets
from .ranks import Ranks, current, start_command
from .words.errors import LaunchRefused
from .words.tables import ledger_table

HELP = commands.help_text()


def ranks_line(line: str) -> object:
    """%ranks start N | stop | restart | status | listen N | debug [R] | where | compare NAME
    ... | --help."""
    if commands.wants_help(line):
        print(HELP)
        return None
    words = commands.split(line)
    name = words[0] if words else ""
    if name not in commands.COMMANDS or name == "cell":
        choices = ", ".join(n for n in commands.COMMANDS if n != "cell")
        raise LaunchRefused(f"%ranks: invalid choice: {name!r} (choose from {choices}). "
                            f"{commands.usage('start')} `%ranks --help` shows every option.")
    args = commands.parse(name, words[1:])
    if name == "start":
        return _start(args)
    if name == "listen":
        return _listen(args)
    pool = current()
    if pool is None:
        raise LaunchRefused(f"%ranks {name}: no ranks were started. {commands.usage('start')}")
    if name == "debug":
        commands_ = args.commands.split(";;") if args.commands else None
        pool.debug(args.rank, [c.strip() for c in commands_] if commands_ else None)
    elif name == "where":
        return pool.where()
    elif name == "compare":
        return pool.compare(*args.names)
    elif name == "stop":
        pool.stop()
        print(f"ddp_helpers: the {pool.nprocs} ranks were stopped. To use them again, run "
              f"{start_command()}.")
    elif name == "restart":
        pool.restart()
    else:
        return pool.status()
    return None


def _start(args) -> None:
    env = commands.env_pairs(args.env)
    check_pool(args.nprocs, args.backend, args.timeout, args.output, env)  # before stopping any
    pool = current()
    if pool is not None and pool.running:
        pool.stop()  # re-running a notebook from the top starts afresh
    Ranks(args.nprocs, backend=args.backend, timeout=args.timeout, group=args.group,
          output=args.output, env=env)


def _listen(args) -> Ranks:
    """Stop the running pool, listen for new ranks, and print how to start them; return the
    pool (`pool = %ranks listen 4` keeps it for pool.address, pool.token_file)."""
    check_pool(args.nprocs, args.backend, args.timeout, args.output, {})
    old = current()
    # A served pool waiting for torchrun's restart is not running, but still listens: stop it.
    if old is not None and (old.running or old.start_method == "torchrun"):
        old.stop()
    pool = Ranks.listen(args.nprocs, args.host, args.port, args.timeout, backend=args.backend,
                        output=args.output, token_file=args.token_file)
    ranks.make_current(pool)
    lines = pool.command_lines(args.nodes)
    print(f"listening on {pool.address} for {args.nprocs} ranks (token in {pool.token_file}).\n"
          f"Start them with torchrun (on each of the {args.nodes} node(s)):\n"
          f"  {lines['torchrun']}\nor inside a Slurm allocation:\n  {lines['srun']}\n"
          + _loopback_note(pool, args.nodes) +
          "The next %%ranks cell waits until every rank is connected.")
    return pool


def _loopback_note(pool: Ranks, nodes: int) -> str:
    """Lines with a loopback address work on this machine only: say so where that matters."""
    if nodes == 1 or not pool.address.startswith(("127.", "localhost", "[::1]", "::1")):
        return ""
    return ("These lines reach the notebook at a loopback address, so they work on this "
            "machine only (two torchrun \"nodes\" here, as lesson 08 runs them). For other "
            "machines, listen on an address they can reach: `%ranks listen N --host 0.0.0.0` "
            "and give --connect this machine's name; HEAD_NODE:29500 is torchrun's "
            "--rdzv-endpoint, the same on every node: one node's name (its c10d store runs "
            "there; the Slurm line takes the first) and any free port.\n")


def ranks_cell(line: str, cell: str, user_ns: dict, label: str | None = None) -> None:
    """%%ranks: run the cell on the ranks, show each rank's value, bring --return names back.
    `label` ("In [5]") names the cell in messages; its lines count from the %%ranks line."""
    if commands.wants_help(line):
        print(HELP)
        return None
    args = commands.parse("cell", commands.split(line))
    pool = current()
    if pool is None:
        raise LaunchRefused(f"%%ranks: no ranks are running. Start them first with "
                            f"{start_command()} (after `%load_ext ddp_helpers`). "
                            f"{commands.usage('start')}")
    targets = commands.rank_list(args.targets)
    names = commands.names(args.returns)
    replies = pool.run(cell, targets=targets, timeout=args.timeout, output=args.output,
                       returns=names, label=label, first_line=2)
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


def prompt_number(ipython) -> int:
    """The number the running cell's prompt shows (`In [5]`, the execute_input count).
    IPython 9 has already counted the next cell by the time this one runs
    (`execution_count` is 6 inside `In [5]`); IPython 8 counts after it. The display hook's
    prompt_count is the prompt's number in both."""
    return ipython.displayhook.prompt_count


def load_ipython_extension(ipython) -> None:
    """Register %ranks / %%ranks (called by `%load_ext ddp_helpers`)."""

    def ranks_magic(line: str, cell: str | None = None):
        if cell is None:
            return ranks_line(line)
        return ranks_cell(line, cell, ipython.user_ns, f"In [{prompt_number(ipython)}]")

    ranks_magic.__doc__ = HELP  # what `%ranks?` and `%%ranks?` show
    ipython.register_magic_function(ranks_magic, magic_kind="line_cell", magic_name="ranks")
