"""The engine: start ranks, supervise them, relay their output, talk to them, and stop them, for
one-shot launches (`launch`) and persistent ranks (`Ranks`, the `%%ranks` magics) alike.

What the rest of the kit may use is re-exported here; the modules below are the engine's own.
Lessons and plots reach the engine only through the public API (`import ddp_helpers as dh`), and
the engine never imports a lesson (tests/test_boundaries.py holds both rules).
"""

from .errors import (
    CollectiveMismatch,
    LaunchError,
    LaunchRefused,
    LaunchTimeout,
    RankDied,
    RankRaised,
)
from .launch import launch
from .magic import load_ipython_extension
from .ranks import Ranks, current, start_command  # noqa: F401 - for exercises: the pool %%ranks uses
from .served_rank import main as serve_main  # noqa: F401 - python -m ddp_helpers.serve
from .start import free_port
from .supervisor import looks_like_peer_failure
from .tracebacks import clean_error_text, clean_traceback

# What ddp_helpers re-exports as public API (`current`, the pool the magics use, stays the kit's).
__all__ = [
    "CollectiveMismatch", "LaunchError", "LaunchRefused", "LaunchTimeout", "RankDied",
    "RankRaised", "Ranks", "clean_error_text", "clean_traceback", "free_port", "launch",
    "load_ipython_extension", "looks_like_peer_failure",
]
