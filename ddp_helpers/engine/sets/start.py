"""What ranks the kit forks start from: the warm start server, the environment they get, and
the rendezvous every rank of one run meets at.

Ranks start through torch.multiprocessing.start_processes on multiprocessing's forkserver, whose
interpreter preloads torch but never the learner's modules and never CUDA: a warm start costs a
fork, not a Python + torch start-up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import socket

_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data",
            "numpy", "torchvision", "ddp_helpers.engine.rank.entry",
            "ddp_helpers.engine.rank.cells", "ddp_helpers.engine.rank.link"]


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, chosen by the kernel."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rendezvous_env(nprocs: int, port: int) -> dict[str, str]:
    """What env:// needs on every rank of a run on this machine (RANK and LOCAL_RANK are set
    by each rank itself)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs)}


def prepare_start_server(start_method: str) -> None:
    """Have the forkserver preload torch and the kit's rank side (once per kernel)."""
    if start_method == "forkserver":
        present = [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])]
        multiprocessing.get_context("forkserver").set_forkserver_preload(present)


@contextlib.contextmanager
def inherited_env(env: dict | None):
    """Set `env` as os.environ for the block, then restore the caller's environment exactly.

    With spawn, each rank's interpreter imports torch before rank_entry runs, so variables torch
    reads at import (TORCH_CPP_LOG_LEVEL) must be in the environment it is started with."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
