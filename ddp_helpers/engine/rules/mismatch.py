"""Which collectives do not match, found in the ranks' ledgers (sets.ledger_reader): the parent
compares what each rank entered, so a mismatch is named as soon as the ranks stop moving
(words.mismatch says it).

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
from dataclasses import dataclass

from ...ledger import POINT_TO_POINT, Call

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
