"""Solution (lesson 12, bug 2): the counts' length follows the number of classes, which every
rank knows, not the largest label that this rank's shard happens to hold."""

import torch
import torch.distributed as dist


def class_counts(labels, num_classes):
    """How many samples of each class, summed over the ranks."""
    counts = torch.bincount(labels, minlength=num_classes)
    dist.all_reduce(counts)
    return counts
