"""Solution (lesson 12, bug 8): set_epoch before each epoch, so the sampler shuffles with a new
seed + epoch each time (the same on every rank, so the shards still do not overlap)."""

from torch.utils.data import DistributedSampler


def epoch_orders(n, epochs, seed):
    """This rank's sample indices in each of `epochs` epochs of a shuffled DistributedSampler."""
    sampler = DistributedSampler(range(n), shuffle=True, seed=seed)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders
