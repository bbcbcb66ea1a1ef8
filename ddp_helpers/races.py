"""Making a race in an answer certain, for exercise checks on the ranks.

An answer that starts a collective with async_op=True and never waits on it returns before the
collective has finished; on two idle cores it is often finished by the time anyone reads the
result, so such an answer passes in some share of runs. Here rank 0 calls the answer only once
every other rank's call has returned and its result was copied: a collective cannot finish
before rank 0 joins it, so on ranks 1.. an answer that returns early hands back a value that is
not the result, every run. A right answer blocks until rank 0 joins, so it costs rank 0 one
wait of WAIT_S seconds, no more.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

WAIT_S = 0.3  # rank 0's wait for the others' calls to return (a right one never does)


def agreed_key(topic: str, device: torch.device) -> str:
    """A store key prefix every rank agrees on, new at each call: rank 0 counts in the store
    and broadcasts the count (one broadcast: call it outside a Ledger that counts calls)."""
    from torch.distributed.distributed_c10d import _get_default_store

    count = _get_default_store().add(f"{topic}/count", 1) if dist.get_rank() == 0 else 0
    token = torch.tensor([count], device=device)
    dist.broadcast(token, src=0)
    return f"{topic}/{int(token.item())}"


def say(key: str) -> None:
    """This rank tells rank 0, through the store (no collective), that it reached `key`."""
    from torch.distributed.distributed_c10d import _get_default_store

    _get_default_store().set(f"{key}/{dist.get_rank()}", "1")


def others_said(key: str, seconds: float) -> bool:
    """Rank 0: wait up to `seconds` until every other rank has said `key`; False on time-out."""
    from torch.distributed.distributed_c10d import _get_default_store

    keys = [f"{key}/{r}" for r in range(1, dist.get_world_size())]
    try:
        _get_default_store().wait(keys, datetime.timedelta(seconds=seconds))
        return True
    except (RuntimeError, dist.DistError):
        return False


def rank_zero_last(key: str, call: Callable[[], object], copy: Callable[[object], object]):
    """call() on every rank, rank 0's only after the others' returned (or after WAIT_S), and
    copy(its result) taken at once on each rank, before rank 0 can join a collective left
    running; returns the copy."""
    if dist.get_rank() == 0:
        others_said(f"{key}/returned", WAIT_S)  # a right answer: times out
    copied = copy(call())
    if dist.get_rank() != 0:
        say(f"{key}/returned")
    return copied
