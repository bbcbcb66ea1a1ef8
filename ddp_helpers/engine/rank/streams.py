"""A rank's standard streams: fds 1 and 2 pointed at what the parent reads (pipes the kit made,
or pipes a served rank forwards over its socket), so that C++ output comes too."""

from __future__ import annotations

import ctypes
import sys


def reopen_std_streams() -> None:
    """Python's stdout and stderr as line-buffered writers on fds 1 and 2 (after a dup2)."""
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def flush() -> None:
    """Push out what Python and C stdio still buffer, so it reaches the parent before the
    reply does (C++ code printing through printf is block-buffered on a pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
