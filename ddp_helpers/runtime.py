"""Rank side: choose backend and device, create and always destroy the process group.

The device semantics, stated once (`decide_backend` is the whole decision, as a pure function):
- the device follows the backend: gloo means CPU tensors unless the caller asks for
  device="cuda" (gloo has no send/recv for CUDA tensors, so that is an opt-in);
- NCCL means one GPU per local rank: cuda:<local rank>, set as the current device before init;
- "auto" picks NCCL only when every local rank has a GPU of its own, and otherwise gloo on the
  CPU; NCCL asked for with fewer GPUs than local ranks is refused, with the fix.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEVICES = (None, "cpu", "cuda")
BACKEND_VAR = "DDP_HELPERS_BACKEND"  # set by launch(backend=...) for every rank of one run


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
    """Visible CUDA GPUs (CUDA_VISIBLE_DEVICES applied), counted through NVML, which creates
    no CUDA context and leaves the driver uninitialised in this process, so a later fork stays
    safe (torch: "will NOT poison fork"). `torch.cuda.is_available()` is not called: it
    initialises the driver (cuInit). Where NVML fails, torch falls back to the CUDA runtime's
    count, which does initialise it."""
    return torch.cuda.device_count()


def device_ids(device: torch.device | str) -> list[int] | None:
    """DDP's `device_ids`: [the GPU's index] for a CUDA device, None for the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None  # DDP on CPU modules wants None: there is no device to pin the replica to
    return [device.index if device.index is not None else torch.cuda.current_device()]


def choose_backend(backend: str, world_size: int, local_world_size: int | None = None,
                   device: str | None = None) -> tuple[str, str, str]:
    """Resolve "auto"/"gloo"/"nccl"/"mpi" here: (backend, device kind, the reason in one line)."""
    return decide_backend(backend, world_size, local_world_size or world_size, gpu_count(),
                          available_backends(), device)


def decide_backend(backend: str, world_size: int, local_world_size: int, gpus: int,
                   available: Sequence[str], device: str | None = None) -> tuple[str, str, str]:
    """The backend and device decision from the counts alone: (backend, device kind, why).

    `local_world_size` is the number of ranks on this machine (the GPUs are shared by those),
    `gpus` the visible CUDA GPUs, `available` the backends this torch has; `device` is the
    caller's request (None: follow the backend, "cpu", or "cuda"). Raises ValueError, saying
    what to do instead, for a request this machine cannot serve.
    """
    _check_request(backend, device, available)
    # A group smaller than the launch (one rank's own group, say) has only its own ranks here.
    local_world_size = max(1, min(local_world_size, world_size))
    if backend == "auto":
        return _decide_auto(local_world_size, gpus, available, device)
    if backend == "nccl":
        return _decide_nccl(local_world_size, gpus, device)
    if device == "cuda":
        _need_a_gpu(backend, gpus)
        return backend, "cuda", (f"asked for {backend} with CUDA tensors: "
                                 f"{_ranks(local_world_size)} on {_gpus(gpus)}")
    hint = ", CPU tensors (device='cuda' puts them on the GPU)" if gpus else ""
    return backend, "cpu", f"asked for {backend}{hint}"


def _check_request(backend: str, device: str | None, available: Sequence[str]) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)} "
                         f"(this build of torch has {', '.join(available) or 'none'}).")
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: use None (the device follows the backend), 'cpu' "
                         "or 'cuda'; the GPU's index comes from the local rank.")
    if backend != "auto" and backend not in available:
        raise ValueError(f"backend {backend!r} is not in this build of torch (it has "
                         f"{', '.join(available) or 'none'}); use backend='auto'.")


def _decide_auto(local: int, gpus: int, available: Sequence[str], device: str | None):
    if device == "cpu":
        return "gloo", "cpu", "asked for the CPU, so gloo (NCCL moves CUDA tensors only)"
    if gpus >= local and "nccl" in available:
        return "nccl", "cuda", f"{_gpus(gpus)} for {_ranks(local)} on this machine: one GPU each"
    if device == "cuda":
        _need_a_gpu("gloo", gpus)
        return "gloo", "cuda", (f"asked for CUDA tensors; {_short_of_gpus(local, gpus, available)}"
                                f", so gloo with the ranks' CUDA tensors on {_gpus(gpus)}")
    if gpus == 0:
        return "gloo", "cpu", "no CUDA GPU visible, so gloo on the CPU"
    return "gloo", "cpu", f"{_short_of_gpus(local, gpus, available)}, so gloo on the CPU"


def _decide_nccl(local: int, gpus: int, device: str | None):
    if device == "cpu":
        raise ValueError("backend='nccl' with device='cpu': NCCL moves CUDA tensors only. Use "
                         "backend='gloo' for CPU tensors, or drop device='cpu'.")
    if gpus < local:
        fewer = f"at most {gpus} rank(s) per machine" if gpus else "a machine with GPUs"
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank: {_ranks(local)} on this machine but "
            f"{gpus} GPU(s) visible. Use backend='gloo' (or 'auto', which picks gloo here), "
            f"or {fewer}.")
    return "nccl", "cuda", f"asked for NCCL; {_gpus(gpus)} for {_ranks(local)}: one GPU each"


def _short_of_gpus(local: int, gpus: int, available: Sequence[str]) -> str:
    if "nccl" not in available:
        return f"{_gpus(gpus)} but this build of torch has no NCCL"
    return f"{_ranks(local)} but {_gpus(gpus)}: NCCL needs one GPU per rank"


def _need_a_gpu(backend: str, gpus: int) -> None:
    if gpus == 0:
        raise ValueError(f"device='cuda' with {backend}, but no CUDA GPU is visible. Drop "
                         "device='cuda' (CPU tensors), or run where a GPU is visible (check "
                         "CUDA_VISIBLE_DEVICES and torch.cuda.is_available()).")


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _init_kwargs(backend: str, device: torch.device) -> dict:
    """device_id binds NCCL's communicator to this rank's GPU at init (torch 2.3 and later)."""
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": device}
    return {}


@contextmanager
def process_group(rank: int | None = None, world_size: int | None = None, backend: str = "auto",
                  init_method: str = "env://", timeout_s: float = 60, verbose: bool = True, *,
                  device: str | None = None) -> Iterator[torch.device]:
    """Initialise the default process group, yield this rank's device, always destroy the group.

    Args:
        rank: this process's rank; default $RANK (set by dh.launch and torchrun).
        world_size: the number of ranks; default $WORLD_SIZE.
        backend: "auto" (NCCL when every rank on this machine has a GPU of its own, otherwise
            gloo on the CPU), "gloo", "nccl" or "mpi". dh.launch(backend=...) overrides "auto"
            for every rank of a run.
        init_method: where the ranks meet; "env://" reads $MASTER_ADDR and $MASTER_PORT.
        timeout_s: seconds a collective may wait for its peers before it fails.
        verbose: rank 0 prints one line: the backend, the device and why.
        device: None to let the device follow the backend (NCCL: this rank's GPU; gloo: the
            CPU), "cuda" for gloo with CUDA tensors (ranks share the GPUs, local rank modulo
            the GPU count; gloo has no send/recv for them), or "cpu".

    Yields:
        This rank's device: cuda:<local rank> with NCCL (already the current CUDA device), the
        shared GPU with gloo and device="cuda", otherwise cpu. Pass it to `.to(...)` and
        `dh.device_ids(device)` to DDP.

    Raises:
        ValueError: an unknown backend or device, a backend this torch lacks, NCCL with fewer
            GPUs than ranks on this machine, or device="cuda" without a GPU; the message names
            the rank and the fix.
        RuntimeError: init_method="env://" without $MASTER_ADDR/$MASTER_PORT.
    """
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend == "auto":
        backend = os.environ.get(BACKEND_VAR, "auto")
    _check_rendezvous_env(init_method, rank)
    name, kind, why = _choose_on_rank(backend, world_size, local_world, rank, device)
    where = _place_rank(kind, local_rank, local_world)
    if verbose and rank == 0:
        print(f"process group: {name} on {where.type}, {world_size} ranks ({why})", flush=True)
    dist.init_process_group(name, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **_init_kwargs(name, where))
    try:
        yield where
    finally:
        if dist.is_initialized():
            let_gloo_threads_finish()
            dist.destroy_process_group()


def let_gloo_threads_finish() -> None:
    """Call just before `dist.destroy_process_group()` after DDP ran a Python comm hook.

    A gloo worker thread that just ran a Python future callback (a comm hook's `.then`) still
    drops its last references to Python objects, which needs the GIL; destroying the group joins
    that thread while holding the GIL, and on torch 2.9.0 and 2.9.1 the rank can hang there (see
    compat.py). Sleeping 20 ms releases the GIL, so the thread finishes first. gloo only: NCCL's
    callbacks run elsewhere, and other groups should not pay for it.
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        time.sleep(0.02)


def _place_rank(kind: str, local_rank: int, local_world: int) -> torch.device:
    """This rank's device; for CUDA, made current before init (see the comment inside)."""
    if kind == "cuda":
        # NCCL: local_rank < GPUs (decide_backend made sure). gloo with CUDA tensors: shared.
        device = torch.device("cuda", local_rank % gpu_count())
        # Before init: otherwise NCCL's first barrier puts every rank's context on GPU 0.
        torch.cuda.set_device(device)
        return device
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N CPU ranks each using every core would oversubscribe the machine.
        torch.set_num_threads(max(1, usable_cores() // local_world))
    return torch.device("cpu")


def _choose_on_rank(backend: str, world_size: int, local_world: int, rank: int,
                    device: str | None):
    try:
        return choose_backend(backend, world_size, local_world, device)
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
