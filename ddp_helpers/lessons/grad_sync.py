"""Lesson 06: what gradient synchronisation does, measured on the seed model and MNIST.

`train_with_sync` trains the seed model (Flatten + Linear(784, 10)) on each rank's own shard
of MNIST, always wrapped in DDP, and varies one thing: whether DDP all-reduces the gradients
every step ("ddp"), never (`no_sync()` every step: "none"), or never but the parameters are
averaged every k steps ("average"). Every rank returns its losses and a copy of its parameters
after every step; the parent measures how far the ranks drifted apart. `allreduce_times` times
one all-reduce per gradient size, for the cost model at the end of the lesson.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from time import perf_counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_helpers as dh
from ddp_helpers import data, models

SYNC_MODES = ("ddp", "none", "average")


@dataclass(frozen=True)
class SyncConfig:
    """One run's settings, as plain values (it pickles to every rank)."""

    source: data.DataSource | None = None  # None: rank 0 prepares the data, the others wait
    sync: str = "ddp"  # "ddp", "none" (no_sync every step) or "average" (every `every` steps)
    every: int = 10  # for sync="average": average the parameters after every k-th step
    steps: int | None = 100  # None: one pass over this rank's shard of the subset
    batch_size: int = 64  # per rank, as in the seed listing
    lr: float = 0.01  # the seed listing's rate
    train_subset: int = 12_000  # the first N training images, shared out by the sampler
    model: str = "linear"
    seed: int = 0
    progress_every: int = 0  # print "progress s/n" every so many steps (the panel's bars)
    verbose: bool = False  # rank 0 prints which backend it chose


def check_config(cfg: SyncConfig, world_size: int) -> None:
    """Refuse settings that cannot run, before any rank starts, saying what to change."""
    if cfg.sync not in SYNC_MODES:
        raise ValueError(f"sync={cfg.sync!r}: choose one of {', '.join(SYNC_MODES)}")
    if cfg.sync == "average" and cfg.every < 1:
        raise ValueError(f"every={cfg.every}: average after every k-th step needs k >= 1")
    per_rank = cfg.train_subset // world_size
    if per_rank < cfg.batch_size:
        raise ValueError(f"train_subset={cfg.train_subset} gives each of {world_size} ranks "
                         f"{per_rank} samples, less than one batch of {cfg.batch_size}: use a "
                         "bigger subset, a smaller batch or fewer ranks")


def average_parameters(model: nn.Module, world_size: int) -> None:
    """Replace every parameter by its mean over the ranks: one all-reduce per tensor."""
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= world_size


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one float32 vector on the CPU (a snapshot the parent can compare)."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def train_with_sync(rank: int, world_size: int, cfg: SyncConfig = SyncConfig(),
                    average=average_parameters) -> dict:
    """Train on this rank's shard with gradient sync on, off, or parameter averaging."""
    check_config(cfg, world_size)
    with dh.process_group(rank, world_size, verbose=cfg.verbose) as device:
        # One thread per rank: the ranks share the cores, and a fixed thread count keeps the
        # float sums in the same order on every machine, so the printed numbers reproduce.
        torch.set_num_threads(1)
        source = cfg.source or _prepare_on_rank_zero()
        x, y = data.mnist_tensors(source, train=True, device=device)
        batches = data.ShardedBatches(x[:cfg.train_subset], y[:cfg.train_subset],
                                      cfg.batch_size, rank, world_size, seed=cfg.seed)
        torch.manual_seed(cfg.seed)  # the same start everywhere (DDP would broadcast it anyway)
        ddp = DistributedDataParallel(models.build_model(cfg.model).to(device),
                                      device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
        steps = cfg.steps or len(batches)
        losses, snapshots = [], [flat_params(ddp.module)]
        for step, (xb, yb) in enumerate(_batches_for(batches, steps), 1):
            optimizer.zero_grad()
            if cfg.sync == "ddp":
                loss = F.cross_entropy(ddp(xb), yb)
                loss.backward()  # DDP all-reduces and averages the gradients in here
            else:
                with ddp.no_sync():  # forward and backward without DDP's all-reduce
                    loss = F.cross_entropy(ddp(xb), yb)
                    loss.backward()
            optimizer.step()
            if cfg.sync == "average" and step % cfg.every == 0:
                average(ddp.module, world_size)
            losses.append(loss.item())
            snapshots.append(flat_params(ddp.module))
            if cfg.progress_every and (step % cfg.progress_every == 0 or step == steps):
                print(f"progress {step}/{steps}", flush=True)
        x_test, y_test = data.mnist_tensors(source, train=False, device=device)
        return {"rank": rank, "world_size": world_size, "sync": cfg.sync, "every": cfg.every,
                "lr": cfg.lr, "batch_size": cfg.batch_size, "loss": losses,
                "params": torch.stack(snapshots), "samples_seen": steps * cfg.batch_size,
                "accuracy": own_accuracy(ddp.module, x_test, y_test),
                "param_count": models.param_count(ddp.module)}


def _batches_for(batches: data.ShardedBatches, steps: int):
    """`steps` batches from the shard, starting a new (reshuffled) epoch when one runs out."""
    done, epoch = 0, 0
    while done < steps:
        batches.set_epoch(epoch)
        for batch in batches:
            yield batch
            done += 1
            if done == steps:
                return
        epoch += 1


def _prepare_on_rank_zero() -> data.DataSource:
    with dh.rank_zero_first() as first:
        return data.prepare_data(download=None if first else False, verbose=first)


@torch.no_grad()
def own_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """This rank's model scored on the whole test set, alone (no all-reduce: models may differ)."""
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item()


# ---------------------------------------------------------------- parent side


def param_distance(results: list[dict]) -> torch.Tensor:
    """Per step (0: before training), largest L2 distance of a rank's parameters to rank 0's."""
    ref = results[0]["params"].double()
    if len(results) == 1:
        return torch.zeros(len(ref), dtype=torch.float64)
    gaps = [(r["params"].double() - ref).norm(dim=1) for r in results[1:]]
    return torch.stack(gaps).max(dim=0).values


def mean_loss(results: list[dict]) -> list[float]:
    """The loss per step averaged over the ranks (each rank's loss is on its own batch)."""
    return torch.tensor([r["loss"] for r in results]).mean(dim=0).tolist()


def run_summary(results: list[dict]) -> list[str]:
    """Lines for the parent to print: per rank its final loss and accuracy, then the distance."""
    gap = param_distance(results)
    lines = [f"rank {r['rank']}: {r['samples_seen']:,} samples in {len(r['loss'])} steps, "
             f"last loss {r['loss'][-1]:.3f}, test accuracy {r['accuracy']:.4f}" for r in results]
    if len(results) > 1:
        lines.append(f"parameter distance between the ranks: {gap[-1].item():.4g} after the last "
                     f"step, largest over all steps {gap.max().item():.4g}")
    return lines


def sync_variants(cfg: SyncConfig, every: int) -> dict[str, SyncConfig]:
    """The three ways of lesson 06, on the same data split: labels to configs."""
    return {"no sync": replace(cfg, sync="none"),
            f"average every {every} steps": replace(cfg, sync="average", every=every),
            "DDP (sync every step)": replace(cfg, sync="ddp")}


def scaling_configs(cfg: SyncConfig, world_sizes: list[int]) -> list[tuple[int, str, SyncConfig]]:
    """(world size, rule, config) for one pass over the subset: the rate kept, and scaled by N."""
    runs = []
    for n in world_sizes:
        runs.append((n, "kept", replace(cfg, steps=None, lr=cfg.lr)))
        if n > 1:  # at one rank the two rules are the same run
            runs.append((n, "scaled", replace(cfg, steps=None, lr=cfg.lr * n)))
    return runs


def effective_batch_rows(cfg: SyncConfig, world_sizes: list[int]) -> list[str]:
    """A small table: per world size the effective batch, steps per pass and both rates."""
    rows = [f"{'ranks':>5} {'batch/rank':>10} {'effective batch':>15} {'steps/pass':>10} "
            f"{'lr kept':>8} {'lr scaled':>9}"]
    for n in world_sizes:
        steps = -(-(cfg.train_subset // n) // cfg.batch_size)  # ceil: the last batch is short
        rows.append(f"{n:>5} {cfg.batch_size:>10} {cfg.batch_size * n:>15} {steps:>10} "
                    f"{cfg.lr:>8.3g} {cfg.lr * n:>9.3g}")
    return rows


# ---------------------------------------------------------------- communication cost


def mlp_param_count(hidden: int) -> int:
    """Parameters of Flatten + Linear(784, hidden) + ReLU + Linear(hidden, 10)."""
    return 784 * hidden + hidden + hidden * 10 + 10


def growing_models(hiddens: tuple[int, ...] = (16, 64, 256, 1024, 4096)) -> list[tuple[str, int]]:
    """(name, parameter count) from the seed model up: the gradients one all-reduce carries."""
    rows = [("seed: Linear(784, 10)", models.param_count(models.seed_model()))]
    rows += [(f"MLP 784-{h}-10", mlp_param_count(h)) for h in hiddens]
    return rows


def allreduce_times(rank: int, world_size: int, numels: list[int], repeats: int = 15) -> dict:
    """Fastest of `repeats` timings of one all-reduce of a float32 tensor of each size."""
    with dh.process_group(rank, world_size, verbose=False) as device:
        torch.set_num_threads(1)
        seconds = []
        for n in numels:
            t = torch.ones(n, device=device)
            dist.all_reduce(t)  # warm-up: gloo sets up buffers for a new size on first use
            trials = []
            for _ in range(repeats):
                dist.barrier()  # start together, so one rank's late arrival is not counted
                t0 = perf_counter()
                dist.all_reduce(t)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                trials.append(perf_counter() - t0)
            # The fastest try is the one least disturbed by other work sharing the cores.
            seconds.append(min(trials))
        return {"rank": rank, "world_size": world_size, "numels": numels, "seconds": seconds}


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte all-reduced by a ring: 2(N-1)/N."""
    return 2 * (world_size - 1) / world_size


def fit_alpha_beta(nbytes: list[int], seconds: list[float], world_size: int
                   ) -> tuple[float, float]:
    """Least-squares fit of t = alpha + 2(N-1)/N * bytes / bandwidth: (alpha s, bandwidth B/s)."""
    x = torch.tensor([ring_factor(world_size) * b for b in nbytes], dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    alpha, per_byte = torch.linalg.lstsq(design, t.unsqueeze(1)).solution.flatten().tolist()
    # Negative values mean the fit has too few or too noisy points; clamp to something sensible.
    return max(alpha, 0.0), 1.0 / max(per_byte, 1e-15)


def alpha_beta_seconds(nbytes: int, world_size: int, alpha: float, bandwidth: float) -> float:
    """The model's time for one ring all-reduce of `nbytes`: alpha + 2(N-1)/N * bytes / B."""
    return alpha + ring_factor(world_size) * nbytes / bandwidth
