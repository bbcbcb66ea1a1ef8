"""Parent side of a one-shot run: start N ranks on fn(rank, *args) from a notebook or a script,
relay their output into the caller, bring their results and errors back, enforce the timeout, and
leave no process behind. The processes themselves are handled by supervisor.RankSet.
"""

from __future__ import annotations

import time

from .errors import CollectiveMismatch, LaunchError, LaunchTimeout, RankDied, RankRaised
from .mismatch import aborted_note, explain
from .options import check_launch
from .protocol import Ok
from .start import free_port
from .supervisor import DRAIN_SECONDS, Priority, RankSet
from .tracebacks import shorten_path
from .watch import CellWatch, Outcome, give_up_once_settled, wait


def launch(fn, args: tuple = (), nprocs: int = 2, timeout: float = 300, *,
           start_method: str = "forkserver", output="live", env: dict | None = None,
           backend: str | None = None, master_port: int | None = None) -> list:
    """Run fn(rank, *args) on `nprocs` ranks and return their return values in rank order.

    Args:
        fn: a function defined in an importable module (not in the notebook), called exactly as
            torch.multiprocessing.spawn calls it, so code written for mp.spawn runs unchanged.
        args: the extra positional arguments, a tuple of picklable plain data.
        nprocs: the number of ranks (processes) to start.
        timeout: seconds the whole run may take; then every rank is stopped.
        start_method: "forkserver" (fast: ranks fork from a server that preloaded torch) or
            "spawn" (a fresh interpreter per rank, as mp.spawn does).
        output: "live" streams "[rank r] ..." lines as they come; "by_rank" prints each rank's
            lines after the run, rank 0 first (deterministic); "none" keeps them quiet; a
            callable sink(rank, stream, line) receives each line instead (stream is "stdout"
            or "stderr"), e.g. to update a widget.
        env: extra environment variables for the ranks only (strings).
        backend: force the backend every dh.process_group(...) in the run uses ("gloo", "nccl").
        master_port: a fixed rendezvous port; by default a free one is chosen per launch.

    Returns:
        [fn's return value on rank 0, on rank 1, ...]; tensors come back on the CPU.

    Raises:
        LaunchRefused: bad input, found before any process starts (the message says the fix).
        RankRaised: a rank raised; names the rank, its exception and its traceback.
        RankDied: a rank exited without a result (a signal, os._exit).
        LaunchTimeout: the run took longer than `timeout`; names the unfinished ranks.
        Every error stops all ranks at once and keeps finished ranks' values in `.results`.
        MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK are set for the ranks only.
    """
    payload, extra_env, port = check_launch(fn, args, nprocs, timeout, start_method, output,
                                            env=env, backend=backend, master_port=master_port)
    ranks = RankSet(nprocs, start_method)
    try:
        ranks.start(payload, extra_env, port or free_port(), output)
        watch = CellWatch(ranks, list(range(nprocs)))  # for its mismatch rule: the ledgers
        outcome = wait(ranks, ranks.all_exited, time.monotonic() + timeout, give_up_once_settled,
                       watch.mismatched)
        stacks = ranks.dump_stacks(_unfinished(ranks)) if outcome is Outcome.TIMEOUT else {}
        mismatch = _mismatch(ranks, outcome, watch)
    except BaseException:  # KeyboardInterrupt included: stop everything, then re-raise
        ranks.shutdown(drain=0)
        raise
    ranks.shutdown(drain=DRAIN_SECONDS)
    error = mismatch or _error(ranks, outcome, stacks)
    if error is not None:
        raise error
    return _results(ranks)


def _mismatch(ranks: RankSet, outcome: Outcome, watch: CellWatch) -> CollectiveMismatch | None:
    """A stall the ledgers explain, or an abort (and its knock-on errors) they explain."""
    failure = ranks.failure()
    if outcome is not Outcome.STALLED and (
            failure is None or failure.priority < Priority.ABORTED):
        return None  # a rank's own error or death is the cause, not a mismatch
    ranks.drain_output()  # the ledger lines still in the pipes
    finding = watch.mismatch()
    if finding is None:
        return None
    text = explain(finding, ranks.nprocs, _place, time.monotonic(), "returned")
    return CollectiveMismatch.from_finding(
        finding, text + aborted_note(ranks.exitcodes), watch.unfinished(),
        "Every rank was stopped.", results=_results(ranks), finished=ranks.finished())


def _place(where: tuple[str, int]) -> str:
    return f"{shorten_path(where[0])}, line {where[1]}"


def _results(ranks: RankSet) -> list:
    """Each rank's return value, None for a rank that did not return one."""
    replies = ranks.replies()
    return [replies[r].value if isinstance(replies.get(r), Ok) else None
            for r in range(ranks.nprocs)]


def _unfinished(ranks: RankSet) -> list[int]:
    """Ranks without a result, and ranks whose process has not exited after returning one."""
    done = ranks.finished()
    return [r for r in range(ranks.nprocs) if r not in done or r not in ranks.exitcodes]


def _error(ranks: RankSet, outcome: Outcome, stacks: dict[int, str]) -> LaunchError | None:
    """The error to raise for a finished run, or None if every rank returned."""
    done = ranks.finished()
    kw = {"results": _results(ranks), "finished": done}
    if outcome is Outcome.TIMEOUT:
        unfinished = _unfinished(ranks)
        last = {r: ranks.relay.last_line(r) for r in unfinished}
        lingering = [r for r in unfinished if r in done]
        consequence = "Every rank was stopped." + (
            f" Rank(s) {', '.join(map(str, lingering))} had returned a value but their process "
            "did not exit: a non-daemon thread or a child process it started was still running."
            if lingering else "")
        return LaunchTimeout.from_unfinished(unfinished, ranks.nprocs, last, stacks=stacks,
                                             consequence=consequence, **kw)
    failure = ranks.failure()
    if failure is None:
        return None
    if failure.raised:
        return RankRaised.from_error(failure.rank, ranks.nprocs, failure.error, **kw)
    return RankDied.from_exit(failure.rank, ranks.nprocs, failure.exitcode,
                              ranks.relay.last_line(failure.rank), **kw)
