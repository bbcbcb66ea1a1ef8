"""Which collectives do not match, found in the ranks' ledgers (sets.ledger_reader): the parent
compares what each rank entered, so a mismatch is named as soon as the ranks stop moving
(words.mismatch says it).

Collectives pair by their number in their group: the k-th collective of a group on one rank
meets the k-th on every other member. So the rule is: take a rank that sits in its k-th
collective of group g and look at every other member's k-th in g. A different op (or the same
ops in another order), different shapes or dtypes, no k-th because the member finished with
fewer (or none), another root (src or dst) for the same broadcast, reduce, gather or
scatter, or a member that sits in a collective of another group: each is a definite mismatch.
Send and recv pair by peer, not by number, so they are left out of the numbering; a rank that
sits in a send or recv whose peer has finished, or sits in a collective the first rank must
join, waits for a partner that cannot come ("p2p").

For "ops", the ledgers also say which mistake it most likely is (`hint`): "order" when both
ranks' calls so far hold both ops (the same calls in another order), "fewer" when one rank is
still repeating the op its last calls were while the other has moved on (one rank made fewer
calls of it: a loop over uneven data, then a barrier or the next op).
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

    kind: str  # "ops" | "shapes" | "roots" | "fewer" | "never" | "group" | "p2p"
    rank: int
    other: int
    call: Call  # numbered among the group's collectives (send/recv left out)
    other_call: Call | None  # the other's call of that number, or where it sits ("group")
    other_count: int  # how many collectives of call.group the other rank made
    since: float  # monotonic time from which the mismatch was visible
    hint: str | None = None  # "ops": "order" or "fewer", when the ledgers say which
    fewer: int | None = None  # "fewer" hint: the rank that made fewer calls of the op


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


def same_tensors(a: Call, b: Call) -> bool:
    """Whether two ranks' calls of one collective were handed tensors that fit together. Only
    a scatter's root hands in the list to scatter (the other ranks none), so its inputs are
    not compared."""
    return a.op == "scatter" or a.tensors() == b.tensors()


def members(group: str, nprocs: int) -> list[int]:
    """The ranks of a ledger group name: 'world' or 'ranks [0, 2]'."""
    if group.startswith("ranks ["):
        try:
            return [int(r) for r in ast.literal_eval(group.removeprefix("ranks "))]
        except (ValueError, SyntaxError):
            return []
    return list(range(nprocs)) if group == "world" else []


def unmatched(calls: dict[int, list[Timed]], ranks: list[int], nprocs: int,
              gaps: set[int] = frozenset()) -> Finding | None:
    """After every rank finished a cell: a collective the ranks' ledgers do not pair (another
    op, shapes, root or count in the default group). gloo's blocking collectives cannot finish
    that way; NCCL's (which return before the GPU has done them) and any async_op=True call
    never waited on can, and then hang at the next call that synchronises."""
    if sorted(ranks) != list(range(nprocs)) or gaps:
        return None
    world = {r: [c for c, _ in numbered(calls.get(r, [])) if c.group == "world"] for r in ranks}
    first = world[ranks[0]]
    for r in ranks[1:]:
        theirs = world[r]
        for i in range(max(len(first), len(theirs))):
            a = first[i] if i < len(first) else None
            b = theirs[i] if i < len(theirs) else None
            if a is None or b is None or (a.op, a.root) != (b.op, b.root) or \
                    not same_tensors(a, b):
                longer, other, call = (ranks[0], r, a) if a is not None else (r, ranks[0], b)
                peer = b if a is not None else a
                kind = "fewer" if peer is None else "ops" if a.op != b.op else "shapes"
                count = len(world[other])
                return Finding(kind if kind != "fewer" or count else "never", longer, other,
                               call, peer, count, 0.0)
    return None


def find(calls: dict[int, list[Timed]], done: dict[int, float], nprocs: int,
         gaps: set[int] = frozenset()) -> Finding | None:
    """The first definite mismatch among ranks that have not finished, or None. `done` maps
    the ranks that finished (the cell, or their function) to when they did."""
    mine = {r: numbered(calls.get(r, [])) for r in range(nprocs)}
    for rank in range(nprocs):
        if rank in done or rank in gaps or not calls.get(rank):
            continue
        if calls[rank][-1][0].op in POINT_TO_POINT:
            found = _point_to_point(rank, calls, done, nprocs, gaps)
            if found is not None:
                return found
            continue
        if not mine[rank]:
            continue
        call, t = mine[rank][-1]
        for other in members(call.group, nprocs):
            if other == rank or other in gaps:
                continue
            found = _compare(rank, call, t, other, mine[other], done)
            if found is not None:
                return _with_hint(found, mine)
    return None


def _point_to_point(rank: int, calls: dict[int, list[Timed]], done: dict[int, float],
                    nprocs: int, gaps) -> Finding | None:
    """A rank in a send or recv whose peer (in the default group) has finished, or sits in a
    collective this rank must join: the partner the send or recv waits for cannot come."""
    call, t = calls[rank][-1]
    peer = call.peer
    if call.group != "world" or peer is None or peer in gaps or not 0 <= peer < nprocs:
        return None
    if peer in done:
        return Finding("p2p", rank, peer, call, None, 0, max(t, done[peer]))
    theirs = calls.get(peer)
    if not theirs or theirs[-1][0].op in POINT_TO_POINT:
        return None
    other, s = theirs[-1]
    if rank not in members(other.group, nprocs):
        return None
    return Finding("p2p", rank, peer, call, other, 0, max(t, s))


def _with_hint(f: Finding, mine: dict[int, list[Timed]]) -> Finding:
    """An "ops" finding with which mistake the two ranks' calls so far point to."""
    if f.kind != "ops":
        return f
    k, g = f.call.seq, f.call.group

    def ops(r: int) -> list[str]:
        return [c.op for c, _ in mine[r] if c.group == g][:k]

    a, b = ops(f.rank), ops(f.other)
    if {f.call.op, f.other_call.op} <= set(a) & set(b) and sorted(a) == sorted(b):
        return dataclasses.replace(f, hint="order")
    for r, seq, other_seq in ((f.rank, a, b), (f.other, b, a)):
        # r repeats the op it made before, while the other moved on from that op
        if len(seq) >= 2 and seq[-1] == seq[-2] and other_seq[-1] != seq[-1] and \
                other_seq[-2:-1] == seq[-2:-1]:
            return dataclasses.replace(f, hint="fewer", fewer=f.other if r == f.rank else f.rank)
    return f


def _compare(rank: int, call: Call, t: float, other: int, theirs: list[Timed],
             done: dict[int, float]) -> Finding | None:
    same_group = [(c, s) for c, s in theirs if c.group == call.group]
    if len(same_group) >= call.seq:
        peer, s = same_group[call.seq - 1]
        kind = ("ops" if peer.op != call.op else
                "shapes" if not same_tensors(peer, call) else
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
