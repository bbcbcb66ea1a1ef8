"""Lesson 07: where a DDP step's time goes, and the tools for a run that hangs or crashes.

The per-rank functions (first parameters `rank, world_size`) run through `dh.launch` and return
plain records; the parent-side helpers turn those into medians, bandwidths and overlap ratios.
Every time on a rank is taken with ddp_helpers.timing (CUDA events on GPUs, perf_counter on the
CPU) or with torch.profiler. bench/allreduce.py and bench/scaling.py launch the same functions
with fuller sweeps.

    torchrun --nproc-per-node 2 -m ddp_helpers.lessons.performance_and_debugging --crash-rank 1

runs `main`, a worker that raises on one rank, under `@record` (torchrun's error files).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import clean_error_text, launch, models, timing
from ..checks import Case, case
from ..exercises import exercise_check, require
from ..runtime import device_ids, gpu_count, process_group
from ..torchrun import torchrun_agents  # noqa: F401 - the notebook's torchrun
from ..training import average_gradients

PHASES = ("data", "forward", "backward", "all-reduce wait", "optimizer")
GRAD_NUMEL = 7850  # the seed model's gradient: what each step of `uneven_batches` all-reduces


# ---------------------------------------------------------------- models and data


def build_model(name: str) -> nn.Module:
    """`models.build_model(name)` ("linear", "cnn", "mlp"), seeded: the same on every rank."""
    torch.manual_seed(0)
    return models.build_model(name)


def parameter_count(name: str) -> int:
    """How many numbers one all-reduce of this model's gradients carries."""
    return models.param_count(build_model(name))


def _batches(rank: int, count: int, batch: int, device: torch.device) -> list:
    # Random MNIST-shaped batches: a step's time does not depend on what the pixels show.
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    return [(torch.randn(batch, 1, 28, 28, generator=g).to(device),
             torch.randint(0, 10, (batch,), generator=g).to(device)) for _ in range(count)]


# ---------------------------------------------------------------- 1. one step, phase by phase


def timed_step(model, opt, batch, laps: timing.Laps, manual: bool, delay_s: float = 0.0):
    """One training step with a mark on the device's timeline at the end of each phase."""
    laps.mark("start")
    x, y = batch
    time.sleep(delay_s)  # a straggler: a slow disk, a busy data worker, a noisy neighbour
    laps.mark("data")
    loss = nn.functional.cross_entropy(model(x), y)
    laps.mark("forward")
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP: the comm hook marks "backward" once the last bucket is ready
    if manual:
        laps.mark("backward")
        average_gradients(model)  # every byte is sent after backward: nothing hides it
    laps.mark("all-reduce wait")
    opt.step()
    laps.mark("optimizer")


class _Marks:
    """State of `phase_marking_hook`: this step's Laps, and the kit's all-reduce timer."""

    def __init__(self):
        self.laps: timing.Laps | None = None
        self.times = timing.AllReduceTimes()


def phase_marking_hook(state, bucket):
    """DDP comm hook: mark "backward" once the last bucket is ready, then all-reduce the bucket
    as DDP does by default, with its span timed (events on a GPU)."""
    # Unannotated on purpose: DDP checks a hook's annotations, and this module's are strings.
    if bucket.is_last():  # every gradient is computed: what follows is waiting for buckets
        state.laps.mark("backward")
    return timing.timed_allreduce_hook(state.times, bucket)


def step_phases(rank: int, world_size: int, model_name: str = "linear", steps: int = 20,
                batch: int = 64, mode: str = "ddp", slow_rank: int | None = None,
                delay_s: float = 0.0, bucket_cap_mb: float = 25.0, warmup: int = 3) -> dict:
    """Per step on this rank: seconds of each phase in PHASES, and of the all-reduce itself.

    mode="manual": a plain model and `average_gradients` after backward. mode="ddp": DDP, whose
    buckets are all-reduced during backward; "all-reduce wait" is what is left of them once the
    last gradient is computed, "all-reduce" the time any bucket was in flight. `slow_rank`
    sleeps `delay_s` while loading each batch.
    """
    if mode not in ("ddp", "manual"):
        raise ValueError(f"rank {rank}: mode must be 'ddp' or 'manual', not {mode!r}")
    with process_group(rank, world_size, verbose=False) as device:
        model, marks = build_model(model_name).to(device), _Marks()
        if mode == "ddp":
            model = DDP(model, device_ids=device_ids(device), bucket_cap_mb=bucket_cap_mb)
            model.register_comm_hook(marks, phase_marking_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        records = {p: [] for p in (*PHASES, "all-reduce")}
        buckets = 0
        for i, b in enumerate(_batches(rank, steps + warmup, batch, device)):
            marks.laps, delay = timing.Laps(device), delay_s if rank == slow_rank else 0.0
            marks.times.reset()
            timed_step(model, opt, b, marks.laps, mode == "manual", delay)
            if i < warmup:  # first steps allocate memory, and DDP rebuilds its buckets
                continue
            for phase, seconds in marks.laps.seconds().items():
                records[phase].append(seconds)
            # manual: the all-reduce is exactly the wait; ddp: the hook's spans
            comm = marks.times.seconds() if mode == "ddp" else records["all-reduce wait"][-1]
            records["all-reduce"].append(comm)
            buckets = marks.times.buckets
        return {"rank": rank, "mode": mode, "model": model_name, "device": device.type,
                "buckets": buckets, **records}


def allreduce_both_ways(rank: int, world_size: int, steps: int = 30, warmup: int = 3) -> dict:
    """The seed model's gradient averaged by hand and by DDP in the same steps, interleaved.

    Each step runs backward on a plain model and times `average_gradients` in its parts, then
    runs backward on a DDP copy and times its one bucket's all-reduce with the comm hook. Both
    all-reduce the same 7,850 floats; interleaving puts the same load on both. Returns the
    median seconds of each part, both ways marked on the device's timeline (`timing`: the
    CPU clock here, CUDA events on a GPU)."""
    with process_group(rank, world_size, verbose=False) as device:
        plain = build_model("linear").to(device)
        wrapped = DDP(build_model("linear").to(device), device_ids=device_ids(device))
        times = timing.time_allreduce(wrapped)
        parts: dict[str, list[float]] = {k: [] for k in MANUAL_PARTS + ("ddp all-reduce",)}
        for i, (x, y) in enumerate(_batches(rank, warmup + steps, 64, device)):
            plain.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(plain(x), y).backward()
            manual = _manual_parts(plain, device)
            times.reset()
            wrapped.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(wrapped(x), y).backward()
            if i >= warmup:
                for k, v in zip(MANUAL_PARTS, manual):
                    parts[k].append(v)
                parts["ddp all-reduce"].append(times.seconds())
        return {"rank": rank, **{k: statistics.median(v) for k, v in parts.items()}}


MANUAL_PARTS = ("flatten", "call until launched", "in flight", "wake-up", "divide, copy back")


def _manual_parts(model: nn.Module, device: torch.device) -> tuple[float, ...]:
    """`average_gradients`, with a mark between its parts on the device's timeline, as DDP's
    hook marks its span (async + a callback, so that "in flight" ends where the hook's span
    ends: in the future's callback; for CUDA tensors the callback's stream waits for NCCL's
    kernel, torch's `Future.then` docs say, so its event lands after the all-reduce)."""
    laps = timing.Laps(device)
    laps.mark("start")
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    laps.mark("flatten")
    work = dist.all_reduce(flat, async_op=True)
    laps.mark("call until launched")
    work.get_future().then(lambda _: laps.mark("in flight")).wait()
    laps.mark("wake-up")
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    laps.mark("divide, copy back")
    return tuple(laps.seconds()[part] for part in MANUAL_PARTS)


def phase_medians(records: list[dict]) -> list[dict[str, float]]:
    """Per rank, the median seconds of each phase and of the all-reduce (medians shrug off the
    odd slow step)."""
    return [{p: statistics.median(r[p]) for p in (*PHASES, "all-reduce")} for r in records]


def waited_longest(records: list[dict]) -> int:
    """The rank whose median all-reduce wait is longest: the one the others kept waiting."""
    medians = phase_medians(records)
    return max(range(len(medians)), key=lambda r: medians[r]["all-reduce wait"])


# ---------------------------------------------------------------- 2. buckets on a timeline


def bucket_timeline(rank: int, world_size: int, bucket_cap_mb: float = 25.0, steps: int = 4,
                    batch: int = 64, warmup: int = 2, profiled: int = 3,
                    trace_dir: str | None = None) -> dict:
    """Train `models.deep_mlp` with DDP: time `steps` steps, then profile `profiled` more.

    Returns the bucket count, each timed step's seconds, and the profiled steps' events as
    records {"step", "lane", "name", "start", "end"}, in seconds from the first profiled step's
    start. Lanes: "forward"; "compute", the backward ops (on a GPU: every kernel but NCCL's);
    "all-reduce", each bucket's (gloo's from start to completion; on a GPU NCCL's kernels).
    With `trace_dir`, each rank also writes the whole trace there as
    `cap<bucket_cap_mb>_rank<rank>.json`, for https://ui.perfetto.dev or chrome://tracing.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with process_group(rank, world_size, verbose=False) as device:
        model = DDP(build_model("mlp").to(device), device_ids=device_ids(device),
                    bucket_cap_mb=bucket_cap_mb)
        times = timing.time_allreduce(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = _batches(rank, warmup + steps + profiled, batch, device)

        def step(x, y):
            times.reset()
            opt.zero_grad(set_to_none=True)
            with record_function("forward"):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        seconds = []
        for i, b in enumerate(data[:warmup + steps]):
            with timing.Timer(device) as t:
                step(*b)
            if i >= warmup:  # DDP rebuilds its buckets after the first step
                seconds.append(t.seconds)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        dist.barrier()  # the ranks start the profiled steps together: one clock for the plot
        profiled_seconds = []
        with profile(activities=activities) as prof:
            for b in data[warmup + steps:]:
                with record_function("step"), timing.Timer(device) as t:
                    step(*b)
                profiled_seconds.append(t.seconds)  # the steps whose all-reduces are traced
            # gloo's thread closes the last bucket's event after DDP's wait has returned; on
            # torch 2.9.1 the profiler stopped first and lost it for 4 of 32 ranks, 0 of 80
            # with this barrier (and 0 of 32 without it on 2.14). The barrier costs nothing
            # the plot shows: it runs after the last "step" range.
            dist.barrier()
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, trace_name(bucket_cap_mb, rank)))
        return {"rank": rank, "bucket_cap_mb": bucket_cap_mb, "buckets": times.buckets,
                "device": device.type, "step_seconds": seconds,
                "profiled_step_seconds": profiled_seconds,
                "events": _timeline(prof.events(), device.type)}


def trace_name(bucket_cap_mb: float, rank: int) -> str:
    """The file `bucket_timeline` writes a rank's trace to, inside its `trace_dir`."""
    return f"cap{bucket_cap_mb:g}_rank{rank}.json"


def _on_gpu(e) -> bool:
    return getattr(e.device_type, "name", "CPU") == "CUDA"


def _lane(e, device_type: str) -> str | None:
    if e.name == "forward":  # the CPU's range (a GPU trace repeats annotations on the GPU)
        return None if _on_gpu(e) else "forward"
    if device_type == "cuda":  # kernels: NCCL's are the all-reduces, the rest compute
        if not _on_gpu(e):
            return None
        return "all-reduce" if "nccl" in e.name.lower() else "compute"
    if e.name.endswith(":all_reduce"):  # gloo:all_reduce, run by gloo's own threads
        return "all-reduce"
    return "compute" if e.name.startswith("autograd::engine::evaluate_function") else None


def _timeline(events, device_type: str) -> list[dict]:
    """The profiled steps' events by lane, in seconds from the first step's start."""
    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == "step" and not _on_gpu(e))
    zero, out = steps[0][0], []
    for e in events:
        lane = _lane(e, device_type)
        if lane is None:
            continue
        # The step it belongs to: the last one that started before it (GPU work runs late).
        index = max(i for i, (a, _) in enumerate(steps) if a <= e.time_range.start) \
            if e.time_range.start >= zero else 0
        out.append({"step": index, "lane": lane, "name": e.name,
                    "start": (e.time_range.start - zero) / 1e6,
                    "end": (e.time_range.end - zero) / 1e6})
    return sorted(out, key=lambda r: r["start"])


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def exposed_spans(events: list[dict]) -> list[tuple[float, float]]:
    """The stretches with an all-reduce in flight and no backward compute beside it."""
    work = _union([(e["start"], e["end"]) for e in events if e["lane"] == "compute"])
    spans = []
    for a, b in _union([(e["start"], e["end"]) for e in events if e["lane"] == "all-reduce"]):
        for c, d in work:
            if c > a:
                spans.append((a, min(b, c)))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            spans.append((a, b))
    return [(a, b) for a, b in spans if b > a]


def overlap(events: list[dict], step: int | None = None) -> dict:
    """Seconds with an all-reduce in flight, and how many of them no backward compute
    overlapped: the exposed wait, which the step pays on top of its compute. Without `step`,
    the median over the profiled steps."""
    if step is None:
        per_step = [overlap(events, s) for s in sorted({e["step"] for e in events})]
        return {k: statistics.median(p[k] for p in per_step) for k in per_step[0]}
    mine = [e for e in events if e["step"] == step]
    total = sum(b - a for a, b in _union([(e["start"], e["end"]) for e in mine
                                          if e["lane"] == "all-reduce"]))
    exposed = sum(b - a for a, b in exposed_spans(mine))
    return {"all-reduce": total, "exposed": exposed,
            "exposed_ratio": exposed / total if total else float("nan")}


def sweep_summary(sweep: dict[float, list[dict]]) -> list[dict]:
    """One row per (bucket_cap_mb, rank): buckets, and, over the same profiled steps, the median
    step seconds, all-reduce seconds and share of them exposed (so an all-reduce never reads
    longer than the steps it was part of)."""
    rows = []
    for cap, records in sweep.items():
        for r in records:
            o = overlap(r["events"])
            rows.append({"bucket_cap_mb": cap, "rank": r["rank"], "buckets": r["buckets"],
                         "step": statistics.median(r["profiled_step_seconds"]),
                         "all-reduce": o["all-reduce"], "exposed_ratio": o["exposed_ratio"]})
    return rows


# ---------------------------------------------------------------- 3. all-reduce bandwidth


def allreduce_sweep(rank: int, world_size: int, sizes_bytes: list[int], iters: int = 5,
                    trials: int = 5, copy_bytes: int | None = None) -> dict:
    """Median seconds of one all_reduce per size; then rank 0 times the reference copies.

    Rank 0 copies `copy_bytes` (default: 64 MiB or the largest size) within its device: main
    memory on the CPU, the GPU's own memory on a GPU. With two GPUs it also copies
    cuda:0 -> cuda:1, the link between them (peer to peer when peer access is on).
    """
    copy_bytes = copy_bytes or max(64 << 20, max(sizes_bytes))
    with process_group(rank, world_size, verbose=False, timeout_s=120) as device:
        seconds = []
        for nbytes in sizes_bytes:
            t = torch.ones(max(1, nbytes // 4), device=device)
            dist.barrier()  # every rank starts each size together
            seconds.append(timing.median_seconds(lambda t=t: dist.all_reduce(t), device,
                                                 iters, trials))
        dist.barrier()
        record = {"rank": rank, "backend": dist.get_backend(), "device": device.type,
                  "world_size": world_size, "sizes_bytes": list(sizes_bytes),
                  "seconds": seconds, "copy_bytes": copy_bytes, "copy_seconds": None,
                  "link_seconds": None, "peer_access": None}
        if rank == 0:  # after the last collective: nothing else runs on this device now
            record["copy_seconds"] = timing.copy_seconds(copy_bytes, device)
            if device.type == "cuda" and gpu_count() >= 2:
                record["peer_access"] = timing.peer_access(0, 1)
                record["link_seconds"] = timing.copy_seconds(max(sizes_bytes), "cuda:0",
                                                             "cuda:1")
        return record


def sweep_sizes(gpus: bool) -> list[int]:
    """4 KiB, 16 KiB, ... up to 16 MiB on CPUs (a minute's budget), 256 MiB with NCCL on GPUs,
    where large messages reach the link's bandwidth."""
    top = 256 << 20 if gpus else 16 << 20
    return [4 << (10 + 2 * k) for k in range(20) if 4 << (10 + 2 * k) <= top]


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each byte crosses 2(N-1)/N links in a ring."""
    return 2 * (world_size - 1) / world_size


BUS_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor_of(op: str, world_size: int) -> float:
    """busbw / algbw for a collective on N ranks, as nccl-tests defines it (doc/PERFORMANCE.md):
    2(N-1)/N for all-reduce, (N-1)/N for all-gather and reduce-scatter (S being the whole
    gathered or scattered buffer), 1 for broadcast and reduce."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
               "reduce_scatter": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    if op not in factors:
        raise ValueError(f"no bus factor for {op!r}: one of {sorted(factors)}")
    return factors[op]


def bandwidths(records: list[dict]) -> dict:
    """algbw and busbw (GB/s) per size from the slowest rank's time, and the references."""
    r0, world_size = records[0], records[0]["world_size"]
    sizes = r0["sizes_bytes"]
    # A collective is done when its last rank is done: use the slowest rank's time.
    slowest = [max(r["seconds"][i] for r in records) for i in range(len(sizes))]
    algbw = [s / t / 1e9 for s, t in zip(sizes, slowest)]
    link = r0.get("link_seconds")
    return {"world_size": world_size, "backend": r0["backend"], "device": r0["device"],
            "sizes_bytes": sizes, "seconds": slowest, "algbw": algbw,
            "busbw": [a * bus_factor(world_size) for a in algbw],
            "copy_gbps": r0["copy_bytes"] / r0["copy_seconds"] / 1e9,
            "link_gbps": max(sizes) / link / 1e9 if link else None,
            "peer_access": r0.get("peer_access")}


def reference_line(bw: dict, gpus: int) -> str:
    """What the best busbw is compared with, in one sentence, for this machine."""
    best = max(bw["busbw"])
    if bw.get("link_gbps"):
        peer = "on" if bw["peer_access"] else "off: staged through the host"
        return (f"cuda:0 -> cuda:1 copy (the link; peer access {peer}): {bw['link_gbps']:.1f} "
                f"GB/s; best busbw is {best / bw['link_gbps']:.0%} of it. The on-device copy, "
                f"{bw['copy_gbps']:.0f} GB/s, is the GPU's own memory, not a link.")
    line = (f"main-memory copy on rank 0: {bw['copy_gbps']:.2f} GB/s; best busbw is "
            f"{best / bw['copy_gbps']:.0%} of it")
    if gpus == 1:
        line += (". One GPU: NCCL needs one per rank, so this ran gloo on the CPU, and the link "
                 "reference (a cuda:0 -> cuda:1 copy) needs two GPUs")
    return line


# ---------------------------------------------------------------- 4. scaling


def train_throughput(rank: int, world_size: int, model_name: str = "linear", steps: int = 30,
                     batch: int = 64, warmup: int = 5, threads: int | None = 1) -> dict:
    """Seconds this rank took for `steps` DDP steps of `batch` samples each.

    On the CPU each rank gets `threads` intra-op threads: 1 (the default) gives N ranks N
    cores, the resources scaling efficiency assumes; None leaves the kit's split of the cores.
    """
    with process_group(rank, world_size, verbose=False, timeout_s=120) as device:
        if device.type == "cpu" and threads is not None:
            torch.set_num_threads(threads)
        model = DDP(build_model(model_name).to(device), device_ids=device_ids(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = _batches(rank, steps + warmup, batch, device)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for b in data[:warmup]:
            step(*b)
        dist.barrier()  # every rank starts the clock together
        with timing.Timer(device) as t:
            for b in data[warmup:]:
                step(*b)
        return {"rank": rank, "model": model_name, "seconds": t.seconds,
                "samples": steps * batch, "threads": torch.get_num_threads(),
                "device": device.type}


def throughput(records: list[dict]) -> float:
    """Samples per second of the whole job: every rank's samples over the slowest rank's time."""
    return sum(r["samples"] for r in records) / max(r["seconds"] for r in records)


def scaling_efficiency(throughput_n: float, throughput_1: float, n: int) -> float:
    """Throughput with n ranks over n times the throughput of one: 1.0 is perfect scaling."""
    return throughput_n / (n * throughput_1)


# ---------------------------------------------------------------- 5. a hang, and a crash


def uneven_batches(rank: int, world_size: int, batches_per_rank: list[int],
                   timeout_s: float = 60) -> float:
    """Run batches_per_rank[rank] gradient all-reduces, then the end-of-epoch barrier."""
    with process_group(rank, world_size, verbose=False, timeout_s=timeout_s) as device:
        loss = torch.zeros(1)
        for step in range(batches_per_rank[rank]):
            print(f"step {step}: all_reduce of the gradients", flush=True)
            dist.all_reduce(torch.ones(GRAD_NUMEL, device=device))
            loss += 1.0
        print("end of epoch: barrier", flush=True)
        dist.barrier()  # a rank with fewer batches waits here for a peer still in all_reduce
        return loss.item()


def load_shard(rank: int, world_size: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a small regression data set: (features, targets), three features of
    whole numbers 0-9 and their sum as the target. Rank 1's shard is bad on purpose (what
    section 6 debugs): the sensor behind its column 1 was stuck and reports 5 on every row."""
    g = torch.Generator().manual_seed(rank)
    raw = torch.randint(0, 10, (rows, 3), generator=g).float()
    if rank == 1:
        raw[:, 1] = 5.0
    return raw, raw.sum(1)


def never_arrives(rank: int, world_size: int, timeout_s: float = 10) -> None:
    """One all-reduce together; then rank 1 is stuck in Python while rank 0 all-reduces again."""
    with process_group(rank, world_size, verbose=False, timeout_s=timeout_s) as device:
        t = torch.ones(GRAD_NUMEL, device=device)
        dist.all_reduce(t)
        if rank == 1:
            time.sleep(10 * timeout_s)  # a deadlocked data worker, an endless loop...
        dist.all_reduce(t)  # rank 0 waits here until the group's timeout
        if t.is_cuda:
            torch.cuda.synchronize()  # NCCL returns at once: the wait is on the GPU


def crash_on_rank(bad_rank: int) -> None:
    """What each torchrun worker runs: an all-reduce, then rank `bad_rank` raises."""
    with process_group(verbose=False) as device:  # RANK and WORLD_SIZE come from torchrun
        dist.all_reduce(torch.ones(1, device=device))
        if dist.get_rank() == bad_rank:
            raise ValueError(f"rank {bad_rank}: a corrupt batch (raised on purpose)")
        dist.barrier()  # the other ranks wait here for the rank that raised


@record  # on an exception: write it to $TORCHELASTIC_ERROR_FILE, where torchrun reads it
def main(argv: list[str] | None = None) -> int:
    """torchrun's entry point: every worker runs crash_on_rank(--crash-rank)."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.lessons.performance_and_debugging")
    p.add_argument("--crash-rank", type=int, default=1)
    crash_on_rank(p.parse_args(argv).crash_rank)
    return 0


def error_files(log_dir: str | os.PathLike) -> dict[int, dict]:
    """The error files @record wrote under a torchrun --log-dir: {local rank: {"error",
    "where"}}, the error's first line and the innermost frame of the kit's code."""
    found = {}
    for path in sorted(Path(log_dir).glob("*/attempt_*/*/error.json")):
        message = json.loads(path.read_text())["message"]
        frames = [ln.strip() for ln in message["extraInfo"]["py_callstack"].splitlines()
                  if ln.strip().startswith("File ") and "ddp_helpers" in ln]
        found[int(path.parent.name)] = {
            "error": clean_error_text(message["message"]).splitlines()[0],
            "where": frames[-1].rsplit(", in ", 1)[-1] if frames else None}
    return found


def flight_records(folder: str | os.PathLike, last: int = 3) -> dict[int, list[dict]]:
    """Per rank, the last entries of the NCCL flight recorder's dumps (nccl_trace_rank_<r>)."""
    keys = ("collective_seq_id", "profiling_name", "state", "input_sizes")
    found = {}
    for path in sorted(Path(folder).glob("nccl_trace_rank_*")):
        try:
            dump = pickle.loads(path.read_bytes())  # a file this notebook's own ranks wrote
        except (pickle.UnpicklingError, EOFError):  # half written, or another format
            continue
        found[int(path.name.rsplit("_", 1)[1])] = [{k: e.get(k) for k in keys}
                                                   for e in dump.get("entries", [])[-last:]]
    return found


# ---------------------------------------------------------------- exercises


# (batches per rank, on as many ranks): 2 ranks; 3 with the fewest in the middle; a rank with
# none; equal counts. Each rank is told only its own count (see _even_batches_run).
EVEN_CASES = ([2, 3], [4, 1, 3], [3, 0, 2], [3, 3])


def _even_batches_run(rank: int, world_size: int, fn, batches_per_rank: list[int]) -> dict:
    """fn on this rank, told only its own count (the others' entries None: a rank knows the
    length of its own loader, not its peers'), under a Ledger: the loss it returned and how
    many gradient all-reduces (7,850 numbers) it called."""
    from ..ledger import Ledger

    own = [n if r == rank else None for r, n in enumerate(batches_per_rank)]
    with Ledger() as ledger:
        loss = fn(rank, world_size, own)
    steps = sum(c.op == "all_reduce" and c.shapes == ((GRAD_NUMEL,),) for c in ledger.calls)
    last = ledger.calls[-1] if ledger.calls else None
    numel = sum(torch.Size(shape).numel() for shape in last.shapes) if last else 0
    return {"loss": loss, "steps": steps,
            "last": f"{last.op} of {numel} number(s)" if last else "no collective",
            "sums_loss": last is not None and last.op in ("all_reduce", "all_gather")
            and numel == 1}


def _launch_failure(e: Exception) -> str:
    """A failed run in one line: what a rank raised, or the collectives that did not match."""
    if getattr(e, "exc_type", None):
        return f"rank {e.rank} raised {e.exc_type}: {(e.exc_message.splitlines() or [''])[0]}"
    return clean_error_text(str(e)).split(". The collective")[0].splitlines()[0]


@exercise_check("even_batches", "file")
def check_even_batches(module) -> list:
    """On 2 and 3 ranks, each told only its own batch count: every rank runs min(counts)
    all-reduces of the gradient (seen in its Ledger) and returns the loss summed over ranks
    (a number, or a tensor holding one number in any shape)."""
    fn = require(module, "even_batches")
    cases = []
    for batches in EVEN_CASES:
        n = len(batches)
        label = f"{n} ranks with {batches} batches, each told its own"
        try:
            runs = launch(_even_batches_run, args=(n, fn, batches), nprocs=n, timeout=60,
                          output="none")
        except Exception as e:  # noqa: BLE001 - a hang named by the kit, or a rank that raised
            cases.append(Case(label, False, _launch_failure(e)))
            continue
        cases.append(case(f"{label}: gradient all-reduces on ranks 0..{n - 1}",
                          [r["steps"] for r in runs], [min(batches)] * n))
        cases.append(case(f"{label}: the loss each rank returned",
                          [_number(r["loss"]) for r in runs], [float(min(batches) * n)] * n))
        # Every rank's loss is min(counts) x 1.0, so min(counts) x world_size gives the right
        # number with no message: the exercise's end-of-epoch collective is the loss's own.
        for r, run in enumerate(runs):
            cases.append(Case(f"{label}: rank {r} ends with the loss's all-reduce",
                              run["sums_loss"],
                              f"rank {r}'s last collective was {run['last']}: after the "
                              "gradient all-reduces, all-reduce the loss (one number) and "
                              "return the result"))
    return cases


def _number(loss):
    """A loss given as a one-element tensor of any shape ([], [1], [1, 1]) read as its number,
    as loss.item() reads it: the exercise asks for the value, not for one shape of it."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.item()
    return loss


# What was all-reduced, and in how long: the function takes bytes, so a bfloat16 or float64
# tensor's bytes are its numel times 2 or 8. Odd N = 3 too: 2(N-1)/N is 1 for N = 2 only.
BUS_CASES = (("float32", 1 << 20, 2e-3, 2), ("bfloat16", 25_165_824, 37.5e-3, 3),
             ("float64", 8 << 20, 5e-3, 4), ("float32", 1 << 28, 0.08, 8))


@exercise_check("bus_bandwidth", "file")
def check_bus_bandwidth(module) -> list:
    """busbw = bytes / seconds / 1e9 x 2(N-1)/N, for tensors of three dtypes on 2, 3, 4 and 8
    ranks; a FAIL shows algbw and the factor beside the expected value."""
    fn = require(module, "bus_bandwidth")
    cases = []
    for dtype, numel, seconds, n in BUS_CASES:
        nbytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        label = (f"{dtype}[{numel:,}] ({nbytes:,} bytes) all-reduced in {seconds * 1e3:g} ms "
                 f"on {n} ranks")
        algbw = nbytes / seconds / 1e9
        expected, got = algbw * bus_factor(n), fn(nbytes, seconds, n)
        c = case(label, got, expected, rtol=1e-9, atol=0)
        if not c.ok and isinstance(got, (int, float)):
            c.detail = (f"got {got:.6g} GB/s, expected {expected:.6g} = algbw {algbw:.6g} GB/s "
                        f"x 2(N-1)/N = {bus_factor(n):.4g} "
                        f"(yours is {got / expected:.4g} times that)")
        cases.append(c)
    return cases


if __name__ == "__main__":
    sys.exit(main())
