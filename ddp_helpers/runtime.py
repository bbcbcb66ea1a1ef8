"""Rank side: choose backend and device, create and always destroy the process group."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl", "mpi")
_BACKEND_VAR = "DDP_HELPERS_BACKEND"  # set by launch(backend=...) for every rank of one run


def available_backends() -> list[str]:
    """The process-group backends this build of torch has."""
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
              "mpi": dist.is_mpi_available}
    return [name for name, ok in checks.items() if dist.is_available() and ok()]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without creating a CUDA context (safe in the parent)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(backend: str, world_size: int, local_world_size: int | None = None
                   ) -> tuple[str, str, str]:
    """Resolve "auto"/"gloo"/"nccl"/"mpi" to (backend, device kind, the reason in one line)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)} "
                         f"(this build of torch has {', '.join(available_backends()) or 'none'}).")
    local = local_world_size or world_size
    gpus = gpu_count()
    if backend == "auto":
        if gpus >= local and "nccl" in available_backends():
            return "nccl", "cuda", f"{gpus} GPUs for {local} ranks on this machine: one GPU each"
        if gpus:
            return "gloo", "cuda", (f"{gpus} GPU(s) for {local} ranks: NCCL needs one GPU per "
                                    "rank, so gloo with ranks sharing GPUs")
        return "gloo", "cpu", "no CUDA GPU visible, so gloo on the CPU"
    if backend not in available_backends():
        raise ValueError(f"backend {backend!r} is not in this build of torch (it has "
                         f"{', '.join(available_backends())}); use backend='auto'.")
    if backend == "nccl":
        if gpus < local:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: {local} ranks on this machine but "
                f"{gpus} GPU(s) visible. Use backend='gloo' (or 'auto', which picks gloo here), "
                "or fewer ranks.")
        return "nccl", "cuda", "asked for NCCL; one GPU per rank"
    return backend, ("cuda" if gpus else "cpu"), f"asked for {backend}"


@contextmanager
def process_group(rank: int | None = None, world_size: int | None = None, backend: str = "auto",
                  init_method: str = "env://", timeout_s: float = 60,
                  verbose: bool = True) -> Iterator[torch.device]:
    """Initialise the default process group, yield this rank's device, always destroy the group."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend == "auto":
        backend = os.environ.get(_BACKEND_VAR, "auto")
    _check_rendezvous_env(init_method, rank)
    name, kind, why = _choose_on_rank(backend, world_size, local_world, rank)
    device = torch.device("cpu")
    if kind == "cuda":
        device = torch.device("cuda", local_rank % gpu_count())
        # Before init: otherwise NCCL's first barrier puts every rank's context on GPU 0.
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N CPU ranks each using every core would oversubscribe the machine.
        torch.set_num_threads(max(1, usable_cores() // local_world))
    if verbose and rank == 0:
        print(f"process group: {name} on {device.type}, {world_size} ranks ({why})", flush=True)
    dist.init_process_group(name, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield device
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _choose_on_rank(backend: str, world_size: int, local_world: int, rank: int):
    try:
        return choose_backend(backend, world_size, local_world)
    except ValueError as e:
        raise ValueError(f"rank {rank}: {e}") from None


def _check_rendezvous_env(init_method: str, rank: int) -> None:
    if init_method != "env://":
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"rank {rank}: {' and '.join(missing)} not set, so init_method='env://' has nowhere "
            "to meet. Start the ranks with ddp_helpers.launch or torchrun (both set them), or "
            "set them yourself.")


@contextmanager
def rank_zero_first() -> Iterator[bool]:
    """Rank 0 runs the block first (e.g. downloads a file); the others run it after a barrier."""
    is_zero = dist.get_rank() == 0
    if not is_zero:
        dist.barrier()
    yield is_zero
    if is_zero:  # not on error: the launcher stops the waiting ranks instead
        dist.barrier()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (or when there is no process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
