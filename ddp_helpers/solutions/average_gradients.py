"""Solution (lesson 12, bug 3): all_reduce sums; the mean over the ranks divides by their number,
asked of torch (never written as 2)."""

import torch.distributed as dist


def average_gradients(model):
    """Each parameter's gradient replaced by its mean over the ranks."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
