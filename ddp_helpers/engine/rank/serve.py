"""Rank side of served ranks: a rank that torchrun (or srun) starts and the notebook drives,
`%%ranks` beyond one machine (`python -m ddp_helpers.serve` runs main() here).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        -m ddp_helpers.serve --connect NOTEBOOK_HOST:PORT --token-file ~/.ddp_token

Each worker reads what torchrun gives it (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK and
MASTER_ADDR/PORT), connects to the notebook's `dh.Ranks.listen(...)` (or `%ranks listen N`),
proves it holds the token, makes the process group with dh.process_group as every kit rank
does, and then runs the notebook's cells exactly as a rank the kit forked does.

It exits when the notebook says stop (`%ranks stop`: exit code 0, so torchrun ends cleanly)
or, with exit code 3, when the connection closes without a stop (the kernel died, or the
notebook dropped the group after a failure): torchrun then ends, so nothing is left behind.

With `torchrun --max-restarts K`, a failed worker makes its agent stop all its local workers,
meet the other agents again (they stop theirs too) and start every worker afresh, with
TORCHELASTIC_RESTART_COUNT one higher on the agents that saw the failure. The new workers
attach to the same address with the same token; the notebook's pool takes them as a fresh
group (its port stays open for exactly that while restarts are left) and says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

from ..wire import auth
from ..wire.channel import Channel, over_socket, parse_address
from ..wire.messages import Error, Hello, Refused, ServeCells, Setup, Stream
from . import cells
from .link import SocketLink
from .streams import flush, reopen_std_streams

_GONE_EXIT = 3  # the exit code of a rank whose notebook left without a Stop
_CONNECT_SECONDS = 120.0  # how long a worker retries while the notebook is not listening yet
# A worker that torchrun restarted finds the notebook already listening for it (the pool keeps
# its port open while restarts are left); if not, the notebook is gone: give up soon, so that
# a dead kernel's torchrun jobs end instead of restarting workers that wait minutes each.
_RECONNECT_SECONDS = 15.0


def _notebook_gone() -> None:
    """The notebook closed the connection without a Stop (its kernel died, or it dropped the
    group after a failure): nothing will drive this rank again. Exit now, even from inside a
    collective, and with a failure code: a worker that exited 0 would keep its torchrun agent
    waiting (up to 300 s) in the exit barrier for a node that failed; this way every agent
    ends, or, with --max-restarts, restarts all its workers: a fresh group that attaches
    again, which the notebook's pool is listening for."""
    try:
        print("ddp_helpers.serve: the notebook closed the connection; exiting", file=sys.stderr,
              flush=True)
    finally:
        os._exit(_GONE_EXIT)


def connect(address: str, seconds: float, token_file: str | None = None) -> socket.socket:
    """Connect to the notebook, retrying while it is not listening yet (and while its token
    file is there: a stopped pool deletes the file it made)."""
    host, port = parse_address(address)
    deadline = time.monotonic() + seconds
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            # Each ledger line goes out as it is sent: with Nagle's algorithm a small send
            # waits for the ACK of the one before (up to 40 ms, delayed), and a peer that
            # gloo aborts meanwhile is reported before the line that explains it arrives.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            if token_file is not None and not os.path.exists(token_file):
                raise SystemExit(f"ddp_helpers.serve: {token_file} is gone: the notebook "
                                 "stopped listening.") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"ddp_helpers.serve: cannot reach the notebook at {address}: "
                                 f"{e}. Run `%ranks listen N` there first.") from None
            time.sleep(0.5)


def hello() -> Hello:
    """Who this worker is, from what torchrun (or srun) set."""
    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    return Hello(rank=rank, world_size=int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1))),
                 local_rank=int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0))),
                 group_rank=int(env.get("GROUP_RANK", env.get("SLURM_NODEID", 0))),
                 host=socket.gethostname(), pid=os.getpid(),
                 restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                 max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)))


def _capture_output() -> tuple[dict[Stream, int], dict[Stream, int]]:
    """Point fds 1 and 2 (C++ output too) at pipes the link forwards; keep copies of the
    originals so torchrun's log still shows every line."""
    outputs, copies = {}, {}
    flush()
    for stream, fd in ((Stream.OUT, 1), (Stream.ERR, 2)):
        copies[stream] = os.dup(fd)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.dup2(w, fd)
        os.close(w)
        outputs[stream] = r
    reopen_std_streams()
    return outputs, copies


def attach(address: str, token_file: str, seconds: float | None = None
           ) -> tuple[Channel, Hello, Setup]:
    """Connect, prove the token, say Hello, and get the notebook's Setup (or exit, refused)."""
    me = hello()
    if seconds is None:
        seconds = _RECONNECT_SECONDS if me.restart else _CONNECT_SECONDS
    try:
        token = auth.read_token(token_file)
    except FileNotFoundError:  # not listening yet, or stopped (a pool deletes the file it made)
        raise SystemExit(f"ddp_helpers.serve: {token_file} does not exist: run `%ranks listen "
                         "N` in the notebook first (or it stopped listening).") from None
    sock = connect(address, seconds, token_file)
    try:
        auth.answer_challenge(sock, token, seconds=seconds)
    except auth.AuthError as e:
        raise SystemExit(f"ddp_helpers.serve: {address}: {e}") from None
    chan = over_socket(sock)
    chan.send(me)
    answer = chan.recv_small(seconds)
    if isinstance(answer, Refused):
        raise SystemExit(f"ddp_helpers.serve: rank {me.rank}: the notebook refused it: "
                         f"{answer.reason}")
    return chan, me, answer


def serve(address: str, token_file: str) -> None:
    """Attach to the notebook, then run its cells until Stop (see the module docstring)."""
    chan, me, setup = attach(address, token_file)
    os.environ.update(setup.env)
    # Under `srun python -m ddp_helpers.serve` (no torchrun) only Slurm's names are set:
    # give dh.process_group and the learner's cells torchrun's.
    for name, value in (("RANK", me.rank), ("WORLD_SIZE", me.world_size),
                        ("LOCAL_RANK", me.local_rank), ("GROUP_RANK", me.group_rank)):
        os.environ.setdefault(name, str(value))
    if "SLURM_NTASKS_PER_NODE" in os.environ:
        os.environ.setdefault("LOCAL_WORLD_SIZE",
                              os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0])
    if setup.group:
        _own_rendezvous(me, setup.generation, setup.timeout)
    link = SocketLink(chan, *_capture_output(), on_gone=_notebook_gone)
    try:
        cells.serve(link, me.rank, ServeCells(me.world_size, setup.group, setup.timeout),
                    extra={"local_rank": me.local_rank, "group_rank": me.group_rank,
                           "host": me.host})
    except BaseException as e:  # noqa: BLE001 - setting up failed: tell the notebook why
        try:
            link.send(Error.from_exception(e))
        finally:
            raise
    finally:
        flush()
        link.close()


def _own_rendezvous(me: Hello, generation: str, timeout: float) -> None:
    """Give this group a store of its own, so that a restarted group never meets its
    predecessor's keys.

    torchrun's agents keep one TCPStore (at MASTER_ADDR:MASTER_PORT) for every restart of a
    job, and env:// puts each group's keys into it under the same names; an agent that counted
    no failure restarts its workers later than the one that did (when it sees the other node
    waiting), so a new rank can read an address its peer's old process left there and fail to
    connect. Rank 0 instead picks a free port on its node (MASTER_ADDR) and posts it under a
    key named for this generation (the notebook's Setup gives every rank of one group the
    same fresh name); env:// then meets there, on a store that rank 0 hosts."""
    if not generation or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # no agent's store (srun alone, or a store made afresh per round): no old keys
    from datetime import timedelta

    from torch.distributed import TCPStore

    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     is_master=False, timeout=timedelta(seconds=timeout))
    key = f"ddp_helpers/served/{generation}/master_port"
    if me.rank == 0:
        with socket.socket() as s:  # a free port, as dh.free_port finds one
            s.bind(("", 0))
            port = s.getsockname()[1]
        agent.set(key, str(port))
    else:
        port = int(agent.get(key))
    os.environ["MASTER_PORT"] = str(port)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts this store, not the agent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_helpers.serve",
        description="A persistent rank for a notebook's %%ranks, started by torchrun or srun.")
    parser.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the address `%%ranks listen` printed")
    parser.add_argument("--token-file", required=True, metavar="PATH",
                        help="the file `%%ranks listen` wrote (mode 0600)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # torchrun stopping its workers
    serve(args.connect, args.token_file)  # returns when the notebook sends Stop

