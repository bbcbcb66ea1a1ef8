"""Exercise (lesson 05): the listing's DataLoader with the DistributedSampler it was missing."""

from torch.utils.data import DataLoader, Dataset, DistributedSampler


def sharded_loader(dataset: Dataset, rank: int, world_size: int,
                   batch_size: int = 64) -> DataLoader:
    """A loader that gives `rank` its own 1/world_size of the shuffled dataset."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    # sampler= replaces shuffle=True: the sampler shuffles (with seed + epoch) and shards.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
