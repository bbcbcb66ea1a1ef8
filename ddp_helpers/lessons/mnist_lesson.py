"""Lesson 05's extras around lessons/mnist.py: counting samples without training, short runs.

The notebook trains on a subset (a minute on a two-core laptop) and counts what a full epoch
would hand each rank here, without training; `python -m ddp_helpers.mnist` runs the full epoch.
"""

from __future__ import annotations

from dataclasses import replace

from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons.mnist import MnistConfig

NOTEBOOK_SUBSET = 3_000  # training images the notebook's loader runs use (of 60,000)


def samples_per_epoch(rank: int, world_size: int, source: data.DataSource,
                      with_sampler: bool) -> dict:
    """How many samples and batches one epoch of the listing's DataLoader gives this rank."""
    with dh.process_group(rank, world_size, verbose=False):
        transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
        trainset = data.mnist_dataset(source, True, transform)
        if with_sampler:
            sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank)
            loader = DataLoader(trainset, batch_size=64, sampler=sampler)
        else:  # the listing: shuffle=True draws from the whole dataset on every rank
            loader = DataLoader(trainset, batch_size=64, shuffle=True)
        # len(loader.sampler): the samples one epoch visits; nothing is loaded to count them.
        return {"rank": rank, "samples": len(loader.sampler), "batches": len(loader),
                "dataset": len(trainset)}


def short_config(source: data.DataSource, **changes) -> MnistConfig:
    """The notebook's MnistConfig: the first NOTEBOOK_SUBSET images, few progress lines."""
    cfg = MnistConfig(source=source, train_subset=NOTEBOOK_SUBSET, progress_lines=2)
    return replace(cfg, **changes)


def seen_overlap(results: list[dict]) -> dict:
    """Which sample indices the ranks trained on: how many each, shared, and all together."""
    seen = [set(r["indices"].tolist()) for r in results]
    return {"per_rank": [len(s) for s in seen], "shared": len(set.intersection(*seen)),
            "union": len(set.union(*seen))}


def time_rows(results: list[dict]) -> list[str]:
    """Per rank: epoch seconds split into data, compute and gradient sync."""
    rows = []
    for r in results:
        sync = sum(s for s in r["sync_s"] if s == s)  # NaN (not measured on GPUs) counts as 0
        rows.append(f"rank {r['rank']} of {r['world_size']}: epoch {sum(r['epoch_s']):.2f} s = "
                    f"data {sum(r['data_s']):.2f} s + compute {sum(r['compute_s']):.2f} s + "
                    f"gradient sync {sync:.2f} s")
    return rows
