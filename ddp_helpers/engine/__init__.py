"""The engine: start ranks, supervise them, relay their output, talk to them, and stop them, for
one-shot launches (`launch`) and persistent ranks (`Ranks`, the `%%ranks` magics) alike.

What the rest of the kit may use is re-exported here; the modules below are the engine's own.
Lessons and plots reach the engine only through the public API (`import ddp_helpers as dh`), and
the engine never imports a lesson (tests/test_boundaries.py holds both rules).
"""

from .errors import LaunchError, LaunchRefused, LaunchTimeout, RankDied, RankRaised
from .launch import free_port, launch
from .magic import load_ipython_extension
from .ranks import Ranks, current
from .tracebacks import clean_error_text, clean_traceback

__all__ = [
    "LaunchError", "LaunchRefused", "LaunchTimeout", "RankDied", "RankRaised", "Ranks",
    "clean_error_text", "clean_traceback", "current", "free_port", "launch",
    "load_ipython_extension",
]
