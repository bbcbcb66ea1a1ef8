"""Per-rank functions for test_timing.py and test_runtime.py's device tests (importable: the
launcher's ranks import them by module and name)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_helpers as dh


def group_device(rank, world_size, device=None):
    """What process_group chose on this rank, and an all_reduce of rank + 1 on that device."""
    with dh.process_group(rank, world_size, verbose=False, device=device) as where:
        t = torch.tensor([rank + 1.0], device=where)
        dist.all_reduce(t)
        bound = getattr(dist.group.WORLD, "bound_device_id", None)  # NCCL's device_id
        return {"backend": dist.get_backend(), "device": str(where), "sum": t.item(),
                "tensor_device": str(t.device), "bound": str(bound) if bound is not None else None,
                "current": torch.cuda.current_device() if where.type == "cuda" else None,
                "device_ids": dh.device_ids(where)}


def _model(device):
    torch.manual_seed(0)  # every rank, and both models on a rank, start from the same weights
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def timed_ddp_steps(rank, world_size, device=None, steps=2):
    """DDP with dh.time_allreduce next to plain DDP: same gradients; the all-reduce is timed."""
    with dh.process_group(rank, world_size, verbose=False, device=device) as where:
        ids = dh.device_ids(where)
        timed = DistributedDataParallel(_model(where), device_ids=ids, bucket_cap_mb=0.0001)
        plain = DistributedDataParallel(_model(where), device_ids=ids, bucket_cap_mb=0.0001)
        times = dh.time_allreduce(timed)
        before = times.seconds()
        g = torch.Generator().manual_seed(rank)
        record = {"before": before, "seconds": [], "buckets": [], "bucket_seconds": []}
        for _ in range(steps):
            x = torch.randn(32, 8, generator=g).to(where)
            times.reset()
            for model in (timed, plain):
                model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
            record["seconds"].append(times.seconds())
            record["buckets"].append(times.buckets)
            record["bucket_seconds"].append(times.bucket_seconds())
        record["max_grad_diff"] = max((a.grad - b.grad).abs().max().item()
                                      for a, b in zip(timed.parameters(), plain.parameters()))
        times.reset()
        with timed.no_sync():  # no all-reduce at all: nothing to measure
            timed(x).sum().backward()
        record["no_sync"] = times.seconds()
        record["device"] = str(where)
        return record


def timer_on_device(rank, world_size, device=None):
    """dh.Timer and dh.Laps around a matmul on this rank's device."""
    with dh.process_group(rank, world_size, verbose=False, device=device) as where:
        a = torch.randn(256, 256, device=where)
        laps = dh.Laps(where)
        laps.mark("start")
        with dh.Timer(where) as t:
            b = a @ a
        laps.mark("matmul")
        dist.all_reduce(b)
        laps.mark("all_reduce")
        return {"timer": t.seconds, "laps": laps.seconds(), "device": str(where)}
