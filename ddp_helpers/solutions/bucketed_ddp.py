"""Exercise (lesson 09): gradients grouped in buckets, each all-reduced as soon as it is full."""

import torch
import torch.distributed as dist


def make_buckets(model: torch.nn.Module, bucket_mb: float) -> list[list[torch.Tensor]]:
    """Parameters that get a gradient, last layer first (backward's order), cut into buckets:
    a bucket is closed once it holds bucket_mb MiB or more (DDP's rule)."""
    buckets, current, size = [], [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def attach_bucket_hooks(model: torch.nn.Module, buckets: list) -> list:
    """Hooks that start one asynchronous all-reduce per bucket, when its last gradient is ready.
    Return the list they fill with (bucket, flat buffer, work)."""
    pending, ready = [], [0] * len(buckets)
    where = {p: i for i, bucket in enumerate(buckets) for p in bucket}

    def grad_ready(p: torch.Tensor) -> None:
        i = where[p]
        ready[i] += 1
        if ready[i] == len(buckets[i]):  # the bucket is complete: send it
            ready[i] = 0  # for the next backward
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            pending.append((buckets[i], flat, dist.all_reduce(flat, async_op=True)))

    for p in where:
        p.register_post_accumulate_grad_hook(grad_ready)
    return pending


def finish_buckets(pending: list) -> None:
    """Before optimizer.step(): wait for each bucket, then copy its mean back into the gradients."""
    for bucket, flat, work in pending:
        work.wait()
        flat /= dist.get_world_size()
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    pending.clear()
