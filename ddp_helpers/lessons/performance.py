"""Lesson 07 (first half): where one training step's time goes, all-reduce bandwidth, scaling.

The per-rank functions (first parameters `rank, world_size`) run through `dh.launch`; the rest
are parent-side helpers that turn their records into medians, bandwidths and efficiencies. The
benchmark scripts in bench/ launch the same functions with fuller sweeps.

Data are random tensors of MNIST's shape: a step's time does not depend on what the pixels
show, and the lesson then runs anywhere without a download.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from .. import models
from ..runtime import process_group

PHASES = ("data", "forward", "backward", "all-reduce wait", "optimizer")


# ---------------------------------------------------------------- models


# The kit's two models (ddp_helpers.models) under the names this lesson prints: the seed's
# Flatten + Linear(784, 10), and a CNN with ~3x its parameters but ~100x its compute.
MODELS = {"seed": models.seed_model, "cnn": models.small_cnn}


def build_model(name: str) -> nn.Module:
    """A fresh model by name ("seed" or "cnn"), seeded so every rank builds the same one."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name]()


def parameter_count(name: str) -> int:
    """How many numbers one all-reduce of this model's gradients carries."""
    return sum(p.numel() for p in build_model(name).parameters())


# ---------------------------------------------------------------- rank-side plumbing


def _share_cores(device: torch.device, world_size: int, threads: int | None = None) -> int:
    """Set this rank's intra-op threads: `threads`, or its share of the cores (CPU only)."""
    if device.type == "cuda":
        return torch.get_num_threads()
    if threads is None:  # N ranks never fight over the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    return threads


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: a CPU timer needs the GPU finished first.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loader(rank: int, steps: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    x = torch.randn(steps * batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g)


def _stamping_allreduce(stamps: list, bucket):
    """DDP comm hook: note when each gradient bucket is ready, then all-reduce it as usual."""
    stamps.append(time.perf_counter())
    return default_hooks.allreduce_hook(None, bucket)  # None: the default group


# ---------------------------------------------------------------- 1. one step, phase by phase


def step_phases(rank: int, world_size: int, model_name: str = "seed", steps: int = 20,
                batch: int = 64, mode: str = "ddp", slow_rank: int | None = None,
                delay_s: float = 0.0, bucket_cap_mb: float = 25.0, warmup: int = 3) -> dict:
    """Time data, forward, backward, all-reduce wait and optimizer for each step on this rank.

    mode="manual": backward on a plain model, then one all_reduce of all gradients, so every
    byte of communication is waited for. mode="ddp": DDP starts each bucket's all-reduce while
    backward still runs; the wait is only what is left when the last bucket becomes ready.
    `slow_rank` sleeps `delay_s` while loading each batch: a straggler the others wait for.
    """
    if mode not in ("ddp", "manual"):
        raise ValueError(f"rank {rank}: mode must be 'ddp' or 'manual', not {mode!r}")
    with process_group(rank, world_size, verbose=False) as device:
        threads = _share_cores(device, world_size)
        model = build_model(model_name).to(device)
        stamps: list[float] = []
        if mode == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            model = DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
            model.register_comm_hook(stamps, _stamping_allreduce)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        records = {p: [] for p in PHASES}
        buckets = []
        batches = iter(_loader(rank, steps + warmup, batch))
        for step in range(steps + warmup):
            t0 = time.perf_counter()
            x, y = next(batches)
            if rank == slow_rank:
                time.sleep(delay_s)  # a slow disk, a busy data worker, a noisy neighbour...
            x, y = x.to(device), y.to(device)
            _sync(device)
            t1 = time.perf_counter()
            loss = loss_fn(model(x), y)
            _sync(device)
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            stamps.clear()
            loss.backward()
            _sync(device)
            t3 = time.perf_counter()
            if mode == "manual":
                average_gradients(model, world_size)
                _sync(device)
                t_ready, t4 = t3, time.perf_counter()
            else:
                # The last bucket's hook marks the end of gradient computation; what follows
                # until backward() returns is waiting for all-reduces still in flight.
                t_ready, t4 = (stamps[-1] if stamps else t3), t3
            opt.step()
            _sync(device)
            t5 = time.perf_counter()
            if step < warmup:  # first steps allocate memory and (DDP) rebuild buckets
                continue
            buckets.append(len(stamps))
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t_ready - t2, t4 - t_ready,
                                              t5 - t4)):
                records[name].append(seconds)
        return {"rank": rank, "mode": mode, "model": model_name, "threads": threads,
                "device": device.type, "buckets": max(buckets) if buckets else 0, **records}


def average_gradients(model: nn.Module, world_size: int) -> None:
    """What DDP does for you, in one piece: flatten, all-reduce, divide, copy back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def phase_medians(records: list[dict]) -> list[dict[str, float]]:
    """Per rank, the median seconds of each phase (medians shrug off the odd slow step)."""
    return [{p: statistics.median(r[p]) for p in PHASES} for r in records]


def waited_longest(records: list[dict]) -> int:
    """The rank whose median all-reduce wait is longest: the one the others kept waiting."""
    medians = phase_medians(records)
    return max(range(len(medians)), key=lambda r: medians[r]["all-reduce wait"])


# ---------------------------------------------------------------- 2. all-reduce bandwidth


class _Timer:
    """Seconds between start() and stop(): CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000
        return time.perf_counter() - self.t0


def _median_time(device: torch.device, op, iters: int, trials: int) -> float:
    """Median over `trials` of the mean time of `iters` back-to-back calls of op()."""
    timer, times = _Timer(device), []
    for _ in range(trials):
        timer.start()
        for _ in range(iters):
            op()
        times.append(timer.stop() / iters)
    return statistics.median(times)


def copy_seconds(device: torch.device, nbytes: int, iters: int = 5, trials: int = 5) -> float:
    """Median seconds to copy nbytes from one buffer to another on this device."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    return _median_time(device, lambda: dst.copy_(src), iters, trials)


def allreduce_sweep(rank: int, world_size: int, sizes_bytes: list[int], iters: int = 5,
                    trials: int = 5, copy_bytes: int | None = None) -> dict:
    """Median seconds of one all_reduce for each size; rank 0 also times a plain memory copy.

    The copy moves `copy_bytes` (default: 64 MiB or the largest size), more than the caches
    hold, so it measures main memory.
    """
    copy_bytes = copy_bytes or max(64 << 20, max(sizes_bytes))
    with process_group(rank, world_size, verbose=False, timeout_s=120) as device:
        _share_cores(device, world_size)
        seconds = []
        for nbytes in sizes_bytes:
            t = torch.ones(max(1, nbytes // 4), device=device)
            dist.all_reduce(t)  # warm-up: connections, buffers, first-touch pages
            dist.barrier()
            seconds.append(_median_time(device, lambda t=t: dist.all_reduce(t), iters, trials))
        copy = None
        # The copy runs on rank 0 alone while the others wait: one core's memory bandwidth,
        # the same run, the same moment.
        if rank == 0:
            copy = copy_seconds(device, copy_bytes)
        dist.barrier()
        return {"rank": rank, "backend": dist.get_backend(), "device": device.type,
                "world_size": world_size, "sizes_bytes": list(sizes_bytes), "seconds": seconds,
                "copy_bytes": copy_bytes, "copy_seconds": copy}


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each byte crosses 2(N-1)/N links in a ring."""
    return 2 * (world_size - 1) / world_size


def bandwidths(records: list[dict]) -> dict:
    """algbw and busbw (GB/s) per size, from the slowest rank's time, plus the copy bandwidth."""
    world_size = records[0]["world_size"]
    sizes = records[0]["sizes_bytes"]
    # A collective is done when its last rank is done: use the slowest rank's time.
    slowest = [max(r["seconds"][i] for r in records) for i in range(len(sizes))]
    algbw = [s / t / 1e9 for s, t in zip(sizes, slowest)]
    busbw = [a * bus_factor(world_size) for a in algbw]
    copy = records[0]["copy_bytes"] / records[0]["copy_seconds"] / 1e9
    return {"world_size": world_size, "backend": records[0]["backend"],
            "device": records[0]["device"], "sizes_bytes": sizes, "seconds": slowest,
            "algbw": algbw, "busbw": busbw, "copy_gbps": copy}


# ---------------------------------------------------------------- 3. scaling


def train_throughput(rank: int, world_size: int, model_name: str = "seed", steps: int = 30,
                     batch: int = 64, warmup: int = 5, threads: int | None = 1) -> dict:
    """Seconds this rank took for `steps` DDP training steps of `batch` samples each.

    On the CPU each rank gets `threads` intra-op threads: 1 (the default) gives N ranks N
    cores, the resources scaling efficiency assumes; None shares all cores among the ranks.
    """
    with process_group(rank, world_size, verbose=False, timeout_s=120) as device:
        threads = _share_cores(device, world_size, threads)
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(build_model(model_name).to(device), device_ids=ids)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        batches = [(x.to(device), y.to(device)) for x, y in _loader(rank, steps + warmup, batch)]

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        for x, y in batches[:warmup]:
            step(x, y)
        dist.barrier(timeout=timedelta(seconds=60))  # every rank starts the clock together
        _sync(device)
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            step(x, y)
        _sync(device)
        return {"rank": rank, "model": model_name, "seconds": time.perf_counter() - t0,
                "samples": steps * batch, "threads": threads, "device": device.type}


def throughput(records: list[dict]) -> float:
    """Samples per second of the whole job: every rank's samples over the slowest rank's time."""
    return sum(r["samples"] for r in records) / max(r["seconds"] for r in records)


def scaling_efficiency(throughput_n: float, throughput_1: float, n: int) -> float:
    """Throughput with n ranks over n times the throughput of one: 1.0 is perfect scaling."""
    return throughput_n / (n * throughput_1)


# ---------------------------------------------------------------- 4. the profiler's view


def profile_steps(rank: int, world_size: int, model_name: str = "cnn", steps: int = 3,
                  batch: int = 64, top: int = 8) -> dict:
    """Run DDP steps under torch.profiler; return the costliest ops and the all-reduce count."""
    from torch.profiler import ProfilerActivity, profile

    with process_group(rank, world_size, verbose=False) as device:
        _share_cores(device, world_size)
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(build_model(model_name).to(device), device_ids=ids)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = [(x.to(device), y.to(device)) for x, y in _loader(rank, steps + 2, batch)]

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for x, y in batches[:2]:  # warm-up outside the profile: DDP rebuilds buckets once
            step(x, y)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for x, y in batches[2:]:
                step(x, y)
        events = prof.key_averages()
        rows = sorted(((e.key, e.count, e.cpu_time_total / 1000) for e in events),
                      key=lambda r: -r[2])
        # gloo:all_reduce on CPU, nccl:all_reduce on GPUs: the backend's own record
        allreduce = sum(e.count for e in events if re.match(r"\w+:all_reduce$", e.key))
        return {"rank": rank, "top": rows[:top], "all_reduce_calls": allreduce, "steps": steps}
