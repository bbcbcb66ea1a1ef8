"""Lesson 06: what gradient synchronisation does, measured on the seed model and MNIST.

`train_with_sync` trains the seed model (Flatten + Linear(784, 10)) on each rank's own part of
the data, always wrapped in DDP, and varies one thing: whether DDP all-reduces the gradients every
step ("ddp"), never (`no_sync()` every step: "none"), or never but the parameters are averaged
every k steps ("average"). The ranks' data is either the sampler's random shards ("iid") or split
by label ("by_label": with two ranks, rank 0 sees digits 0-4 and rank 1 digits 5-9). Every rank
returns its losses, a copy of its parameters after every step and the all-reduces it made; the
parent measures how far the ranks drifted apart. `allreduce_times` times one all-reduce per
message size, for the cost model at the end of the lesson.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from time import perf_counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_helpers as dh
from ddp_helpers.checks import Case, case, pair_cases
from ddp_helpers.data import DataSource, ShardedBatches, mnist_tensors, prepare_data
from ddp_helpers.exercises import exercise_check, require
from ddp_helpers.ledger import Ledger
from ddp_helpers.models import build_model, flat_params, param_count, seed_model

SYNC_MODES = ("ddp", "none", "average")
SPLITS = ("iid", "by_label")


@dataclass(frozen=True)
class SyncConfig:
    """One run's settings, as plain values (it pickles to every rank)."""

    source: DataSource | None = None  # None: find or make the data (prepare_data locks)
    sync: str = "ddp"  # "ddp", "none" (no_sync every step) or "average" (every `every` steps)
    every: int = 10  # for sync="average": average the parameters after every k-th step
    split: str = "iid"  # "iid": the sampler's random shards; "by_label": each rank some digits
    steps: int | None = 100  # None: one pass over this rank's shard of the subset
    batch_size: int = 64  # per rank, as in the seed listing
    lr: float = 0.01  # the seed listing's rate
    train_subset: int = 12_000  # the first N training images, shared out between the ranks
    model: str = "linear"
    seed: int = 0
    progress_every: int = 0  # print "progress s/n" every so many steps (the panel's bars)
    verbose: bool = False  # rank 0 prints which backend it chose


def check_config(cfg: SyncConfig, world_size: int) -> None:
    """Refuse settings that cannot run, before any rank starts, saying what to change."""
    if cfg.sync not in SYNC_MODES:
        raise ValueError(f"sync={cfg.sync!r}: choose one of {', '.join(SYNC_MODES)}")
    if cfg.split not in SPLITS:
        raise ValueError(f"split={cfg.split!r}: choose one of {', '.join(SPLITS)}")
    if cfg.sync == "average" and cfg.every < 1:
        raise ValueError(f"every={cfg.every}: average after every k-th step needs k >= 1")
    if cfg.split == "by_label" and world_size > 10:
        raise ValueError(f"split='by_label' gives each rank at least one digit: at most 10 "
                         f"ranks, not {world_size}")
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


def train_with_sync(rank: int, world_size: int, cfg: SyncConfig = SyncConfig(),
                    average=average_parameters) -> dict:
    """Train on this rank's part of the data with gradient sync on, off, or parameter averaging."""
    check_config(cfg, world_size)
    with dh.process_group(rank, world_size, verbose=cfg.verbose) as device:
        # One thread per rank: the ranks share the cores. The float sums then repeat from run to
        # run on one machine; another CPU's kernels round differently, so the lesson prints
        # three digits.
        torch.set_num_threads(1)
        source = cfg.source or prepare_data(verbose=False)
        batches = rank_batches(source, cfg, rank, world_size, device)
        torch.manual_seed(cfg.seed)  # the same start everywhere (DDP would broadcast it anyway)
        ddp = DistributedDataParallel(build_model(cfg.model).to(device),
                                      device_ids=dh.device_ids(device))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
        steps = cfg.steps or len(batches)
        losses, snapshots, calls, seen = [], [flat_params(ddp.module)], [], 0
        for step, (xb, yb) in enumerate(_batches_for(batches, steps), 1):
            seen += len(yb)  # an epoch's last batch may be short: count what was trained on
            optimizer.zero_grad()
            with counting_all_reduce() as counted:  # DDP's bucket all-reduces, bytes as sent
                if cfg.sync == "ddp":
                    loss = F.cross_entropy(ddp(xb), yb)
                    loss.backward()  # DDP all-reduces and averages the gradients in here
                else:
                    with ddp.no_sync():  # forward and backward without DDP's all-reduce
                        loss = F.cross_entropy(ddp(xb), yb)
                        loss.backward()
            calls += counted
            optimizer.step()
            if cfg.sync == "average" and step % cfg.every == 0:
                with counting_all_reduce() as counted:
                    average(ddp.module, world_size)
                calls += counted
            losses.append(loss.item())
            snapshots.append(flat_params(ddp.module))
            if cfg.progress_every and (step % cfg.progress_every == 0 or step == steps):
                print(f"progress {step}/{steps}", flush=True)
        x_test, y_test = mnist_tensors(source, train=False, device=device)
        return {"rank": rank, "world_size": world_size, "sync": cfg.sync, "every": cfg.every,
                "split": cfg.split, "lr": cfg.lr, "batch_size": cfg.batch_size, "loss": losses,
                "params": torch.stack(snapshots), "samples_seen": seen,
                "digits": sorted(set(batches.y.unique().tolist())),
                "allreduce_bytes": calls, "backend": dist.get_backend(),
                "accuracy": own_accuracy(ddp.module, x_test, y_test),
                "param_count": param_count(ddp.module)}


def rank_batches(source: DataSource, cfg: SyncConfig, rank: int, world_size: int,
                 device: torch.device) -> ShardedBatches:
    """This rank's batches: the sampler's shard of the subset ("iid"), or every image of the
    subset whose digit belongs to this rank ("by_label"), reshuffled each epoch."""
    x, y = mnist_tensors(source, train=True, device=device)
    x, y = x[:cfg.train_subset], y[:cfg.train_subset]
    if cfg.split == "iid":
        return ShardedBatches(x, y, cfg.batch_size, rank, world_size, seed=cfg.seed)
    mine = torch.isin(y, torch.tensor(digits_of(rank, world_size), device=y.device))
    return ShardedBatches(x[mine], y[mine], cfg.batch_size, 0, 1, seed=cfg.seed)


def digits_of(rank: int, world_size: int) -> list[int]:
    """The digits `rank` trains on with split="by_label": 0-9 cut into world_size runs."""
    return [d for d in range(10) if d * world_size // 10 == rank]


@contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Within the block, every all-reduce this rank calls is counted by the ledger (so one
    imported under another name, or DDP's, counts too): the list gets each call's bytes."""
    calls: list[int] = []
    with Ledger() as ledger:
        yield calls
    calls += [c.nbytes for c in ledger.calls if c.op == "all_reduce"]


def _batches_for(batches: ShardedBatches, steps: int):
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


# Steps a printed or plotted loss is averaged over: one step's loss is one batch's (an epoch's last
# batch is short), so its order between runs or ranks is noise.
LOSS_WINDOW = 10


def tail_loss(losses: list[float], window: int = LOSS_WINDOW) -> float:
    """The mean of the last `window` losses (all of them where there are fewer): the value the
    plots' smoothed curve ends on."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def run_summary(results: list[dict]) -> list[str]:
    """Lines for the parent to print: per rank its loss over the last LOSS_WINDOW steps and its
    accuracy, then the distance between the ranks."""
    gap = param_distance(results)
    lines = [f"rank {r['rank']}: {r['samples_seen']:,} samples in {len(r['loss'])} steps, "
             f"loss over the last {LOSS_WINDOW} steps {tail_loss(r['loss']):.3f}, test accuracy "
             f"{r['accuracy']:.3f}" for r in results]
    if len(results) > 1:
        # Three digits: a fourth would follow the float rounding of another CPU's kernels.
        lines.append(f"parameter distance between the ranks: {gap[-1].item():.3g} after the last "
                     f"step, largest over all steps {gap.max().item():.3g}")
    return lines


def sync_variants(cfg: SyncConfig, every: int) -> dict[str, SyncConfig]:
    """The three ways of lesson 06, on the same data split: labels to configs."""
    return {"no sync": replace(cfg, sync="none"),
            f"average every {every} steps": replace(cfg, sync="average", every=every),
            "DDP (sync every step)": replace(cfg, sync="ddp")}


def traffic_rows(runs: dict[str, list[dict]]) -> list[str]:
    """Per way of syncing: the all-reduce calls rank 0 made, as counted, and their bytes."""
    rows = []
    for label, results in runs.items():
        calls = results[0]["allreduce_bytes"]
        sizes = sorted(set(calls))
        rows.append(f"{label:>24}: {len(calls):>3} all-reduce calls in {len(results[0]['loss'])} "
                    f"steps, {sum(calls) / 1e6:.2f} MB all-reduced per rank "
                    f"(sizes: {', '.join(f'{s:,} B' for s in sizes) or 'none'})")
    return rows


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


def backend_rows(world_sizes: list[int]) -> list[str]:
    """Per world size, the backend dh.process_group's "auto" picks on this machine, and why."""
    rows = []
    for n in world_sizes:
        name, kind, why = dh.choose_backend("auto", n)
        rows.append(f"{n} rank(s): {name} on {kind} ({why})")
    return rows


# ---------------------------------------------------------------- communication cost


def mlp_param_count(hidden: int) -> int:
    """Parameters of Flatten + Linear(784, hidden) + ReLU + Linear(hidden, 10)."""
    return 784 * hidden + hidden + hidden * 10 + 10


def growing_models(hiddens: tuple[int, ...] = (64, 1024, 4096)) -> list[tuple[str, int]]:
    """(name, parameter count) from the seed model up: the gradients one all-reduce carries."""
    rows = [("seed: Linear(784, 10)", param_count(seed_model()))]
    rows += [(f"MLP 784-{h}-10", mlp_param_count(h)) for h in hiddens]
    return rows


def allreduce_times(rank: int, world_size: int, numels: list[int], repeats: int = 15) -> dict:
    """Fastest of `repeats` timings of one all-reduce of a float32 tensor of each size."""
    with dh.process_group(rank, world_size, verbose=False) as device:
        torch.set_num_threads(1)
        seconds = []
        for n in numels:
            t = torch.ones(n, device=device)
            dist.all_reduce(t)  # warm-up: a first call pays one-off costs (memory first touched)
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
        return {"rank": rank, "world_size": world_size, "numels": numels, "seconds": seconds,
                "backend": dist.get_backend()}


def latency_steps(world_size: int) -> int:
    """Messages each rank waits for in a ring all-reduce: N-1 to reduce-scatter, N-1 to gather."""
    return 2 * (world_size - 1)


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte all-reduced by a ring: 2(N-1)/N."""
    return 2 * (world_size - 1) / world_size


def ring_seconds(nbytes: float, world_size: int, alpha: float, bandwidth: float) -> float:
    """The ring model: t = 2(N-1) alpha + 2(N-1)/N * S / B."""
    return latency_steps(world_size) * alpha + ring_factor(world_size) * nbytes / bandwidth


def fit_ring(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """alpha (s) and B (bytes/s) of the ring model, fitted to (N, bytes, seconds) points by least
    squares on relative error, so small and large messages count alike."""
    a = torch.tensor([[latency_steps(n), ring_factor(n) * b] for n, b, _ in points],
                     dtype=torch.float64)
    t = torch.tensor([s for _, _, s in points], dtype=torch.float64)
    weights = (1 / t).unsqueeze(1)  # each row divided by its own time: relative error
    alpha, per_byte = torch.linalg.lstsq(a * weights, torch.ones_like(t).unsqueeze(1)
                                         ).solution.flatten().tolist()
    # A negative term means too few or too noisy points; clamp to something that still draws.
    return max(alpha, 1e-9), 1.0 / max(per_byte, 1e-15)


def fit_ring_on(points: list[tuple[int, float, float]], world_size: int) -> tuple[float, float]:
    """fit_ring on the points of one world size only: a fit over every N lets the
    oversubscribed runs (more ranks than cores) drag the model for the others."""
    return fit_ring([p for p in points if p[0] == world_size])


def cost_points(measured: list[list[dict]]) -> list[tuple[int, float, float]]:
    """(N, bytes, seconds of the slowest rank) for every size timed at every world size."""
    points = []
    for results in measured:
        r0 = results[0]
        for i, numel in enumerate(r0["numels"]):
            points.append((r0["world_size"], 4.0 * numel, max(r["seconds"][i] for r in results)))
    return points


def cost_round_rows(launches: list[list[list[dict]]], world_size: int = 2) -> list[str]:
    """The spread over repeated launches: alpha and B of each launch's fit on `world_size`
    ranks (min-max), then per (N, size) the measured time and measured / model (min-max),
    each launch against its own fit."""
    fits = [fit_ring_on(cost_points(timed), world_size) for timed in launches]
    alphas, bandwidths = [a * 1e6 for a, _ in fits], [b / 1e9 for _, b in fits]
    rows = [f"fit on the {world_size}-rank points, {len(launches)} launches: alpha "
            f"{min(alphas):.0f}-{max(alphas):.0f} us per step, B "
            f"{min(bandwidths):.2f}-{max(bandwidths):.2f} GB/s"]
    spread: dict[tuple[int, float], list[tuple[float, float]]] = {}
    for (alpha, bandwidth), timed in zip(fits, launches):
        for n, nbytes, seconds in cost_points(timed):
            model = ring_seconds(nbytes, n, alpha, bandwidth)
            spread.setdefault((n, nbytes), []).append((seconds * 1e3, seconds / model))
    for (n, nbytes), pairs in spread.items():
        ms, ratio = [m for m, _ in pairs], [r for _, r in pairs]
        rows.append(f"N={n}, {nbytes / 1e6:7.3f} MB: measured {min(ms):6.2f}-{max(ms):6.2f} ms, "
                    f"measured / model {min(ratio):.2f}-{max(ratio):.2f}")
    return rows


def slower_on_more_ranks(launches: list[list[list[dict]]]) -> bool:
    """Whether in every launch every size took longer at each larger world size than at the
    next smaller one (the ring model says so over one machine's loopback: more latency steps,
    a bandwidth factor 2(N-1)/N that grows, and more ranks than cores only add waiting)."""
    for timed in launches:
        by_size: dict[float, list[tuple[int, float]]] = {}
        for n, nbytes, seconds in cost_points(timed):
            by_size.setdefault(nbytes, []).append((n, seconds))
        for runs in by_size.values():
            times = [seconds for _, seconds in sorted(runs)]
            if any(later <= earlier for earlier, later in zip(times, times[1:])):
                return False
    return True


# ---------------------------------------------------------------- exercises


AVERAGE_RANKS = 3  # an odd world size: dividing by 2 is not the mean
AVERAGE_EVERY, AVERAGE_STEPS = 3, 6  # the training case: averages after steps 3 and 6


def odd_model() -> nn.Module:
    """A model whose parameters have odd sizes: 15, 3, 3 and 1 numbers."""
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def rank_values(model: nn.Module, rank: int) -> list[torch.Tensor]:
    """Values for `model`'s parameters that differ on every rank (seeded by the rank)."""
    g = torch.Generator().manual_seed(1_000 + rank)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def average_cases(rank: int, world_size: int, average) -> dict:
    """What the check needs from one rank: its parameters after one `average` of parameters that
    differ on every rank (with the collectives it called), and 6 steps of training with DDP's
    sync off, averaging every 3 steps, with `average` and with the kit's average_parameters."""
    with dh.process_group(rank, world_size, verbose=False) as device:
        torch.set_num_threads(1)
        model = odd_model().to(device)
        with torch.no_grad():
            for p, value in zip(model.parameters(), rank_values(model, rank)):
                p.copy_(value)
        model(torch.ones(2, 5, device=device)).sum().backward()  # gradients there, as in training
        everyone = [torch.cat([v.double().flatten() for v in rank_values(model, r)])
                    for r in range(world_size)]
        out = {"rank": rank, "expected": torch.stack(everyone).mean(0)}
        try:
            with Ledger() as ledger:
                average(model, world_size)
            out["once"] = flat_params(model)
            out["trained"] = _averaged_training(average, device, rank)
        except Exception as e:  # noqa: BLE001 - the learner's error is the result to report
            out["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        out["calls"] = [c.text() for c in ledger.calls]
        if "error" not in out:
            out["kit"] = _averaged_training(average_parameters, device, rank)
            out["buffers"] = _with_buffers(average, device, rank, world_size)
        return out


def buffered_model() -> nn.Module:
    """Linear(5, 3) + BatchNorm1d(3): buffers beside the parameters (running mean and variance,
    float; num_batches_tracked, int64), the feature the lesson says needs its own handling."""
    return nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))


def _with_buffers(average, device: torch.device, rank: int, world_size: int) -> dict:
    """`average` on a model with BatchNorm whose parameters and statistics differ per rank:
    its parameters after it, the mean expected, and its buffers before and after."""
    model = buffered_model().to(device)
    with torch.no_grad():
        for p, value in zip(model.parameters(), rank_values(model, rank)):
            p.copy_(value)
    g = torch.Generator().manual_seed(2_000 + rank)
    model(torch.randn(4, 5, generator=g).to(device))  # train mode: rank's own statistics
    everyone = [torch.cat([v.double().flatten() for v in rank_values(model, r)])
                for r in range(world_size)]
    before = {n: b.detach().clone().cpu() for n, b in model.named_buffers()}
    try:
        average(model, world_size)
    except Exception as e:  # noqa: BLE001 - the learner's error is the result to report
        return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
    return {"params": flat_params(model), "expected": torch.stack(everyone).mean(0),
            "before": before,
            "after": {n: b.detach().clone().cpu() for n, b in model.named_buffers()}}


def _averaged_training(average, device: torch.device, rank: int) -> torch.Tensor:
    """The seed model in DDP trained AVERAGE_STEPS steps with its sync off, on this rank's own
    random batches, `average` after every AVERAGE_EVERY-th: the parameters after every step."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(seed_model().to(device), device_ids=dh.device_ids(device))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    snapshots = []
    for step in range(1, AVERAGE_STEPS + 1):
        x = torch.randn(16, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (16,), generator=g).to(device)
        optimizer.zero_grad()
        with ddp.no_sync():
            F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        if step % AVERAGE_EVERY == 0:
            average(ddp.module, dist.get_world_size())
        snapshots.append(flat_params(ddp.module))
    return torch.stack(snapshots)


@exercise_check("average_parameters", "file")
def check_average_parameters(module) -> list:
    """On 3 ranks, then on 2: parameters that differ on every rank become their mean, the same
    on every rank, bit for bit; then (3 ranks) a short training with DDP's sync off, averaging
    every 3 steps with the learner's function, keeps the ranks equal after each average and
    matches the kit's. Two sizes, so that neither a written-in 2 nor a written-in 3 passes."""
    mine = require(module, "average_parameters")
    cases, results = [], {}
    for n in (AVERAGE_RANKS, 2):
        results[n] = dh.launch(average_cases, args=(n, mine), nprocs=n, timeout=90,
                               output="none")
        cases += _once_cases(results[n], n)
        if any(not c.ok for c in cases):
            return cases
    results = results[AVERAGE_RANKS]
    train = f"{AVERAGE_STEPS} steps with DDP's sync off, averaging every {AVERAGE_EVERY}"
    after = [s - 1 for s in range(AVERAGE_EVERY, AVERAGE_STEPS + 1, AVERAGE_EVERY)]
    cases += [case(f"{train}: rank {r['rank']} == rank 0 after steps "
                   f"{', '.join(str(s + 1) for s in after)}, bit for bit", r["trained"][after],
                   results[0]["trained"][after], rtol=0, atol=0) for r in results[1:]]
    cases += [case(f"{train}: rank {r['rank']}'s parameters after every step, against the "
                   "kit's average_parameters", r["trained"], r["kit"]) for r in results]
    return cases


def _once_cases(results: list[dict], n: int) -> list:
    """One average on `n` ranks: each rank's parameters are the mean, and equal rank 0's."""
    once = f"{n} ranks, parameters of 15, 3, 3 and 1 numbers, different on every rank"
    cases = []
    for r in results:
        label = f"{once}: rank {r['rank']}'s parameters after one average"
        called = f"; it called {', '.join(r['calls']) or 'no collective'}"
        if "error" in r:
            cases.append(Case(label, False, f"your function raised {r['error']}{called}"))
            continue
        got = case(label, r["once"], r["expected"])
        cases.append(Case(label, got.ok, got.detail + ("" if got.ok else called)))
    if any(not c.ok for c in cases):
        return cases
    cases += [case(f"{once}: rank {r['rank']}'s average == rank 0's, bit for bit",
                   r["once"], results[0]["once"], rtol=0, atol=0) for r in results[1:]]
    return cases + [_buffer_case(r["buffers"], f"{n} ranks, rank {r['rank']}") for r in results]


def _buffer_case(got: dict, where: str) -> Case:
    """A model with BatchNorm: its parameters averaged, and its buffers either left as they
    were or (the float ones) averaged too; num_batches_tracked, an int64, never divided."""
    label = f"{where}: Linear + BatchNorm1d (buffers beside the parameters)"
    if "error" in got:
        return Case(label, False, f"your function raised {got['error']} (BatchNorm's "
                                  "num_batches_tracked is an int64 buffer, not a parameter)")
    params = case(f"{label}: parameters after one average", got["params"], got["expected"])
    if not params.ok:
        return params
    counted = got["after"]["1.num_batches_tracked"].item()
    if counted != got["before"]["1.num_batches_tracked"].item():
        return Case(label, False, f"num_batches_tracked became {counted}: it counts batches, "
                                  "it is not averaged")
    return Case(label, True)


@exercise_check("scaled_lr", "file")
def check_scaled_lr(module) -> list:
    """The linear scaling rule on seven settings, one rank to eight: batches per rank smaller,
    equal to and larger than the base batch, and 3 ranks (where 144 // 128 is not 144 / 128)."""
    fn = require(module, "scaled_lr")
    given = [((0.05, 64, 64, 1), 0.05), ((0.05, 64, 64, 4), 0.2), ((0.1, 256, 32, 2), 0.025),
             ((0.01, 64, 128, 8), 0.16), ((0.2, 128, 128, 1), 0.2),
             ((0.1, 128, 48, 3), 0.1125), ((0.03, 96, 32, 3), 0.03)]
    return [case(f"scaled_lr{args}", fn(*args), want) for args, want in given]


def mlp(hidden: int) -> nn.Module:
    """Flatten + Linear(784, hidden) + ReLU + Linear(hidden, 10): four parameter tensors."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def averaging_calls(rank: int, world_size: int, hiddens: list[int | None], steps: int = 100,
                    every: int = 5) -> list[dict[str, int]]:
    """Exercise 3's count, measured: per model (None: the seed model, else mlp(hidden)), the
    collectives this rank calls, as the ledger counts them, in `steps` steps of training with
    DDP's sync off that average with average_parameters after every `every`-th step."""
    with dh.process_group(rank, world_size, verbose=False) as device:
        torch.set_num_threads(1)
        counts = []
        for hidden in hiddens:
            torch.manual_seed(0)
            model = seed_model() if hidden is None else mlp(hidden)
            ddp = DistributedDataParallel(model.to(device), device_ids=dh.device_ids(device))
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
            x, y = torch.randn(8, 1, 28, 28).to(device), torch.randint(0, 10, (8,)).to(device)
            with Ledger() as ledger:
                for step in range(1, steps + 1):
                    optimizer.zero_grad()
                    with ddp.no_sync():
                        F.cross_entropy(ddp(x), y).backward()
                    optimizer.step()
                    if step % every == 0:
                        average_parameters(ddp.module, world_size)
            counts.append(ledger.counts())
        return counts


ALLREDUCE_CALLS = (40, 80)  # 100 steps / 5 = 20 averages, x2 tensors (seed) or x4 (MLP)


@exercise_check("allreduce_calls", "prediction", wrong_answer=(20, 20))
def check_allreduce_calls(answer) -> list:
    """(calls for the seed model, calls for MLP 784-64-10) averaging every 5 of 100 steps."""
    return pair_cases(answer, ALLREDUCE_CALLS, "seed model, MLP",
                      ("seed model: Linear(784, 10)", "MLP 784-64-10"))
