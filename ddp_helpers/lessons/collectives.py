"""Lesson 01's per-rank functions: groups, init methods, point-to-point, collectives, a ring.

Every function a notebook launches takes `(rank, world_size, ...)` and returns plain records
(dicts, lists, CPU tensors) that the parent prints and plots. The `demo_*` functions run inside
an initialised group and return `(before, after)`, so the notebook can show each one's source.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ddp_helpers.runtime import process_group

# ---------------------------------------------------------------- the group and its store


def init_with(rank: int, world_size: int, method: str, file_path: str | None = None) -> dict:
    """Join a gloo group through one init method ("env", "tcp" or "file"), all-reduce, leave."""
    if method == "env":
        # env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, which the launcher set.
        url = "env://"
    elif method == "tcp":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    elif method == "file":
        if file_path is None:
            raise ValueError(f"rank {rank}: init method 'file' needs file_path=<a path on a "
                             "filesystem every rank sees>; pass it in args")
        url = f"file://{file_path}"
    else:
        raise ValueError(f"rank {rank}: unknown init method {method!r}; "
                         "use 'env', 'tcp' or 'file'")
    # gloo on CPU tensors works on every machine, which is all this demo needs.
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "method": method, "sum": t.item()}
    finally:
        dist.destroy_process_group()


def store_demo(rank: int, world_size: int) -> dict:
    """Use a bare TCPStore, the key-value store behind rendezvous: each rank writes, all read."""
    # Rank 0 hosts the store on the launcher's free port; every rank connects to it. This is
    # what init_process_group does for you before any tensor moves.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=(rank == 0))
    store.set(f"rank{rank}", f"hello from rank {rank}")
    store.wait([f"rank{r}" for r in range(world_size)])
    seen = {r: store.get(f"rank{r}").decode() for r in range(world_size)}
    # The host must outlive the readers: count readers done before rank 0 returns.
    store.add("done", 1)
    if rank == 0:
        while int(store.add("done", 0)) < world_size:
            time.sleep(0.01)
    return seen


# ---------------------------------------------------------------- point to point


def send_recv(rank: int, world_size: int) -> dict:
    """Rank 0 sends a tensor to rank 1 with blocking send/recv; both report before and after."""
    with process_group(rank, world_size) as device:
        t = torch.tensor([1.0, 2.0, 3.0], device=device) if rank == 0 else \
            torch.zeros(3, device=device)
        before = t.cpu().clone()
        if rank == 0:
            dist.send(t, dst=1)
        elif rank == 1:
            dist.recv(t, src=0)
        return {"before": before, "after": t.cpu().clone()}


def isend_irecv_peek(rank: int, world_size: int) -> dict:
    """Rank 1 reads its irecv buffer before wait() (stale) and after (the data); rank 0 sends."""
    # gloo even on GPUs: NCCL queues a rank's point-to-point ops on one stream, so the "go"
    # message below would wait behind the pending irecv and both ranks would hang.
    with process_group(rank, world_size, backend="gloo") as device:
        go = torch.zeros(1, device=device)
        if rank == 0:
            data = torch.tensor([7.0, 8.0, 9.0], device=device)
            # Wait for rank 1's "go" so the peek below is guaranteed to happen before any byte
            # is sent: the demo shows a stale buffer every time, not by luck of timing.
            dist.recv(go, src=1)
            req = dist.isend(data, dst=1)
            req.wait()  # only now may rank 0 change or free `data`
            return {"sent": data.cpu()}
        if rank == 1:
            buf = torch.zeros(3, device=device)
            req = dist.irecv(buf, src=0)
            peek = buf.cpu().clone()  # WRONG on purpose: the receive has not completed
            dist.send(go, dst=0)
            req.wait()
            return {"before_wait": peek, "after_wait": buf.cpu().clone()}
        return {}


def isend_overlap(rank: int, world_size: int, numel: int = 1_000_000) -> dict:
    """Each rank isends to its right neighbour, computes meanwhile, then waits: the right way."""
    with process_group(rank, world_size) as device:
        out = torch.full((numel,), float(rank), device=device)
        inbox = torch.empty(numel, device=device)
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        send_req = dist.isend(out, dst=right)
        recv_req = dist.irecv(inbox, src=left)
        busy = torch.randn(256, 256).matmul(torch.randn(256, 256)).sum()  # overlapped work
        send_req.wait()
        recv_req.wait()  # from here on `out` may be reused and `inbox` read
        return {"from": int(inbox[0].item()), "busy_finite": bool(torch.isfinite(busy))}


# ---------------------------------------------------------------- collectives


def rank_tensor(rank: int, n: int = 4, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank r's starting tensor: [1, 2, ..., n] + 10 r, so every value says whose it was."""
    return torch.arange(1.0, n + 1, device=device) + 10 * rank


def demo_broadcast(rank: int, world_size: int, device: torch.device) -> tuple:
    """broadcast: rank 0's tensor overwrites everyone's."""
    t = rank_tensor(rank, device=device)
    before = t.clone()
    dist.broadcast(t, src=0)
    return before, t


def demo_all_reduce_sum(rank: int, world_size: int, device: torch.device) -> tuple:
    """all_reduce SUM: everyone ends with the element-wise sum."""
    t = rank_tensor(rank, device=device)
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return before, t


def demo_all_reduce_avg(rank: int, world_size: int, device: torch.device) -> tuple:
    """all_reduce AVG: everyone ends with the element-wise mean (what DDP does to gradients)."""
    t = rank_tensor(rank, device=device)
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return before, t


def demo_all_reduce_max(rank: int, world_size: int, device: torch.device) -> tuple:
    """all_reduce MAX: everyone ends with the element-wise maximum."""
    # Rolled per rank so each rank wins somewhere; with rank_tensor the last rank always would.
    t = torch.tensor([3.0, 8.0, 1.0, 6.0], device=device).roll(rank)
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return before, t


def demo_reduce(rank: int, world_size: int, device: torch.device) -> tuple:
    """reduce SUM to rank 0: only rank 0's result is defined."""
    t = rank_tensor(rank, device=device)
    before = t.clone()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    # On other ranks the buffer was used as scratch space: its contents mean nothing.
    return before, (t if rank == 0 else None)


def demo_all_gather(rank: int, world_size: int, device: torch.device) -> tuple:
    """all_gather: everyone ends with every rank's tensor, in rank order."""
    t = rank_tensor(rank, n=2, device=device)
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return t, torch.cat(out)


def demo_gather(rank: int, world_size: int, device: torch.device) -> tuple:
    """gather to rank 0: only rank 0 receives every rank's tensor."""
    t = rank_tensor(rank, n=2, device=device)
    out = [torch.empty_like(t) for _ in range(world_size)] if rank == 0 else None
    dist.gather(t, gather_list=out, dst=0)
    return t, (torch.cat(out) if rank == 0 else None)


def demo_scatter(rank: int, world_size: int, device: torch.device) -> tuple:
    """scatter from rank 0: rank r receives chunk r of rank 0's tensor."""
    full = rank_tensor(0, n=2 * world_size, device=device)
    t = torch.zeros(2, device=device)
    dist.scatter(t, scatter_list=list(full.chunk(world_size)) if rank == 0 else None, src=0)
    return (full if rank == 0 else None), t


def demo_reduce_scatter(rank: int, world_size: int, device: torch.device) -> tuple:
    """reduce_scatter: chunk r of the element-wise sum lands on rank r."""
    t = rank_tensor(rank, n=2 * world_size, device=device)
    out = torch.zeros(2, device=device)
    dist.reduce_scatter(out, list(t.chunk(world_size)), op=dist.ReduceOp.SUM)
    return t, out


def demo_barrier(rank: int, world_size: int, device: torch.device) -> tuple:
    """barrier: rank r arrives 0.2 r seconds late; nobody leaves before the last one arrives."""
    dist.barrier()  # line everyone up first, so the delays below are the only skew
    time.sleep(0.2 * rank)
    # Wall-clock time, shared by all processes on this machine; float64, because float32
    # cannot hold today's epoch seconds to better than minutes.
    arrived = time.time()
    dist.barrier()
    left = time.time()
    return (torch.tensor([arrived], dtype=torch.float64),
            torch.tensor([left], dtype=torch.float64))


DEMOS = {
    "broadcast": demo_broadcast,
    "all_reduce SUM": demo_all_reduce_sum,
    "all_reduce AVG": demo_all_reduce_avg,
    "all_reduce MAX": demo_all_reduce_max,
    "reduce": demo_reduce,
    "all_gather": demo_all_gather,
    "gather": demo_gather,
    "scatter": demo_scatter,
    "reduce_scatter": demo_reduce_scatter,
    "barrier": demo_barrier,
}


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu().clone()


def collective_tour(rank: int, world_size: int) -> dict:
    """Run every demo_* collective in one group; return {name: (before, after)} on CPU."""
    with process_group(rank, world_size) as device:
        return {name: tuple(_cpu(x) for x in fn(rank, world_size, device))
                for name, fn in DEMOS.items()}


def by_collective(results: list[dict]) -> dict:
    """Reshape per-rank tour records into {name: {"before": [per rank], "after": [per rank]}}."""
    return {name: {"before": [r[name][0] for r in results],
                   "after": [r[name][1] for r in results]}
            for name in results[0]}


def expected_after(name: str, world_size: int) -> list:
    """What each rank should hold after collective `name`, computed without any communication."""
    starts = [rank_tensor(r) for r in range(world_size)]
    total = sum(starts)
    if name == "broadcast":
        return [starts[0]] * world_size
    if name == "all_reduce SUM":
        return [total] * world_size
    if name == "all_reduce AVG":
        return [total / world_size] * world_size
    if name == "all_reduce MAX":
        rolled = torch.stack([torch.tensor([3.0, 8.0, 1.0, 6.0]).roll(r)
                              for r in range(world_size)])
        return [rolled.max(0).values] * world_size
    if name == "reduce":
        return [total] + [None] * (world_size - 1)
    pairs = [rank_tensor(r, n=2) for r in range(world_size)]
    if name == "all_gather":
        return [torch.cat(pairs)] * world_size
    if name == "gather":
        return [torch.cat(pairs)] + [None] * (world_size - 1)
    if name == "scatter":
        return list(rank_tensor(0, n=2 * world_size).chunk(world_size))
    if name == "reduce_scatter":
        return list(sum(rank_tensor(r, n=2 * world_size) for r in range(world_size))
                    .chunk(world_size))
    raise ValueError(f"no expected result for {name!r}; known: {', '.join(DEMOS)}")


# ---------------------------------------------------------------- subgroups


def subgroup_sums(rank: int, world_size: int) -> dict:
    """Split the world into even and odd ranks with new_group and all-reduce inside each."""
    with process_group(rank, world_size) as device:
        evens = list(range(0, world_size, 2))
        odds = list(range(1, world_size, 2))
        # Every rank must call new_group for every group, even ones it is not in: creating a
        # group is itself a collective over the whole world.
        groups = {"evens": dist.new_group(evens), "odds": dist.new_group(odds)}
        mine = "evens" if rank % 2 == 0 else "odds"
        t = torch.tensor([float(rank)], device=device)
        dist.all_reduce(t, group=groups[mine])
        world = torch.tensor([float(rank)], device=device)
        dist.all_reduce(world)
        return {"group": mine, "members": evens if mine == "evens" else odds,
                "group_rank": dist.get_rank(groups[mine]), "group_sum": t.item(),
                "world_sum": world.item()}


# ---------------------------------------------------------------- a ring all-reduce


def ring_all_reduce(tensor: torch.Tensor, trace: list | None = None) -> torch.Tensor:
    """Sum `tensor` over all ranks in place, ring style, with only isend/recv (default group)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(n))  # views: writing a chunk writes `tensor`
    right, left = (rank + 1) % n, (rank - 1) % n
    if trace is not None:
        trace.append(tensor.detach().cpu().clone())
    # Phase 1, reduce-scatter: after n-1 steps rank r holds the full sum of chunk r+1.
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        inbox = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i], dst=right)  # isend: both neighbours send at once
        dist.recv(inbox, src=left)
        req.wait()  # chunks[send_i] must stay untouched until the send has completed
        chunks[recv_i] += inbox
        if trace is not None:
            trace.append(tensor.detach().cpu().clone())
    # Phase 2, all-gather: pass the finished chunks around until everyone has all of them.
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        req = dist.isend(chunks[send_i], dst=right)
        dist.recv(chunks[recv_i], src=left)
        req.wait()
        if trace is not None:
            trace.append(tensor.detach().cpu().clone())
    return tensor


def ring_demo(rank: int, world_size: int, n: int | None = None) -> dict:
    """Ring-all-reduce rank_tensor and record every step; compare with dist.all_reduce."""
    with process_group(rank, world_size) as device:
        n = n or 2 * world_size
        steps: list = []
        ring = ring_all_reduce(rank_tensor(rank, n=n, device=device), trace=steps)
        ref = rank_tensor(rank, n=n, device=device)
        dist.all_reduce(ref)
        return {"steps": steps, "ring": ring.cpu(), "all_reduce": ref.cpu()}


def check_all_reduce_impl(rank: int, world_size: int, impl, numel: int = 10) -> dict:
    """Run a learner's all-reduce `impl(tensor)` on random data next to dist.all_reduce."""
    with process_group(rank, world_size) as device:
        gen = torch.Generator().manual_seed(rank)
        data = torch.randn(numel, generator=gen).to(device)
        got = data.clone()
        impl(got)
        expected = data.clone()
        dist.all_reduce(expected)
        return {"got": got.cpu(), "expected": expected.cpu()}


def check_all_gather_impl(rank: int, world_size: int, impl, numel: int = 3) -> dict:
    """Run a learner's all-gather `impl(tensor) -> concatenation` next to dist.all_gather."""
    with process_group(rank, world_size) as device:
        mine = rank_tensor(rank, n=numel, device=device)
        got = impl(mine.clone())
        parts = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(parts, mine)
        return {"got": got.cpu(), "expected": torch.cat(parts).cpu()}


def time_ring_vs_builtin(rank: int, world_size: int, sizes: list[int],
                         repeats: int = 5) -> dict:
    """Median seconds of ring_all_reduce and dist.all_reduce for each size (floats per rank)."""
    with process_group(rank, world_size) as device:
        out: dict = {}
        for numel in sizes:
            out[numel] = {}
            for name, fn in (("ring (send/recv)", ring_all_reduce),
                             ("dist.all_reduce", dist.all_reduce)):
                t = torch.ones(numel, device=device)
                fn(t)  # warm-up: first call pays for connection setup
                times = []
                for _ in range(repeats):
                    dist.barrier()  # start together, so we time the collective, not skew
                    start = time.perf_counter()
                    fn(t)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - start)
                out[numel][name] = statistics.median(times)
        return out


def traffic_per_rank(world_size: int, numel: int) -> dict:
    """Elements each rank sends for one all-reduce: ring 2(N-1)/N vs gather-to-rank-0 (N-1)."""
    return {"ring, every rank": 2 * (world_size - 1) * numel / world_size,
            "naive, rank 0": (world_size - 1) * numel}
