"""The errors `launch` and `Ranks` raise, and the text they carry: each says what happened, on
which rank, and what to do next.

The text of these errors is built here, from what the supervisor observed (a rank's Error
reply, an exit code, the last lines it printed), so the supervisor only observes and this module
only words. (Refusals of bad input are worded where they are checked, in options.py and magic.py.)
"""

from __future__ import annotations

import signal

from .protocol import Error
from .tracebacks import clean_error_text, clean_traceback, main_thread_stack


class LaunchError(Exception):
    """Base class of every error `ddp_helpers.launch` and `ddp_helpers.Ranks` raise.

    `results[r]` holds what rank r returned before the run failed, for every r in `finished`
    (None elsewhere), so work done by ranks that completed is never lost.
    """

    rank: int | None = None

    def __init__(self, message: str, *, rank: int | None = None, results: list | None = None,
                 finished: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.results = results if results is not None else []
        self.finished = finished if finished is not None else []

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback through the kit's own frames: the
        # message already names the rank and carries the rank's own traceback.
        return [f"{type(self).__name__}: {self}"]


class CellInterrupted(KeyboardInterrupt):
    """The stop button (KeyboardInterrupt) during a cell: every rank was stopped. Shown as its
    one sentence: the kit's frames the interrupt passed through are not the learner's."""

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

    @classmethod
    def from_error(cls, rank: int, nprocs: int, error: Error, *,
                   consequence: str = "The other ranks were stopped.",
                   results: list | None = None, finished: list[int] | None = None
                   ) -> RankRaised:
        """Word a rank's Error reply."""
        exc_type, message, tb = error.type, error.message, error.traceback
        text = (f"rank {rank} of {nprocs} raised {exc_type}: {clean_error_text(message)}\n"
                f"{consequence} The rank's traceback:\n{clean_traceback(tb)}"
                + hint(exc_type, message) + finished_note(finished))
        return cls(text, rank=rank, exc_type=exc_type, exc_message=message, traceback_text=tb,
                   results=results, finished=finished)


class RankDied(LaunchError):
    """A rank exited without raising: os._exit, a signal (SIGKILL, SIGSEGV), or sys.exit."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None, signal_name: str | None,
                 **kw):
        super().__init__(message, rank=rank, **kw)
        self.exitcode = exitcode
        self.signal_name = signal_name

    @classmethod
    def from_exit(cls, rank: int, nprocs: int, exitcode: int, last_line: str, *,
                  consequence: str = "The other ranks were stopped.",
                  results: list | None = None, finished: list[int] | None = None) -> RankDied:
        """Word a rank's exit code (negative: killed by that signal)."""
        signame = None
        if exitcode < 0:
            signame = (signal.Signals(-exitcode).name if -exitcode in signal.valid_signals()
                       else str(-exitcode))
            how = f"was killed by signal {signame}"
            why = {"SIGKILL": " (killed from outside, or by the kernel's out-of-memory killer)",
                   "SIGSEGV": " (a crash in C/C++ code: a segmentation fault)"}.get(signame, "")
        else:
            how = f"exited with code {exitcode} without returning a result"
            why = " (os._exit or sys.exit in the rank's code?)"
        text = (f"rank {rank} of {nprocs} {how}{why}. {consequence}"
                + (f"\nIts last line of output: {last_line}" if last_line else "")
                + finished_note(finished))
        return cls(text, rank=rank, exitcode=exitcode, signal_name=signame, results=results,
                   finished=finished)


class LaunchTimeout(LaunchError, TimeoutError):
    """Not every rank finished in time; names the ranks still running and their last lines."""

    def __init__(self, message: str, *, unfinished: list[int], last_lines: dict[int, str],
                 stacks: dict[int, str] | None = None, **kw):
        super().__init__(message, rank=unfinished[0] if unfinished else None, **kw)
        self.unfinished = unfinished
        self.last_lines = last_lines
        self.stacks = stacks or {}  # rank -> its main thread's Python stack when it was stopped

    @classmethod
    def from_unfinished(cls, unfinished: list[int], nprocs: int, last_lines: dict[int, str], *,
                        what: str = "", consequence: str = "Every rank was stopped.",
                        stacks: dict[int, str] | None = None, results: list | None = None,
                        finished: list[int] | None = None, in_cell: bool = False
                        ) -> LaunchTimeout:
        """Word a timeout: which ranks had not finished, the last line each printed (`in_cell`:
        only lines of this cell count, and none printed says nothing), and,
        given faulthandler dumps in `stacks`, where each one's main thread was."""
        lines = "\n".join(f"  rank {r}: {last_lines.get(r) or '(printed nothing)'}"
                          for r in unfinished)
        printed = f" Last line each printed{' in this cell' if in_cell else ''}:\n{lines}\n"
        if in_cell and not any(last_lines.get(r) for r in unfinished):
            printed = "\n"
        short = {r: main_thread_stack(t) for r, t in (stacks or {}).items()}
        text = (f"timeout{what}: rank(s) {', '.join(map(str, unfinished))} of {nprocs} had not "
                f"finished. {consequence}{printed}"
                + _stacks_text(short) +
                "A rank waiting forever is usually in a collective or barrier another rank never "
                "reached. If the work is just slow, give it longer: --timeout S on the %%ranks or "
                "%ranks start line, timeout= in Python." + finished_note(finished))
        return cls(text, unfinished=unfinished, last_lines=last_lines, stacks=short,
                   results=results, finished=finished)

    @classmethod
    def from_stall(cls, waiting: list[int], idle: list[int], nprocs: int, seconds: float,
                   consequence: str) -> LaunchTimeout:
        """Word a stall: ranks waiting in a collective that the other ranks never called."""
        text = (f"stalled: rank(s) {', '.join(map(str, waiting))} of {nprocs} waited {seconds:g} s "
                f"in a collective while rank(s) {', '.join(map(str, idle))} had finished the cell "
                "or were not asked to run it. A collective completes only when every rank of its "
                f"group calls it, so this one never would. {consequence}")
        return cls(text, unfinished=waiting, last_lines={})


class CollectiveMismatch(LaunchTimeout):
    """The ranks' collectives do not match (found in their ledgers): names what differs, side
    by side. A LaunchTimeout, since the ranks would otherwise have waited out the timeout."""

    def __init__(self, message: str, *, finding, unfinished: list[int], **kw):
        super().__init__(message, unfinished=unfinished, last_lines={}, **kw)
        self.finding = finding  # mismatch.Finding: kind, the two ranks, their calls

    @classmethod
    def from_finding(cls, finding, explanation: str, unfinished: list[int],
                     consequence: str, **kw) -> CollectiveMismatch:
        """Word a mismatch: the explanation (mismatch.explain) and what was done about it."""
        return cls(f"{explanation}\n{consequence}" + finished_note(kw.get("finished")),
                   finding=finding, unfinished=unfinished, **kw)


def _stacks_text(stacks: dict[int, str]) -> str:
    if not any(stacks.values()):
        return ""
    parts = [f"rank {r}:\n{text or '  (no stack: the rank did not answer)'}"
             for r, text in sorted(stacks.items())]
    return ("Where each rank was when it was stopped (its Python stack, most recent call last; "
            "on a cluster, `py-spy dump --pid <pid>` shows the same for a live process):\n"
            + "\n".join(parts) + "\n")


_HINTS = [
    (("clients joined", "waiting for clients"),
     "Rank 0's rendezvous store waited for ranks that never arrived: a rank did not call "
     "init_process_group (or returned or failed before it), or used another MASTER_PORT."),
    (("timed out", "timeout"),
     "A collective or barrier timed out: another rank never called the matching collective (a "
     "desync) or was stuck. Rerun with env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'} to have torch "
     "check that every rank calls the same collectives, or use dist.monitored_barrier to name "
     "the rank that did not arrive."),
]

def hint(exc_type: str, message: str) -> str:
    """A "What to do" line for errors whose usual cause is known, else ""."""
    text = f"{exc_type} {message}".lower()
    for needles, advice in _HINTS:
        if any(n in text for n in needles):
            return "\nWhat to do: " + advice
    return ""


def finished_note(done: list[int] | None) -> str:
    """Where the results of ranks that finished before the failure are."""
    if not done:
        return ""
    return (f"\nRanks {', '.join(map(str, done))} had finished: their return values are in this "
            "error's .results.")

