"""Solution (lesson 12, bug 4): the ranks agree on the smallest batch count before the loop, so
every rank makes the same number of all-reduces and reaches the barrier together. (With DDP,
torch's Join context manager is the other way: ranks that run out shadow the others' calls.)"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_helpers.lessons.debugging_lab import average_gradients


def train_epoch(model, opt, batches):
    """One epoch of averaged SGD steps, as many on every rank."""
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # every rank learns the smallest count
    for x, y in batches[:int(steps)]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        average_gradients(model)
        opt.step()
    dist.barrier()
