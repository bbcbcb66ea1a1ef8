"""Solution (lesson 12, bug 6): one seed for what must agree (the model), another per rank for
what must differ (the data)."""

import torch
import torch.distributed as dist
from torch import nn


def build(seed):
    """The model, the same on every rank, and this rank's data, its own."""
    torch.manual_seed(seed)  # the same on every rank: the same initial weights
    model = nn.Linear(4, 1)
    torch.manual_seed(seed + 1 + dist.get_rank())  # then each rank its own data
    x = torch.randn(8, 4)
    return model, x
