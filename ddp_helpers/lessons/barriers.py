"""Lesson 04 (barriers): the helpers its `%%ranks` cells call, what the parent prints about them,
and the checks of its two exercises.

The torch.distributed calls the lesson teaches (barrier, monitored_barrier, a subgroup with a
short timeout, mismatched collectives) are typed in the notebook. Here: the slow writer that
stands for a download, what a reader finds, the barrier timeline's numbers, and the stable part
of torch's error messages (their first line without C++ locations; a mismatch reduced to the
operations it names, never the fingerprint format, which changes between torch releases).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

from .. import clean_error_text
from ..checks import Case, case
from ..exercises import exercise_check, require

LINES = 5  # lines in the prepared file, plus a final "END" line that marks it complete

# ---------------------------------------------------------------- a file prepared once


def write_slowly(path: str, line_seconds: float = 0.2) -> None:
    """Write the prepared file the naive way: in place, one line at a time (a slow download)."""
    with open(path, "w") as f:
        for i in range(LINES):
            f.write(f"sample {i}\n")
            f.flush()  # make the half-written state visible to other processes
            time.sleep(line_seconds)
        f.write("END\n")


def inspect_file(path: str) -> str:
    """What a reader finds: 'missing', 'half-written (k of N lines)' or 'complete'."""
    if not os.path.exists(path):
        return "missing"
    with open(path) as f:
        lines = f.read().splitlines()
    if lines[-1:] == ["END"] and len(lines) == LINES + 1:
        return "complete"
    return f"half-written ({len(lines)} of {LINES + 1} lines)"


# ---------------------------------------------------------------- the barrier timeline


def timeline(times: list[dict]) -> list[dict]:
    """Per-rank times (wall clock, from the ranks) in seconds from the earliest start."""
    t0 = min(t["start"] for t in times)
    return [{"rank": r, "start": t["start"] - t0, "arrive": t["arrive"] - t0,
             "leave": t["leave"] - t0, "waited": t["leave"] - t["arrive"]}
            for r, t in enumerate(times)]


def timeline_facts(rows: list[dict]) -> None:
    """Print what a barrier timeline shows that does not depend on the clock."""
    last = max(rows, key=lambda r: r["arrive"])
    print("order of arrival:", [r["rank"] for r in sorted(rows, key=lambda r: r["arrive"])])
    print("every rank left after the last one arrived:",
          all(r["leave"] >= last["arrive"] for r in rows))
    print("the rank that waited longest:", max(rows, key=lambda r: r["waited"])["rank"])


# ---------------------------------------------------------------- torch's messages, stable part


def first_line(error: BaseException | str) -> str:
    """An error's first line, without the C++ source location torch puts in front of it."""
    text = clean_error_text(str(error))
    return (text.splitlines() or [""])[0].strip()


def named_ranks(message: str) -> list[int]:
    """The ranks a monitored_barrier error names ("Rank 1 failed ..." / "Ranks 1, 2 failed")."""
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in found.group(1).replace(",", " ").split()] if found else []


def mismatch_summary(message: str) -> str:
    """What a TORCH_DISTRIBUTED_DEBUG=DETAIL mismatch error says, without its fingerprint
    format: that the collectives differ, and which operation each rank it names was running."""
    if "Detected mismatch between collectives" not in message:
        return f"no mismatch reported: {first_line(message)}"
    calls = re.findall(r"Rank (\d+) is running collective: \w+\([^)]*?OpType=(\w+)", message)
    if not calls:
        return "mismatch detected"
    named = ", ".join(f"rank {r} ran {op}" for r, op in sorted(dict(calls).items()))
    return f"mismatch detected: {named}"


def timeout_facts(errors: list[str | None], waited: list[float], timeout_s: float) -> None:
    """Print what is certain after a collective that timed out on some ranks: which rank's
    error came first is a race (a rank that times out closes its connections, so its peers may
    fail with "connection closed" before their own timeout), but the first one is a timeout."""
    timed_out = [first_line(e) for e in errors if e and "timed out" in e.lower()]
    print("every rank's collective raised:", all(e is not None for e in errors))
    print("gloo's message where it timed out:", timed_out[0] if timed_out else "(none)")
    print(f"the longest wait reached the group's {timeout_s:g} s timeout:",
          max(waited) >= timeout_s)


# ---------------------------------------------------------------- three ranks (Going deeper)


def monitored_barrier_on_ranks(rank: int, absent: tuple, timeout_s: float,
                               wait_all_ranks: bool = False) -> tuple[str, float]:
    """Run by dh.launch on each rank: one monitored_barrier on a gloo group made for it. The
    ranks in `absent` are busy instead (past rank 0's timeout); rank 0 catches its error and
    stays alive; the other ranks pass a timeout five times rank 0's. Returns this rank's
    (first line of its error, "passed" or "busy", seconds)."""
    from ..runtime import process_group

    with process_group(backend="gloo", verbose=False):
        group = dist.new_group(backend="gloo")
        start = time.time()
        if rank in absent:
            time.sleep(timeout_s + 2)  # busy until the others are done: none of them exits
            return "busy", time.time() - start
        try:
            mine = timeout_s if rank == 0 else 5 * timeout_s  # the others: a longer one
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=mine),
                                   wait_all_ranks=wait_all_ranks)
            what = "passed"
        except RuntimeError as e:
            what = first_line(e)
        waited = time.time() - start
        if rank == 0:
            time.sleep(1)  # caught, and alive: its peers do not fail because it exited
        return what, waited


def barrier_after_a_peer_exits(rank: int, seconds: float = 0.5) -> tuple[str, float]:
    """Run by dh.launch on two ranks: rank 1 skips a barrier on a gloo group (with the default
    30-minute timeout) and returns, so its process exits after `seconds`; rank 0 waits in it.
    Returns this rank's (what happened, seconds)."""
    from ..runtime import process_group

    with process_group(backend="gloo", verbose=False):
        group = dist.new_group(backend="gloo")  # a group of its own: the kit waits 10 s there
        start = time.time()
        if rank != 0:
            time.sleep(seconds)
            return "skipped the barrier and exited", time.time() - start
        try:
            dist.barrier(group=group)
            what = "passed"
        except RuntimeError as e:
            what = first_line(e)
        return what, time.time() - start


def monitored_barrier_facts(both_absent: list[list], one_absent: list[list],
                            timeout_s: float) -> None:
    """Print what rounds of monitored_barrier_on_ranks show that does not depend on the clock:
    whom rank 0 named, and whether each wait ended at rank 0's one timeout (a margin of half a
    timeout: one more timeout per missing rank, or the others' own 5x, would be far past it)."""
    rounds = len(both_absent)
    named = sum(named_ranks(r[0][0]) == [1, 2] for r in both_absent)
    print(f"ranks 1, 2 absent, wait_all_ranks=True: rank 0 named [1, 2] in {named} of {rounds} "
          "rounds")
    print(f"  rank 0's longest wait was under {1.5 * timeout_s:g} s (one {timeout_s:g} s timeout,"
          " not one per missing rank):", max(r[0][1] for r in both_absent) < 1.5 * timeout_s)
    named = sum(named_ranks(r[0][0]) == [1] for r in one_absent)
    print(f"rank 1 absent, rank 2 calls it: rank 0 named [1] in {named} of {rounds} rounds")
    told = sum("from rank 0" in r[2][0] and "rank 0 logs" in r[2][0] for r in one_absent)
    print(f"  rank 2 raised, pointing to rank 0's logs, in {told} of {rounds} rounds")
    print(f"  rank 2 raised within 0.3 s of rank 0, long before its own {5 * timeout_s:g} s:",
          all(abs(r[2][1] - r[0][1]) < 0.3 for r in one_absent))


def peer_exit_facts(runs: list[list], timeout_s: float = 1800) -> None:
    """Print what rounds of barrier_after_a_peer_exits show: rank 0's barrier ended with gloo's
    "Connection closed by peer" soon after rank 1 exited, not at the group's timeout."""
    closed = sum("Connection closed by peer" in r[0][0] for r in runs)
    print(f"rank 0's barrier raised 'Connection closed by peer' in {closed} of {len(runs)} rounds")
    print(f"  each within 1 s of rank 1's exit (the group's timeout: {timeout_s / 60:g} minutes):",
          all(r[0][1] - r[1][1] < 1.0 for r in runs))


# ---------------------------------------------------------------- exercises


def _shared_folder() -> str:
    """A fresh temporary folder, made by rank 0 and named to every rank (a collective)."""
    name = [tempfile.mkdtemp(prefix="ddp_kit_prepare_once_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _counting_writer(calls: list[str], seconds: float):
    """write_slowly at `seconds` per line, noting each call in `calls` as it starts and "done"
    once it has returned (the ledger's callback reads that to place each collective)."""
    def write(path: str) -> None:
        calls.append(path)
        write_slowly(path, seconds)
        calls.append("done")
    return write


def _prepare_once_run(fn, rank: int, path: str, seconds: float, rank0_late: float) -> dict:
    """One call of the learner's prepare_once on this rank, under a Ledger: what the file was
    when it returned, how often write ran here, and each collective it called (op, whether this
    rank's write had returned by then). Rank 0 starts `rank0_late` s late: a rank that does not
    wait for it finds the file missing, however long it sleeps instead."""
    from ..ledger import Ledger

    calls: list[str] = []
    seen: list[tuple[str, bool]] = []
    if rank == 0:
        time.sleep(rank0_late)
    with Ledger(on_call=lambda c: seen.append((c.op, "done" in calls))):
        fn(rank, path, _counting_writer(calls, seconds))
    return {"file": inspect_file(path), "writes": calls.count(path), "ops": seen}


def _prepare_once_cases(label: str, rank: int, runs: list[dict]) -> list[Case]:
    """The cases of one writer on this rank, given every rank's run (rank order)."""
    mine, zero = runs[rank], runs[0]
    ops = [op for op, _ in mine["ops"]]
    zero_ops = [op for op, _ in zero["ops"]]
    cases = [case(f"{label}: the file when prepare_once returned on rank {rank}", mine["file"],
                  "complete"),
             case(f"{label}: calls of write on all ranks together",
                  sum(r["writes"] for r in runs), 1),
             Case(f"{label}: write runs on rank 0", zero["writes"] == 1,
                  f"write ran {[r['writes'] for r in runs]} times on ranks 0, 1, ...")]
    if rank != 0:  # rank 0's own list stays about the file: the verdict names rank 0 first
        after = [op for op, written in zero["ops"] if written]
        cases.append(Case(f"{label}: rank {rank} waits for rank 0 in a collective", bool(ops),
                          f"rank {rank} called no collective (a sleep is no wait: rank 0 may "
                          "be later than any sleep)"))
        cases.append(Case(f"{label}: rank 0 reaches a collective after write returned",
                          bool(after), f"rank 0 called {', '.join(zero_ops) or 'no collective'}"
                          ", none after write returned: the others can leave while it writes"))
        cases.append(Case(f"{label}: rank {rank} calls what rank 0 calls", ops == zero_ops,
                          f"rank {rank} called {', '.join(ops) or 'nothing'}, rank 0 "
                          f"{', '.join(zero_ops) or 'nothing'}"))
    return cases


@exercise_check("prepare_once", "ranks")
def check_prepare_once(namespace: dict) -> list[Case]:
    """prepare_once(rank, path, write): write runs once, on rank 0, and no rank returns before
    the file is complete. Two files, written at two speeds, with rank 0 starting late.
    The ledger sees each rank's collectives: every rank waits in the same ones, and rank 0
    reaches one after write returned (a sleep instead, or a barrier before write, FAILs)."""
    fn = require(namespace, "prepare_once")
    rank = dist.get_rank()
    folder = _shared_folder()
    cases = []
    try:
        for label, seconds, late in (("a slow writer", 0.1, 0.3), ("a slower writer", 0.25, 0.5)):
            path = os.path.join(folder, label.replace(" ", "_") + ".txt")
            run = _prepare_once_run(fn, rank, path, seconds, late)
            runs: list = [None] * dist.get_world_size()
            dist.all_gather_object(runs, run)  # every rank waits here for the writer
            cases += _prepare_once_cases(label, rank, runs)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return cases


# Three ranks; ranks 1 and 2 never reach rank 0's monitored_barrier. Which ranks does rank 0's
# error name, with wait_all_ranks=True and with wait_all_ranks=False? (tests check these on
# real ranks: ProcessGroupGloo waits for ranks 1, 2, ... in order.)
MONITORED_NAMES = {True: [1, 2], False: [1]}


@exercise_check("monitored_barrier_names", "prediction",
                wrong_answer={True: [1, 2], False: [1, 2]})
def check_monitored_barrier_names(answer) -> list[Case]:
    """A prediction: {True: [ranks named], False: [ranks named]}, keyed by wait_all_ranks."""
    if not isinstance(answer, dict):
        return [Case("the prediction", False, "write a dict, e.g. {True: [...], False: [...]}, "
                                              f"got {type(answer).__name__}")]
    cases = []
    for key, names in MONITORED_NAMES.items():
        got = sorted(answer.get(key) or [])
        cases.append(Case(f"wait_all_ranks={key}", got == names,
                          f"you predicted {got}, rank 0's error names {names}"))
    return cases
