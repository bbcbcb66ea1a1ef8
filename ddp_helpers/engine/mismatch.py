"""Which collectives do not match, found in the ranks' ledgers (ledger_feed.py): the parent
compares what each rank entered, so a mismatch is named as soon as the ranks stop moving.

Collectives pair by their number in their group: the k-th collective of a group on one rank
meets the k-th on every other member. So the rule is: take a rank that sits in its k-th
collective of group g and look at every other member's k-th in g. A different op (or the same
ops in another order), different shapes or dtypes, no k-th because the member finished with
fewer (or none), another root (src or dst) for the same broadcast, reduce, gather or
scatter, or a member that sits in a collective of another group: each is a definite mismatch.
Send and recv pair by peer, not by number, so they are left out of the numbering.
"""

from __future__ import annotations

import ast
import dataclasses
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ..ledger import POINT_TO_POINT, Call

Timed = tuple[Call, float]  # a call and the parent's monotonic time when it arrived


@dataclass(frozen=True)
class Finding:
    """A definite mismatch: `rank` sits in `call`; `other` differs as `kind` says."""

    kind: str  # "ops" | "shapes" | "roots" | "fewer" | "never" | "group"
    rank: int
    other: int
    call: Call  # numbered among the group's collectives (send/recv left out)
    other_call: Call | None  # the other's call of that number, or where it sits ("group")
    other_count: int  # how many collectives of call.group the other rank made
    since: float  # monotonic time from which the mismatch was visible


def numbered(calls: list[Timed]) -> list[Timed]:
    """The collectives (not send/recv), renumbered 1, 2, ... within each group."""
    count: dict[str, int] = {}
    out = []
    for call, t in calls:
        if call.op in POINT_TO_POINT:
            continue
        count[call.group] = count.get(call.group, 0) + 1
        if call.seq != count[call.group]:  # send/recv came before it in its group
            call = dataclasses.replace(call, seq=count[call.group])
        out.append((call, t))
    return out


def members(group: str, nprocs: int) -> list[int]:
    """The ranks of a ledger group name: 'world' or 'ranks [0, 2]'."""
    if group.startswith("ranks ["):
        try:
            return [int(r) for r in ast.literal_eval(group.removeprefix("ranks "))]
        except (ValueError, SyntaxError):
            return []
    return list(range(nprocs)) if group == "world" else []


def find(calls: dict[int, list[Timed]], done: dict[int, float], nprocs: int,
         gaps: set[int] = frozenset()) -> Finding | None:
    """The first definite mismatch among ranks that have not finished, or None. `done` maps
    the ranks that finished (the cell, or their function) to when they did."""
    mine = {r: numbered(calls.get(r, [])) for r in range(nprocs)}
    for rank in range(nprocs):
        if rank in done or rank in gaps or not mine[rank]:
            continue
        call, t = mine[rank][-1]
        for other in members(call.group, nprocs):
            if other == rank or other in gaps:
                continue
            found = _compare(rank, call, t, other, mine[other], done)
            if found is not None:
                return found
    return None


def _compare(rank: int, call: Call, t: float, other: int, theirs: list[Timed],
             done: dict[int, float]) -> Finding | None:
    same_group = [(c, s) for c, s in theirs if c.group == call.group]
    if len(same_group) >= call.seq:
        peer, s = same_group[call.seq - 1]
        kind = ("ops" if peer.op != call.op else
                "shapes" if peer.tensors() != call.tensors() else
                "roots" if peer.root != call.root else None)
        return None if kind is None else Finding(kind, rank, other, call, peer,
                                                 len(same_group), max(t, s))
    if other in done:
        return Finding("fewer" if same_group else "never", rank, other, call, None,
                       len(same_group), max(t, done[other]))
    if theirs and theirs[-1][0].group != call.group:
        peer, s = theirs[-1]
        return Finding("group", rank, other, call, peer, len(same_group), max(t, s))
    return None  # the other rank is still on its way: it may yet get there


def explain(f: Finding, nprocs: int, place: Callable[[tuple[str, int]], str], now: float,
            finished_word: str = "finished the cell") -> str:
    """The learner's paragraph: what each of the two ranks is in, side by side, then why."""
    world = " in the world group" if f.kind == "group" else ""
    mine = f"rank {f.rank} is in {_text(f.call, world)} ({place(f.call.where)})"
    if f.kind in ("ops", "shapes", "group", "roots"):
        theirs = (f"rank {f.other} is in {_text(f.other_call, world)} "
                  f"({place(f.other_call.where)})")
    else:
        n = f.other_count
        theirs = (f"rank {f.other} {finished_word} after {n} collective{'s' * (n != 1)}"
                  + (f" in {f.call.group}" if f.call.group != "world" else "")
                  + f" ({n} against {f.call.seq})" if n else
                  f"rank {f.other} {finished_word} without calling it")
    head = (f"Collectives do not match (seen after {max(now - f.since, 0):.1f} s): "
            f"{mine}; {theirs}.")
    return head + " " + _WHY[f.kind].format(r=f.rank, o=f.other, a=f.call.tensors() or "none",
                                            b=f.other_call.tensors() if f.other_call else "",
                                            op=f.call.op, g=f.call.group, ra=f.call.root,
                                            rb=f.other_call.root if f.other_call else None)


def _text(call: Call, world: str) -> str:
    return call.text() + (world if call.group == "world" else "")


_WHY = {
    "ops": ("The collective of the same number pairs up across ranks, so every rank must call "
            "the same collectives in the same order: here one rank calls a different op, or "
            "the same ops in another order."),
    "shapes": ("The same collective got different tensors: {a} on rank {r}, {b} on rank {o}. "
               "Every rank must hand in the same shapes and dtypes."),
    "roots": ("The same {op} was given a different root on each rank: {ra} on rank {r}, {rb} on "
              "rank {o} (ranks of its group). Every rank must pass the same src (dst for reduce "
              "and gather), the one rank that holds or receives the data, not its own rank."),
    "fewer": ("Rank {o} made fewer calls, so rank {r}'s {op} has no partner: every rank must "
              "make the same number of collectives (a loop or an `if` that depends on the "
              "rank?)."),
    "never": ("Rank {o} never reached the {op}: a collective completes only when every rank "
              "of its group calls it (an `if rank == ...` around it?)."),
    "group": ("The ranks are in collectives of different groups ({g} for rank {r}): every "
              "member of a group must call its collectives, in the same order as the others."),
}


def aborted_note(exitcodes: dict[int, int]) -> str:
    """For ranks gloo aborted (SIGABRT) because what arrived did not fit: say so."""
    aborted = sorted(r for r, code in exitcodes.items() if code == -signal.SIGABRT)
    if not aborted:
        return ""
    return (f" (gloo aborted rank(s) {', '.join(map(str, aborted))}, SIGABRT, when the data that "
            "arrived did not fit.)")
