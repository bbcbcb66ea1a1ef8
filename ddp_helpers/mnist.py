"""`python -m ddp_helpers.mnist`: the seed's MNIST exercise from a terminal, or under torchrun.

    python -m ddp_helpers.mnist --nprocs 2 --epochs 1          # launches its own ranks
    torchrun --nproc-per-node 2 -m ddp_helpers.mnist --epochs 1  # torchrun starts the ranks

Started by torchrun (its variables RANK, WORLD_SIZE, LOCAL_RANK are set), every process runs
the per-rank function itself; otherwise this process is the parent and launches the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons import mnist_two_gpus as lesson
from ddp_helpers.models import MODELS
from ddp_helpers.runtime import BACKEND_VAR, BACKENDS

_DESCRIBE = {
    "faithful": "the listing as printed: no DistributedSampler, every rank walks all the data, "
                "a line per batch, fixed port 23456",
    "fixed": "the listing with DistributedSampler: each rank trains on its own shard",
    "memory": "the kit's fast path: all data in one tensor, sharded like DistributedSampler",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything starts."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.mnist",
                                description="Train the seed's MNIST model with DDP on N ranks.")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--data-root", default=None, help="folder holding MNIST/ (default: data/)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--loader", dest="path", action="store_const", const="loader",
                     help="the listing's DataLoader (PIL images, transforms, 2 workers)")
    how.add_argument("--memory", dest="path", action="store_const", const="memory",
                     help="the kit's in-memory tensors (default)")
    p.add_argument("--faithful", action="store_true",
                   help="the listing as printed: no DistributedSampler, a line per batch, "
                        "tcp://localhost:23456 (uses the DataLoader)")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--model", default="linear", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=64, help="per rank, as in the listing")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--train-subset", type=int, default=None, help="use the first N samples only")
    p.add_argument("--no-download", action="store_true", help="never try the network")
    p.add_argument("--out", default=None, help="folder for the plot and checkpoint "
                   "(default: runs/mnist-<time>)")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the ranks are stopped")
    args = p.parse_args(argv)
    if args.faithful and args.path == "memory":
        p.error("--faithful is the listing's DataLoader pipeline; drop --memory (or --faithful)")
    for name in ("nprocs", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.variant = "faithful" if args.faithful else ("fixed" if args.path == "loader" else "memory")
    return args


def under_torchrun() -> bool:
    """True when torchrun (or another launcher that sets RANK and WORLD_SIZE) started us."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def _config(args, **kw) -> lesson.MnistConfig:
    return lesson.MnistConfig(
        epochs=args.epochs, model=args.model, batch_size=args.batch_size, lr=args.lr,
        num_workers=args.num_workers, train_subset=args.train_subset, **kw)


def _prepare(args, verbose: bool = True) -> data.DataSource:
    """Find, download or make the data; under a file lock, so processes that start together
    (torchrun's, one machine's) queue and the first one prepares it for the others."""
    return data.prepare_data(args.data_root, download=False if args.no_download else None,
                             verbose=verbose)


def main(argv: list[str] | None = None) -> int:
    """Run the exercise; return the exit status."""
    args = parse_args(argv)
    if under_torchrun():
        return _run_as_torchrun_rank(args)
    out = Path(args.out or f"runs/mnist-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"MNIST with DDP: {args.nprocs} ranks, {args.epochs} epoch(s), {args.variant} "
          f"({_DESCRIBE[args.variant]})", flush=True)
    try:  # once, here in the parent: the ranks only read what this leaves in data/
        source = _prepare(args)
    except (data.MNISTFileError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = _config(args, source=source, checkpoint=str(out / "checkpoint.pt"))
    try:
        results = dh.launch(lesson.VARIANTS[args.variant], args=(args.nprocs, cfg),
                            nprocs=args.nprocs, timeout=args.timeout,
                            backend=None if args.backend == "auto" else args.backend)
    except (dh.LaunchError, ValueError) as e:  # ValueError: a backend this machine lacks
        print(f"error: {e}", file=sys.stderr)
        return 1
    _report(results, out)
    return 0


def _run_as_torchrun_rank(args) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend != "auto":
        os.environ[BACKEND_VAR] = args.backend  # what dh.launch(backend=...) sets
    # Every process must agree on the folder without talking yet: name it after the run.
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('MASTER_PORT', '')}"
    out = Path(args.out or f"runs/mnist-torchrun-{run_id}")
    if rank == 0:
        print(f"MNIST with DDP under torchrun: {world_size} ranks, {args.epochs} epoch(s), "
              f"{args.variant} ({_DESCRIBE[args.variant]})", flush=True)
    source = _prepare(args, verbose=rank == 0)  # no group yet: the file lock orders them
    cfg = _config(args, source=source, checkpoint=str(out / "checkpoint.pt"), gather=True)
    results = lesson.VARIANTS[args.variant](rank, world_size, cfg)
    if rank == 0:  # gather=True: rank 0 holds every rank's records
        _report(results, out)
    return 0


def _report(results: list[dict], out: Path) -> None:
    from ddp_helpers.plots.mnist_two_gpus import per_rank_loss_plot  # matplotlib only here

    for line in lesson.summary(results):
        print(line)
    acc = results[0]["accuracy"]
    print(f"final test accuracy: {acc:.4f} ({acc:.1%}) on the 10,000 test images")
    reloaded = results[0].get("reloaded_accuracy")
    if reloaded is not None:
        print(f"checkpoint {out / 'checkpoint.pt'} reloaded with map_location: accuracy "
              f"{reloaded:.4f} ({'the same' if reloaded == acc else 'DIFFERENT'})")
    out.mkdir(parents=True, exist_ok=True)
    fig = per_rank_loss_plot(results)
    fig.savefig(out / "loss_per_rank.png", dpi=100)
    print(f"plot: {out / 'loss_per_rank.png'}")
    print(results[0]["data"])


if __name__ == "__main__":
    sys.exit(main())
