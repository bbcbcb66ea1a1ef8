"""The errors `launch` raises: each says what happened, on which rank, and what to do next."""

from __future__ import annotations


class LaunchError(Exception):
    """Base class of every error `ddp_helpers.launch` raises.

    `results[r]` holds what rank r returned before the launch failed, for every r in `finished`
    (None elsewhere), so work done by ranks that completed is never lost.
    """

    rank: int | None = None

    def __init__(self, message: str, *, rank: int | None = None, results: list | None = None,
                 finished: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.results = results if results is not None else []
        self.finished = finished if finished is not None else []


class LaunchRefused(LaunchError, ValueError):
    """Bad input found before any process was started."""


class RankRaised(LaunchError):
    """A rank raised an exception; carries its type, message and traceback text."""

    def __init__(self, message: str, *, rank: int, exc_type: str, exc_message: str,
                 traceback_text: str, **kw):
        super().__init__(message, rank=rank, **kw)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback_text = traceback_text


class RankDied(LaunchError):
    """A rank exited without raising: os._exit, a signal (SIGKILL, SIGSEGV), or sys.exit."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None, signal_name: str | None,
                 **kw):
        super().__init__(message, rank=rank, **kw)
        self.exitcode = exitcode
        self.signal_name = signal_name


class LaunchTimeout(LaunchError, TimeoutError):
    """Not every rank finished in time; names the ranks still running and their last lines."""

    def __init__(self, message: str, *, unfinished: list[int], last_lines: dict[int, str],
                 **kw):
        super().__init__(message, rank=unfinished[0] if unfinished else None, **kw)
        self.unfinished = unfinished
        self.last_lines = last_lines
