"""Timing that is right on GPUs: CUDA events there, time.perf_counter on the CPU.

CUDA kernels run asynchronously: a CPU clock read just after launching GPU work measures the
launch, not the work (that is how DDP's all-reduce once "took 0.00 s"). Every timer here puts
marks on the device's own timeline (a recorded CUDA event, or perf_counter() on the CPU), and
waits for the GPU in one place only, `_seconds_between`, when a time is read.

    with dh.Timer(device) as t:          # any work on `device`
        y = model(x)
    print(dh.format_seconds(t.seconds))  # reading it waits for the GPU, here and only here

    times = dh.time_allreduce(ddp_model)  # a comm hook: DDP's own all-reduce, with marks
    loss.backward(); opt.step()
    times.seconds()                      # None ("not measured") when no all-reduce ran
"""

# No `from __future__ import annotations` here: DDP checks the comm hook's annotations when it is
# registered, and string annotations fail that check.

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

NOT_MEASURED = "not measured"


def _mark(device: torch.device):
    """A point on `device`'s timeline: a recorded CUDA event, or perf_counter() on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def _seconds_between(start, end) -> float:
    """Seconds from mark `start` to mark `end`: the one place that waits for the GPU."""
    if isinstance(end, torch.cuda.Event):
        start.synchronize()
        end.synchronize()  # both events have happened on the GPU: their timestamps exist
        return start.elapsed_time(end) / 1000
    return end - start


def format_seconds(seconds: float | None) -> str:
    """'12.3 ms' or '4.56 s'; 'not measured' for None or NaN (never a made-up 0.00)."""
    if seconds is None or math.isnan(seconds):
        return NOT_MEASURED
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


class Timer:
    """Seconds of the work between start() and stop() on one device (also a `with` block)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._start = self._end = None

    def start(self) -> "Timer":
        """Mark the start (on a GPU: after the work already queued on the current stream)."""
        self._start, self._end = _mark(self.device), None
        return self

    def stop(self) -> "Timer":
        """Mark the end; nothing waits here, so work can keep flowing."""
        if self._start is None:
            raise RuntimeError("Timer.stop() before start(): call start() first, or use "
                               "`with dh.Timer(device) as t:`.")
        self._end = _mark(self.device)
        return self

    @property
    def seconds(self) -> float:
        """Seconds from start to stop; on a GPU this waits until the GPU has reached stop."""
        if self._end is None:
            raise RuntimeError("Timer.seconds read before stop(): read it after the `with` "
                               "block (or after stop()).")
        return _seconds_between(self._start, self._end)

    def __enter__(self) -> "Timer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Laps:
    """Named marks on one device's timeline: `seconds()` gives the time up to each mark."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        """Mark the end of the phase `name` (the first mark only starts the clock)."""
        self._marks.append((name, _mark(self.device)))

    def seconds(self) -> dict[str, float]:
        """{phase: seconds since the previous mark}, in the order marked; waits for the GPU."""
        pairs = zip(self._marks, self._marks[1:])
        return {name: _seconds_between(a, b) for (_, a), (name, b) in pairs}


def median_seconds(op: Callable[[], object], device: torch.device | str = "cpu",
                   iters: int = 5, trials: int = 5, warmup: int = 1) -> float:
    """Median over `trials` of the mean seconds of `iters` back-to-back op() calls."""
    for _ in range(warmup):  # first calls allocate, connect and page in: not steady state
        op()
    timer, times = Timer(device), []
    for _ in range(trials):
        with timer:
            for _ in range(iters):
                op()
        times.append(timer.seconds / iters)
    return statistics.median(times)


def copy_seconds(nbytes: int, src: torch.device | str = "cpu",
                 dst: torch.device | str | None = None, pinned: bool = False, iters: int = 5,
                 trials: int = 5) -> float:
    """Median seconds to copy `nbytes` from a buffer on `src` to one on `dst` (default: src).

    cpu->cpu is main memory's copy bandwidth; cuda:0->cuda:0 the GPU's own memory; cpu->cuda:0
    the host link (`pinned=True`: from page-locked memory, copied asynchronously); cuda:0->cuda:1
    the GPU-to-GPU link (direct when `peer_access(0, 1)`, else staged through the host).
    """
    src, dst = torch.device(src), torch.device(dst if dst is not None else src)
    a = torch.ones(max(1, nbytes // 4), device=src, pin_memory=pinned and src.type == "cpu")
    b = torch.empty(a.shape, device=dst, pin_memory=pinned and dst.type == "cpu")
    # Time on the GPU involved: a copy runs on the source GPU's stream, or for host<->GPU on
    # the GPU's; the other side's current stream is made to wait for it either way.
    clock = src if src.type == "cuda" else dst
    return median_seconds(lambda: b.copy_(a, non_blocking=pinned), clock, iters, trials)


def peer_access(a: int = 0, b: int = 1) -> bool:
    """Whether GPU `a` can read GPU `b` directly (torch then copies peer to peer, not via host)."""
    return torch.cuda.device_count() > max(a, b) and torch.cuda.can_device_access_peer(a, b)


class AllReduceTimes:
    """State of `timed_allreduce_hook`: when each gradient bucket's all-reduce ran."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group  # None: the default group, as DDP's own hook
        self._spans: list[list] = []  # [start mark, end mark or None], one per bucket

    def reset(self) -> None:
        """Forget earlier steps (call before the backward you want to time)."""
        self._spans = []

    @property
    def buckets(self) -> int:
        """How many bucket all-reduces ran since reset()."""
        return len(self._spans)

    def bucket_seconds(self) -> list[float]:
        """Per bucket, from its gradients being ready to its all-reduce done (waits for GPU)."""
        return [end - start for start, end in self._offsets()]

    def seconds(self) -> float | None:
        """Seconds during which some bucket's all-reduce was in flight; None if none ran."""
        if not self._spans:
            return None  # no_sync, or read before the first backward: nothing was measured
        total, reach = 0.0, -math.inf
        for start, end in sorted(self._offsets()):  # length of the union of the spans
            total += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return total

    def _offsets(self) -> list[tuple[float, float]]:
        if any(end is None for _, end in self._spans):
            raise RuntimeError("AllReduceTimes read while an all-reduce is still running: read "
                               "it after backward() has returned.")
        first = self._spans[0][0]
        return [(_seconds_between(first, s), _seconds_between(first, e)) for s, e in self._spans]


def timed_allreduce_hook(state: AllReduceTimes, bucket: dist.GradBucket
                         ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: what DDP does by default (average by all-reduce), with its span marked."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(state.group))
    span = [_mark(tensor.device), None]  # on the stream that produced the gradients
    state._spans.append(span)
    work = dist.all_reduce(tensor, group=state.group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        # Runs on the CPU when gloo is done; for NCCL at once, but with a current stream that
        # waits for NCCL's kernels (see Future.then), so the event lands after the all-reduce.
        span[1] = _mark(tensor.device)
        return fut.value()[0]

    return work.get_future().then(finish)


def time_allreduce(model: DistributedDataParallel,
                   group: dist.ProcessGroup | None = None) -> AllReduceTimes:
    """Register `timed_allreduce_hook` on a DDP model (before its first step); return its state."""
    times = AllReduceTimes(group)
    model.register_comm_hook(times, timed_allreduce_hook)
    return times
