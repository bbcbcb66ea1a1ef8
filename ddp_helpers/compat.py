"""Feature checks across the torch versions the kit supports: ask torch, never compare versions.

A lesson that needs a feature some supported torch lacks calls one of these, then takes a fallback
(`all_reduce_mean` does AVG as SUM then divide where gloo has no AVG) or says in the cell what is
missing here. Version numbers would lie for backports and nightlies; trying the feature does not.

Every answer is cached, so each check costs its probe at most once per process. The gloo checks
run their collective on a private one-rank gloo group on loopback: it needs no peer, is not
registered with torch.distributed (the learner's default group, if any, is never touched), and
costs a few milliseconds. Gloo refuses an unsupported op when it is called, whatever the group's
size, so one rank answers for many (tests/test_compat.py checks that against two real ranks).

What each torch can do with gloo on a CPU, two ranks on loopback (PyPI's wheels, Python 3.11,
measured 2026-12-01; "yes" = ran and matched DDP or the expected numbers; 2.9 = 2.9.1):

    torch                        2.4  2.5  2.6  2.7  2.8  2.9  2.10 2.11 2.12 2.13 2.14
    all_reduce ReduceOp.AVG      no   no   no   no   yes  yes  yes  yes  yes  yes  yes
    reduce_scatter (list form)   no   no   no   no   yes  yes  yes  yes  yes  yes  yes
    barrier(timeout=...)         no   no   no   no   no   no   no   no   yes  yes  yes
    FSDP2 fully_shard, CPU mesh  no1  no1  no2  x2   x2   yes  yes  yes  yes  yes  yes
    ends without a hang after
      Python comm hooks          no3  yes  yes  yes  yes  yes  yes  yes  yes  yes  yes
    CommDebugMode                _t   yes  yes  yes  yes  yes  yes  yes  yes  yes  yes
    ZeroRedundancyOptimizer, post-accumulate-grad hooks, DDP fp16 / bf16 / PowerSGD comm hooks,
    reduce_scatter_tensor, all_gather_into_tensor, monitored_barrier(timeout, wait_all_ranks):
                                 yes in every version above

    no1: "FSDP requires CUDA" (CUDA streams); no2: AttributeError ('Stream' has no record_event);
    x2: runs, but every gradient is twice DDP's (summed over the 2 ranks, never averaged);
    no3: a rank hangs in ~ProcessGroupGloo when its group dies after Python future callbacks: it
    joins a gloo thread that waits for the GIL the joining thread holds (a DDP Python comm hook:
    3 runs in 10 on 2.4.1, 7 in 20 on 2.9.0, none in 20 on every other version above; a collective
    under CommDebugMode: 5 in 8 on 2.4.1; later also on 2.9.1, in 7 of 14 runs of lesson 07's
    slow-rank test, and in none of 14 once `dh.process_group` yielded the GIL for 20 ms before
    destroying the group, as it now does; and in 4 of 100 launches of lesson 05's fixed listing,
    stuck freeing its DDP model after its own destroy_process_group, none in 100 once its
    `finish` paused the same way: `runtime.let_gloo_threads_finish`; see pytorch#190489);
    _t: only as torch.distributed._tensor.debug.
    2.9.0 to 2.10.0 print "[Gloo] Rank r is connected to 1 peer ranks..." at every init (2.11 not).

Hence the floor, torch 2.9.1: before 2.9 FSDP2 on a CPU is missing or silently wrong, and 2.9.0
can hang at the end of a run. On 2.9 to 2.11, `barrier` below stands in for barrier(timeout=).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["gloo_supports_avg", "gloo_supports_reduce_scatter", "barrier_accepts_timeout",
           "init_accepts_device_id", "fsdp2_fully_shard", "comm_debug_mode",
           "has_post_accumulate_grad_hook", "all_reduce_mean", "barrier", "report"]


@functools.cache
def _probe_group() -> dist.ProcessGroup:
    """A one-rank gloo group of this process's own, over an in-memory store."""
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    # An explicit loopback device: the default one resolves the host's name, which can be slow or
    # fail on a laptop offline or in a container.
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=10)
    return gloo(dist.HashStore(), 0, 1, options)


def _gloo_accepts(op: Callable[[dist.ProcessGroup], object]) -> bool:
    """True if gloo runs `op` on the probe group; False if it refuses it as unsupported."""
    try:
        op(_probe_group()).wait()
    except RuntimeError:  # "Cannot use ReduceOp.AVG with Gloo", "does not support ..."
        return False
    return True


@functools.cache
def gloo_supports_avg() -> bool:
    """True if gloo's all_reduce takes ReduceOp.AVG (older gloo refuses it: SUM, then divide)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    return _gloo_accepts(lambda pg: pg.allreduce([torch.ones(2)], opts))


@functools.cache
def gloo_supports_reduce_scatter() -> bool:
    """True if gloo has the list form, dist.reduce_scatter (older gloo: all_reduce, then chunk)."""
    out = torch.empty(2)
    return _gloo_accepts(lambda pg: pg.reduce_scatter([out], [[torch.ones(2)]],
                                                      dist.ReduceScatterOptions()))


def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@functools.cache
def barrier_accepts_timeout() -> bool:
    """True if dist.barrier(timeout=...) exists; else a barrier waits the group's own timeout."""
    return _accepts(dist.barrier, "timeout")


@functools.cache
def init_accepts_device_id() -> bool:
    """True if init_process_group(device_id=...) exists (binds the group to one GPU eagerly)."""
    return _accepts(dist.init_process_group, "device_id")


@functools.cache
def fsdp2_fully_shard() -> Callable | None:
    """FSDP2's fully_shard (torch.distributed.fsdp; earlier under _composable.fsdp), or None."""
    return _first_found("fully_shard", "torch.distributed.fsdp",
                        "torch.distributed._composable.fsdp")


@functools.cache
def comm_debug_mode() -> type | None:
    """CommDebugMode, the context manager that counts collectives (public since DTensor's move)."""
    return _first_found("CommDebugMode", "torch.distributed.tensor.debug",
                        "torch.distributed._tensor.debug")


def _first_found(name: str, *modules: str):
    """`name` from the first of `modules` that has it (torch moves APIs out of _private
    modules over releases), or None."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


@functools.cache
def has_post_accumulate_grad_hook() -> bool:
    """True if Tensor.register_post_accumulate_grad_hook exists (fires once .grad is complete)."""
    return hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Average `tensor` over the group in place: ReduceOp.AVG, or SUM then divide without it."""
    if dist.get_backend(group) != "gloo" or gloo_supports_avg():
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(dist.get_world_size(group))


def barrier(timeout: datetime.timedelta | None = None,
            group: dist.ProcessGroup | None = None) -> None:
    """A barrier that gives up after `timeout`: dist.barrier's own timeout where it has one.

    Without it (torch before 2.12), gloo's monitored_barrier takes a timeout and names the ranks
    that never came; other backends wait for the group's timeout, set at init.
    """
    if timeout is not None and barrier_accepts_timeout():
        dist.barrier(group=group, timeout=timeout)
    elif timeout is not None and dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timeout)
    else:
        dist.barrier(group=group)


def report() -> dict[str, bool]:
    """Every check by name, True where this torch has the feature (lesson 00 can print it)."""
    return {"gloo all_reduce AVG": gloo_supports_avg(),
            "gloo reduce_scatter": gloo_supports_reduce_scatter(),
            "barrier(timeout=...)": barrier_accepts_timeout(),
            "init_process_group(device_id=...)": init_accepts_device_id(),
            "FSDP2 fully_shard": fsdp2_fully_shard() is not None,
            "CommDebugMode": comm_debug_mode() is not None,
            "post-accumulate-grad hooks": has_post_accumulate_grad_hook()}
