"""The smallest real run: every rank all-reduces its rank number and prints what it got."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .engine import launch
from .runtime import process_group


def hello_rank(rank: int, world_size: int, backend: str = "auto") -> float:
    """Sum 1 + 2 + ... + world_size across the ranks with one all_reduce."""
    with process_group(rank, world_size, backend) as device:
        t = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(t)
        print(f"all_reduce(SUM) of rank+1 over {world_size} ranks = {t.item():g}")
        return t.item()


def run(nprocs: int, backend: str) -> int:
    """Launch hello_rank on nprocs ranks; exit status 0 when every rank got the right sum."""
    results = launch(hello_rank, args=(nprocs, backend), nprocs=nprocs, timeout=120,
                     backend=backend)
    expected = nprocs * (nprocs + 1) / 2
    ok = all(r == expected for r in results)
    print(f"{'OK' if ok else 'WRONG'}: every rank holds {expected:g}" if ok else
          f"WRONG: expected {expected:g}, ranks hold {results}")
    return 0 if ok else 1
