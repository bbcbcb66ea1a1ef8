"""Looking inside the ranks from the notebook: pdb post-mortem on one rank (`pool.debug`,
`%ranks debug R`), every rank's stack (`pool.where`, `%ranks where`, and the snapshot the kit
takes before it stops the ranks) and a value compared across ranks (`pool.compare`,
`%ranks compare NAME`). The rank side of each is in engine/rank (debugger, stacks,
summaries); the words in engine/words (stacks, comparison)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .wire.messages import CHUNK, AskStack, Debug, DebugLine, Error, Ok, Summarise
from .words.comparison import Comparison, Difference, Row
from .words.errors import LaunchRefused, RankDied
from .words.stacks import Snapshot

_SNAPSHOT_SECONDS = 0.3  # how long the ranks may take to answer, all at once
_WHERE_SECONDS = 1.0  # `%ranks where`: ranks idle between cells answer at once


def snapshot(pool, ranks: list[int], when: str, timeout: float = _SNAPSHOT_SECONDS) -> Snapshot:
    """Every live rank's stack with its locals summarised, asked of each rank's own thread at
    once (it answers while the main thread sits in a C++ collective)."""
    rank_set = pool._set
    alive = [r for r in ranks if rank_set.alive(r)]
    stacks = rank_set.question(alive, AskStack(), timeout) if alive else {}
    entered = {r: last[0] for r in ranks if (last := rank_set.ledger.last(r)) is not None}
    return Snapshot(stacks, pool.labels, when=when, entered=entered,
                    exited=[r for r in ranks if r not in alive])


def where(pool) -> Snapshot:
    """What `%ranks where` shows: each rank's stack now, or, for ranks the kit stopped, the
    snapshot it took then."""
    if not pool.running:
        if pool.snapshot is not None:
            return pool.snapshot
        raise LaunchRefused(f"%ranks where: the ranks are not running ({pool.stopped_because}) "
                            "and no snapshot was taken: nothing to show.")
    return snapshot(pool, list(range(pool.nprocs)), "now", _WHERE_SECONDS)


def post_mortem(pool, rank: int | None = None, commands: Iterable[str] | None = None) -> None:
    """pdb on the frame where `rank`'s last failing cell raised (default: the rank that failed
    first), reading each line from `commands` if given, else through input() (the notebook's
    input box). After the kit stopped the ranks: that rank's snapshot, read-only."""
    if not pool.running:
        if pool.snapshot is None:
            raise LaunchRefused(f"%ranks debug: the ranks are not running "
                                f"({pool.stopped_because}): there is nothing to debug.")
        rank = pool.first_failed if rank is None else rank
        _check_rank(pool, rank)
        print(f"The kit stopped every rank ({pool.stopped_because}); what rank {rank} held "
              f"then, read-only:\n{pool.snapshot.text(rank)}")
        return
    rank = pool.first_failed if rank is None else rank
    _check_rank(pool, rank)
    if rank not in pool.failed:
        print(f"Rank {rank} has nothing to debug: none of its cells raised"
              + (f" (rank {pool.first_failed}'s did: %ranks debug {pool.first_failed})."
                 if pool.failed else "."))
        return
    lines = iter(commands) if commands is not None else None
    print(f"Post-mortem of rank {rank}, where {pool.failed[rank]} raised: pdb commands (p x, "
          "pp x, up, down, list, where, any expression); q or two empty lines to leave. The "
          "ranks keep their state.")
    rank_set = pool._set
    rank_set.ask([rank], Debug(), pool.output)
    while True:
        reply = _next(pool, rank)
        if isinstance(reply, Ok):
            break
        if isinstance(reply, Error):
            raise LaunchRefused(f"rank {rank} could not open pdb: {reply.type}: {reply.message}")
        if reply.text:
            print(pool.labels.pdb(reply.text).rstrip("\n"))
        if reply.prompt is not None:
            rank_set.send(rank, DebugLine(_read(reply.prompt, rank, lines)))
    rank_set.relay.flush()


def _check_rank(pool, rank) -> None:
    if rank is None:
        raise LaunchRefused("%ranks debug: no cell has failed on these ranks yet: there is "
                            "nothing to debug.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pool.nprocs:
        raise LaunchRefused(f"%ranks debug {rank}: give a rank from 0 to {pool.nprocs - 1}.")


def _read(prompt: str, rank: int, lines) -> str:
    """The learner's next line (the stop button ends the session: q)."""
    shown = f"(Pdb rank {rank}) "
    if lines is not None:
        line = next(lines, "q")
        print(f"{shown}{line}")
        return line
    try:
        return input(shown)
    except (KeyboardInterrupt, EOFError):
        return "q"


def _next(pool, rank: int):
    """rank's next pdb output, or its Ok at the end: waited for as long as a cell may take."""
    rank_set = pool._set
    deadline = time.monotonic() + pool.timeout
    while True:
        queued = rank_set.take_debug_output(rank)
        if queued:
            for early in queued[:-1]:  # several at once: show them in order
                if early.text:
                    print(pool.labels.pdb(early.text).rstrip("\n"))
            return queued[-1]
        if rank in rank_set.replies():
            return rank_set.replies()[rank]
        if not rank_set.alive(rank):
            raise RankDied(f"rank {rank} died during post-mortem.", rank=rank, exitcode=None,
                           signal_name=None)
        if time.monotonic() > deadline:
            raise LaunchRefused(f"rank {rank}'s pdb gave no answer within {pool.timeout:g} s "
                                "(a command that waits on the other ranks, such as a "
                                "collective?). `%ranks restart` gives fresh ranks.")
        rank_set.poll(min(deadline, time.monotonic() + 0.25))


def compare(pool, expressions: tuple[str, ...]) -> Comparison:
    """Each expression (a name, or any expression) on every rank: a row per leaf with its dtype,
    shape and a digest per rank, whether it is the same everywhere, and the first element of
    the first differing tensor."""
    replies = pool._run_command(Summarise(tuple(expressions)))
    ranks = list(range(pool.nprocs))
    result = Comparison(ranks)
    for expression in expressions:
        leaves = list(dict.fromkeys(s.name for r in ranks for s in replies[r][expression]))
        for leaf in leaves:
            per_rank = {r: next((s for s in replies[r][expression] if s.name == leaf),
                                _missing(leaf)) for r in ranks}
            result.rows.append(Row(leaf, per_rank))
    for row in result.rows:
        if not row.equal and result.first is None:
            result.first = _first_difference(pool, row, expressions)
    return result


def _missing(leaf: str):
    from .wire.messages import Summary

    return Summary(leaf, "missing", text="not there")


def _first_difference(pool, row: Row, expressions) -> Difference | None:
    """Where a tensor row first differs: its values on every rank (fetched for one chunk, if
    the tensor was too large to travel whole)."""
    summaries = row.per_rank
    if any(s.kind != "tensor" for s in summaries.values()) or \
            len({(s.dtype, s.shape) for s in summaries.values()}) > 1:
        return None
    first = next(iter(summaries.values()))
    values = {r: s.values for r, s in summaries.items()}
    offset = 0
    if any(v is None for v in values.values()):
        k = next(i for i, digests in enumerate(zip(*(s.chunk_digests for s in
                                                     summaries.values())))
                 if len(set(digests)) > 1)
        expression = next(e for e in expressions if row.leaf.startswith(e))
        got = pool._run_command(Summarise((expression,), chunk=(row.leaf, k)))
        values = {r: got[r][expression][0].values for r in summaries}
        offset = k * CHUNK
    base = values[min(values)]
    differs = torch.zeros(base.shape, dtype=torch.bool)
    for v in values.values():
        differs |= ~((v == base) | (_nan(v) & _nan(base)))
    where = torch.nonzero(differs)
    if where.numel() == 0:
        return None
    flat = int(where[0, 0]) + offset
    index = _unravel(flat, first.shape)
    diff = Difference(row.leaf, index, {r: _number(v[flat - offset]) for r, v in values.items()})
    if base.is_floating_point() or base.is_complex():
        gaps = torch.stack([(v - base).abs().nan_to_num(float("inf")) for v in values.values()])
        worst = int(gaps.max(dim=0).values.argmax())
        diff.largest = float(gaps.max(dim=0).values[worst])
        diff.largest_at = _unravel(worst + offset, first.shape)
    return diff


def _nan(t: torch.Tensor) -> torch.Tensor:
    return torch.isnan(t) if t.is_floating_point() or t.is_complex() else \
        torch.zeros(t.shape, dtype=torch.bool)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape or (1,)):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index)) if shape else ()


def _number(x) -> str:
    value = x.item()
    return f"{value:.6g}" if isinstance(value, float) else str(value)
