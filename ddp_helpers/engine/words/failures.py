"""Every failure of a run, worded once: `error(evidence, run)` turns what a wait saw
(rules.wait.Evidence) into the one error the learner reads, for `launch` and for both kinds of
pool, and `stopped` is the one sentence that says every rank was stopped and what comes next.

Each message says what happened, on which rank, and what to do next. A mismatch that explains
the failure wins over the failure itself (gloo's abort, and its knock-on errors, are not the
cause); a rank's own error or death is its own cause.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ..rules.wait import STALL_SECONDS, Evidence, Outcome
from ..wire.messages import Error, Where
from .errors import (
    CellInterrupted,
    CollectiveMismatch,
    LaunchError,
    LaunchTimeout,
    RankDied,
    RankRaised,
)
from .mismatch import explain
from .places import plain_place
from .tracebacks import clean_error_text, clean_traceback, main_thread_stack


class Next(enum.Enum):
    """What follows once the kit stopped every rank."""

    LAUNCH_OVER = "launch"  # a one-shot run: nothing more to do
    FRESH_GROUP = "fresh"  # the pool starts fresh ranks at the next cell
    TORCHRUN_RESTARTS = "restarts"  # served ranks exited, torchrun starts a fresh group
    SERVED_ENDED = "ended"  # served ranks exited, their torchrun agents ended


@dataclass(frozen=True)
class Stopped:
    """What the kit did after a failure: it stopped every rank, because of `reason`."""

    reason: str
    next: Next
    restarts_left: int = 0  # TORCHRUN_RESTARTS: the fewest restarts any node's agent has left


@dataclass
class Run:
    """What the words need to know about the run that failed, besides the evidence."""

    kind: str  # "launch", "cell" (a pool's cell or push) or "start" (a pool starting)
    stopped: Stopped | None = None  # None: nothing was stopped (a cell whose ranks keep state)
    place: Callable[[tuple[str, int]], str] = plain_place
    name_cells: Callable[[str], str] = lambda text: text  # a traceback's cells, as named
    where: Callable[[Where], str] = lambda info: ""  # a rank's place in its cell
    who: Callable[[int], str] | None = None  # a served rank: host, node, local rank, pid
    timeout: float | None = None
    results: list | None = None  # launch: each rank's return value (None where none)


def stop_reason(ev: Evidence, host: Callable[[int], str] | None = None) -> str:
    """Why every rank was stopped, as the parenthesis of stopped() says it (`host`: a served
    rank's host, by rank)."""
    if ev.finding is not None:
        return "the collectives did not match"
    if ev.outcome is Outcome.TIMEOUT:
        return "the cell ran past its timeout"
    if ev.outcome is Outcome.STALLED:
        return "a collective could not complete"
    if ev.outcome is Outcome.INTERRUPTED:
        return "the cell was interrupted"
    f = ev.failure
    if f is not None and not f.raised:
        on = f" on {host(f.rank)}" if host else ""
        return f"rank {f.rank}{on} died, and a group cannot go on without a rank"
    return (f"rank {f.rank} failed while the others waited for it" if f is not None
            else "a rank failed")


# The kit takes every live rank's stack and variables before it stops them (Ranks._snapshot).
KEPT = " (what each held when stopped: `%ranks debug R`)"


def stopped(s: Stopped, where: str = "") -> str:
    """The sentence: every rank was stopped (why), where each was, what is gone, what next."""
    head = f"Every rank was stopped ({s.reason}){where}"
    if s.next is Next.LAUNCH_OVER:
        return head + "."
    if s.next is Next.FRESH_GROUP:
        return head + f". Their variables are gone{KEPT}; the next cell starts a fresh group."
    closed = (": the notebook closed the connections of the ranks still running, so each of "
              "them exited (code 3)")
    if s.next is Next.TORCHRUN_RESTARTS:
        return (head + closed + ", and torchrun restarts the workers (each node's agent has at "
                f"least {s.restarts_left} of its --max-restarts left). Their variables are "
                f"gone{KEPT}; the next cell runs on the fresh group.")
    return (head + closed + f", and every torchrun agent ended. Their variables are gone{KEPT}; "
            "`%ranks listen N` and start the torchrun jobs again for a fresh group.")


def where_text(ev: Evidence, run: Run) -> str:
    """"; rank 0 was in all_reduce, at In [5], line 4: ...; rank 1 had exited" for the
    ranks that had not finished."""
    parts = []
    for rank in ev.unfinished:
        if rank in ev.exitcodes:
            parts.append(f"rank {rank} had exited")
        elif rank not in ev.where:
            continue
        elif ev.where[rank] is None:
            parts.append(f"rank {rank} did not answer (blocked in C++ code)")
        elif ev.where[rank].frame is not None:
            info = ev.where[rank]
            call = f"in {info.call}, " if info.call else ""
            parts.append(f"rank {rank} was {call}at {run.where(info)}")
    return "; " + "; ".join(parts) if parts else ""


def error(ev: Evidence, run: Run) -> LaunchError | KeyboardInterrupt:
    """The error to raise for a run that failed."""
    if run.kind == "launch":
        return _launch_error(ev, run)
    n, f = ev.nprocs, ev.failure
    if run.stopped is None:  # a cell that raised on some ranks while the others finished it
        return _raised(ev, run, f.rank, f.error, _state_kept(ev, f.rank))
    if ev.finding is not None:
        text = explain(ev.finding, n, run.place, ev.at, exitcodes=ev.exitcodes)
        return CollectiveMismatch(f"{text}\n{stopped(run.stopped)}", finding=ev.finding,
                                  unfinished=ev.unfinished)
    consequence = stopped(run.stopped, where_text(ev, run))
    if ev.outcome is Outcome.INTERRUPTED:
        return CellInterrupted(f"ddp_helpers: {consequence}")
    if ev.outcome is Outcome.TIMEOUT:
        return _timeout(ev, ev.unfinished, {r: ev.last_lines.get(r, "") for r in ev.unfinished},
                        what=f" after {run.timeout:g} s", consequence=consequence, in_cell=True)
    if ev.outcome is Outcome.STALLED:
        idle = [r for r in range(n) if r not in ev.unfinished]
        return LaunchTimeout(
            f"stalled: rank(s) {_list(ev.unfinished)} of {n} waited {STALL_SECONDS:g} s in a "
            f"collective while rank(s) {_list(idle)} had finished the cell or were not asked "
            "to run it. A collective completes only when every rank of its group calls it, so "
            f"this one never would. {consequence}", unfinished=ev.unfinished, last_lines={})
    if f.raised:
        return _raised(ev, run, f.rank, f.error, consequence)
    if run.who is not None:  # a served rank: a closed connection is all its death shows
        last = ev.last_lines.get(f.rank, "")
        return RankDied(
            f"rank {f.rank} of {n} ({run.who(f.rank)}) closed its connection without a reply: "
            "its process died (killed, out of memory, a crash) or its node went away. "
            f"{consequence}" + (f"\nIts last line of output: {last}" if last else ""),
            rank=f.rank, exitcode=None, signal_name=None)
    return _died(ev, f.rank, f.exitcode, consequence)


def _state_kept(ev: Evidence, rank: int) -> str:
    """The consequence of a cell that raised on some ranks while the others finished it."""
    others = [r for r in ev.errors if r != rank]
    returned = [r for r in ev.targets if r not in ev.errors]
    if not others:
        return "The other ranks finished the cell; every rank keeps its state."
    mine = ev.errors.get(rank)
    same = [r for r in others if mine is not None and _alike(ev.errors[r], mine)]
    raised = "; ".join(f"rank {r}: {ev.errors[r].type}: {_gist(ev.errors[r].message)}"
                       for r in others if r not in same)
    if same:  # one error on every rank is said once, not once per rank
        raised = "; ".join(filter(None, [f"{_ranks(same)}: the same {mine.type}", raised]))
    done = f"; {_ranks(returned)} finished the cell" if returned else ""
    return f"{_ranks(others).capitalize()} raised too ({raised}){done}; every rank keeps its state."


def _launch_error(ev: Evidence, run: Run) -> LaunchError | None:
    kw = {"results": run.results, "finished": ev.finished}
    if ev.finding is not None:
        text = explain(ev.finding, ev.nprocs, run.place, ev.at, "returned", ev.exitcodes)
        return CollectiveMismatch(f"{text}\nEvery rank was stopped."
                                  + finished_note(ev.finished), finding=ev.finding,
                                  unfinished=ev.unfinished, **kw)
    if ev.outcome is Outcome.TIMEOUT:
        lingering = [r for r in ev.unfinished if r in ev.finished]
        consequence = "Every rank was stopped." + (
            f" Rank(s) {_list(lingering)} had returned a value but their process did not exit: "
            "a non-daemon thread or a child process it started was still running."
            if lingering else "")
        return _timeout(ev, ev.unfinished, {r: ev.last_lines.get(r, "") for r in ev.unfinished},
                        consequence=consequence, stacks=ev.stacks, **kw)
    f = ev.failure
    if f is None:
        return None
    if f.raised:
        return _raised(ev, run, f.rank, f.error, "The other ranks were stopped.", **kw)
    return _died(ev, f.rank, f.exitcode, "The other ranks were stopped.", **kw)


def _raised(ev: Evidence, run: Run, rank: int, error: Error, consequence: str,
            **kw) -> RankRaised:
    """Word a rank's Error reply."""
    exc_type, message = error.type, error.message
    tb = run.name_cells(error.traceback)
    said = clean_error_text(message)
    if said and said in clean_error_text(tb):  # the traceback's last line says it whole
        said = _gist(message)
    text = (f"rank {rank} of {ev.nprocs} raised {exc_type}: {said}\n"
            f"{consequence} The rank's traceback:\n{clean_traceback(tb)}"
            + hint(exc_type, message) + finished_note(kw.get("finished")))
    return RankRaised(text, rank=rank, exc_type=exc_type, exc_message=message,
                      traceback_text=tb, **kw)


def _died(ev: Evidence, rank: int, exitcode: int, consequence: str, **kw) -> RankDied:
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
    last = ev.last_lines.get(rank, "")
    text = (f"rank {rank} of {ev.nprocs} {how}{why}. {consequence}"
            + (f"\nIts last line of output: {last}" if last else "")
            + finished_note(kw.get("finished")))
    return RankDied(text, rank=rank, exitcode=exitcode, signal_name=signame, **kw)


def _timeout(ev: Evidence, unfinished: list[int], last_lines: dict[int, str], *,
             what: str = "", consequence: str, stacks: dict[int, str] | None = None,
             in_cell: bool = False, **kw) -> LaunchTimeout:
    """Word a timeout: which ranks had not finished, the last line each printed (`in_cell`:
    only lines of this cell count, and none printed says nothing), and, given faulthandler
    dumps in `stacks`, where each one's main thread was."""
    return timeout_error(unfinished, ev.nprocs, last_lines, what=what, consequence=consequence,
                         stacks=stacks, in_cell=in_cell, **kw)


def timeout_error(unfinished: list[int], nprocs: int, last_lines: dict[int, str], *,
                  what: str = "", consequence: str = "Every rank was stopped.",
                  stacks: dict[int, str] | None = None, in_cell: bool = False,
                  results: list | None = None, finished: list[int] | None = None
                  ) -> LaunchTimeout:
    """A LaunchTimeout, worded (see _timeout)."""
    lines = "\n".join(f"  rank {r}: {last_lines.get(r) or '(printed nothing)'}"
                      for r in unfinished)
    printed = f" Last line each printed{' in this cell' if in_cell else ''}:\n{lines}\n"
    if in_cell and not any(last_lines.get(r) for r in unfinished):
        printed = "\n"
    short = {r: main_thread_stack(t) for r, t in (stacks or {}).items()}
    text = (f"timeout{what}: rank(s) {_list(unfinished)} of {nprocs} had not finished. "
            f"{consequence}{printed}" + _stacks_text(short) +
            "A rank waiting forever is usually in a collective or barrier another rank never "
            "reached. If the work is just slow, give it longer: --timeout S on the %%ranks or "
            "%ranks start line, timeout= in Python." + finished_note(finished))
    return LaunchTimeout(text, unfinished=unfinished, last_lines=last_lines, stacks=short,
                         results=results, finished=finished)


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
    return (f"\nRanks {_list(done)} had finished: their return values are in this error's "
            ".results.")


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 0, 1 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


GIST_CHARS = 160


def _gist(text: str) -> str:
    """A message's first line, cut at a word near GIST_CHARS; " ..." marks anything left out
    (a long message such as DDP's unused-parameter error is said whole once, in the traceback)."""
    lines = clean_error_text(text).splitlines() or [""]
    first = lines[0].rstrip()
    if len(first) > GIST_CHARS:
        first = first[:GIST_CHARS].rsplit(" ", 1)[0]
    return first + (" ..." if first != "\n".join(lines).rstrip() else "")


def _alike(a: Error, b: Error) -> bool:
    """The same error on two ranks: same type, same first line."""
    return a.type == b.type and _gist(a.message) == _gist(b.message)
