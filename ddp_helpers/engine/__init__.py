"""The engine: start ranks, supervise them, relay their output, talk to them, and stop them, for
one-shot launches (`launch`) and persistent ranks (`Ranks`, the `%%ranks` magics) alike.

Rooms, from the bottom up (each imports only rooms below it; tests/test_boundaries.py holds it):
    wire/    what crosses between the parent and a rank: messages, the channel, the ledger
             line, the served rank's handshake (auth); imports nothing of the kit
    rank/    what runs inside a rank: a forked rank's entry, the cell server, its link (pipes
             or a socket), where its main thread is, `python -m ddp_helpers.serve`
    sets/    the parent's side of a set of ranks, one seam (base.RankSet) and two kinds:
             forked over pipes, attached over sockets (the listener lets them in)
    rules/   when to stop waiting: the wait loop, the stall rule, the mismatch in the ledgers
    words/   every sentence about a failure (failures.py), the errors, cell names, tracebacks
    front:   launch.py, ranks.py (+ starters.py), magic.py (+ commands.py), options.py
What the rest of the kit may use is re-exported here.
"""

from .launch import launch
from .magic import load_ipython_extension
from .rank.serve import main as serve_main  # noqa: F401 - python -m ddp_helpers.serve
from .ranks import (  # noqa: F401 - for exercises: the pool %%ranks uses
    Ranks,
    current,
    make_current,
    start_command,
)
from .sets.base import looks_like_peer_failure
from .sets.census import rank_descendants, wait_for_no_descendants  # noqa: F401 - for bench/
from .sets.start import free_port
from .words.errors import (
    CollectiveMismatch,
    LaunchError,
    LaunchRefused,
    LaunchTimeout,
    RankDied,
    RankRaised,
)
from .words.tracebacks import clean_error_text, clean_traceback

# What ddp_helpers re-exports as public API (`current`, the pool the magics use, stays the kit's).
__all__ = [
    "CollectiveMismatch", "LaunchError", "LaunchRefused", "LaunchTimeout", "RankDied",
    "RankRaised", "Ranks", "clean_error_text", "clean_traceback", "free_port", "launch",
    "load_ipython_extension", "looks_like_peer_failure",
]
