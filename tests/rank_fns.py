"""Per-rank functions the launcher tests start (importable: spawned ranks import them by name)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ddp_helpers as dh


def rank_times_ten(rank):
    return rank * 10


def rendezvous_env(rank):
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: os.environ.get(k) for k in keys}


def all_reduce_sum(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return t.item()


def talk(rank):
    print(f"python stdout {rank}")
    print(f"python stderr {rank}", file=sys.stderr)
    os.write(1, f"fd-level stdout {rank}\n".encode())  # what C/C++ code does
    return rank


def raise_on_rank_one(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            raise ValueError("boom on purpose")
        dist.barrier()  # rank 0 blocks here forever: the launcher must stop it at once
    return rank


def exit_on_rank_one(rank, code):
    if rank == 1:
        os._exit(code)
    time.sleep(60)
    return rank


def sigkill_rank_one(rank):
    if rank == 1:
        print("about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def rank_one_skips_barrier(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            print("rank 1 sleeping instead of the barrier", flush=True)
            time.sleep(600)
        print("rank 0 waiting in the barrier", flush=True)
        dist.barrier()


def sleep_forever(rank):
    print(f"sleeping {rank}", flush=True)
    time.sleep(600)


def group_destroyed_after_error(rank, world_size):
    try:
        with dh.process_group(rank, world_size, verbose=False):
            raise RuntimeError("inside the group")
    except RuntimeError:
        pass
    return dist.is_initialized()


def finish_then_other_raises(rank, pid_file):
    """Rank 0 returns; rank 1 raises only once rank 0's process has exited (its result sent)."""
    if rank == 1:
        # Not a fixed sleep: on a loaded machine rank 0 may not even have started by then.
        import psutil

        while not os.path.exists(pid_file):
            time.sleep(0.02)
        with open(pid_file) as f:
            rank0 = int(f.read())
        while _running(rank0, psutil):
            time.sleep(0.02)
        raise KeyError("late failure")
    tmp = f"{pid_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, pid_file)  # whole or absent: rank 1 never reads half a number
    return "rank 0 finished"


def _running(pid, psutil):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def returns_unpicklable(rank):
    return lambda: rank


def backend_seen(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        return dist.get_backend()


def backend_seen_verbose(rank, world_size):
    with dh.process_group(rank, world_size):
        return dist.get_backend()


def rank_zero_first_order(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        with dh.rank_zero_first():
            stamp = time.monotonic()
            time.sleep(0.3)
        return stamp


def current_cuda_device(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        return torch.cuda.current_device()


def threads_in_group(rank, world_size):
    with dh.process_group(rank, world_size, verbose=False):
        return torch.get_num_threads()


def print_pid_then_sleep(rank):
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)


def debug_level(rank):
    return str(dist.get_debug_level())


def start_method_and_local_world(rank):
    import multiprocessing

    return multiprocessing.get_start_method(), os.environ["LOCAL_WORLD_SIZE"]



def env_at_process_start(rank):
    """The environment the process was started with (what torch saw when it was imported)."""
    with open("/proc/self/environ", "rb") as f:
        return b"DH_TEST_AT_START=1" in f.read().split(b"\0")


def save_twice_killed_mid_second_save(rank, world_size, path):
    """Save a checkpoint, then die half-way through writing the next one."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddp_helpers.lessons import mnist_two_gpus as mnist

    cfg = mnist.MnistConfig(checkpoint=path)
    with dh.process_group(rank, world_size, verbose=False):
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
        with torch.no_grad():
            model[1].bias.fill_(1.0)
        ddp = DistributedDataParallel(model)
        mnist.save_checkpoint(ddp, cfg, rank)
        with torch.no_grad():
            model[1].bias.fill_(2.0)
        real_save = torch.save

        def save_then_die(obj, f, *a, **kw):
            real_save(obj, f, *a, **kw)
            with open(f, "r+b") as fh:  # the new file exists, half-written
                fh.truncate(100)
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = save_then_die
        mnist.save_checkpoint(ddp, cfg, rank)


def abort_after_peer_killed(rank, world_size):
    """Rank 1 is SIGKILLed, then rank 0 aborts, as gloo may abort a rank whose peer vanished.
    Rank 0 aborts only once rank 1's process is gone (reaped), so both deaths are on their way
    to the parent whatever the machine's load: the report must name rank 1's SIGKILL."""
    import psutil

    with dh.process_group(rank, world_size, verbose=False):
        pids = [None] * world_size
        dist.all_gather_object(pids, os.getpid())
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.abort()


def abort_alone(rank, world_size):
    """Only rank 1 aborts; rank 0 sleeps, outside any collective (in one, gloo could abort it
    too, and two aborts are reported by the lower rank)."""
    with dh.process_group(rank, world_size, verbose=False):
        if rank == 1:
            os.abort()
        time.sleep(60)


def returns_but_leaves_a_thread(rank):
    """Returns at once, but a non-daemon thread keeps the process alive for a minute."""
    import threading
    import time

    threading.Thread(target=time.sleep, args=(60,)).start()
    return rank * 10
