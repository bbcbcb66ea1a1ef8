"""Parent side of a one-shot run: start N ranks on fn(rank, *args) from a notebook or a script,
relay their output into the caller, bring their results and errors back, enforce the timeout, and
leave no process behind. The processes are a sets.ForkedSet; the waiting is the rules'; the
error is worded by words.failures.
"""

from __future__ import annotations

import time

from .options import check_launch
from .rules.wait import CellWatch, Outcome, give_up_once_settled, wait
from .sets.forked import DRAIN_SECONDS, ForkedSet
from .sets.start import free_port
from .wire.messages import Ok, RunFunction
from .words import failures


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
    extra_env, port = check_launch(fn, args, nprocs, timeout, start_method, output, env=env,
                                   backend=backend, master_port=master_port)
    ranks = ForkedSet(nprocs, start_method, output=output)
    try:
        ranks.start(RunFunction(fn, args), extra_env, port or free_port())
        watch = CellWatch(ranks, list(range(nprocs)))  # for its mismatch rule: the ledgers
        outcome = wait(ranks, ranks.all_exited, time.monotonic() + timeout, give_up_once_settled,
                       watch.mismatched)
        unfinished = watch.unfinished()
        stacks = ranks.dump_stacks(unfinished) if outcome is Outcome.TIMEOUT else {}
        evidence = watch.evidence(outcome, stacks)
    except BaseException:  # KeyboardInterrupt included: stop everything, then re-raise
        ranks.shutdown(polite=False)
        raise
    ranks.shutdown(drain=DRAIN_SECONDS)
    results = _results(ranks)
    error = failures.error(evidence, failures.Run("launch", results=results))
    if error is not None:
        raise error
    return results


def _results(ranks: ForkedSet) -> list:
    """Each rank's return value, None for a rank that did not return one."""
    replies = ranks.replies()
    return [replies[r].value if isinstance(replies.get(r), Ok) else None
            for r in range(ranks.nprocs)]
