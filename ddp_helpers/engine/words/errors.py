"""The errors `launch` and `Ranks` raise. Each carries what the kit observed (which rank, its
exception or exit, where the ranks were); its text is worded in words.failures, from the
evidence of the wait, so that every failure is worded in one place."""

from __future__ import annotations


class LaunchError(Exception):
    """Base class of every error `ddp_helpers.launch` and `ddp_helpers.Ranks` raise.

    `results[r]` holds what rank r returned before the run failed, for every r in `finished`
    (None elsewhere), so work done by ranks that completed is never lost.

    `where[rank]` is each rank's stack (with its locals summarised) when the kit stopped the
    ranks, for an error that stopped them (words.stacks.Snapshot; empty otherwise).
    """

    rank: int | None = None

    def __init__(self, message: str, *, rank: int | None = None, results: list | None = None,
                 finished: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.results = results if results is not None else []
        self.finished = finished if finished is not None else []
        self.where: dict = {}

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback through the kit's own frames: the
        # message already names the rank and carries the rank's own traceback.
        return [f"{type(self).__name__}: {self}"]


class CellInterrupted(KeyboardInterrupt):
    """The stop button (KeyboardInterrupt) during a cell: every rank was stopped. Shown as its
    one sentence: the kit's frames the interrupt passed through are not the learner's.
    `where` holds each rank's stack when they were stopped."""

    where: dict = {}  # noqa: RUF012 - set per instance by the pool

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


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
    """A rank exited without raising: os._exit, a signal (SIGKILL, SIGSEGV), sys.exit, or (a
    served rank) its connection closed; `exitcode` is None where the kit cannot know it."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None, signal_name: str | None,
                 **kw):
        super().__init__(message, rank=rank, **kw)
        self.exitcode = exitcode
        self.signal_name = signal_name


class LaunchTimeout(LaunchError, TimeoutError):
    """Not every rank finished in time; names the ranks still running and their last lines."""

    def __init__(self, message: str, *, unfinished: list[int], last_lines: dict[int, str],
                 stacks: dict[int, str] | None = None, **kw):
        super().__init__(message, rank=unfinished[0] if unfinished else None, **kw)
        self.unfinished = unfinished
        self.last_lines = last_lines
        self.stacks = stacks or {}  # rank -> its main thread's Python stack when it was stopped


class CollectiveMismatch(LaunchTimeout):
    """The ranks' collectives do not match (found in their ledgers): names what differs, side
    by side. A LaunchTimeout, since the ranks would otherwise have waited out the timeout."""

    def __init__(self, message: str, *, finding, unfinished: list[int], **kw):
        super().__init__(message, unfinished=unfinished, last_lines={}, **kw)
        self.finding = finding  # rules.mismatch.Finding: kind, the two ranks, their calls
