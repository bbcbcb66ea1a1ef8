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
import select
import signal
import socket
import sys
import threading
import time

from . import auth, ledger_feed
from .protocol import AskWhere, Channel, Error, Unreadable, encode
from .sockets import Hello, Output, Refused, Setup, channel, parse_address, recv_small

_GONE_EXIT = 3  # the exit code of a rank whose notebook left without a Stop
_CONNECT_SECONDS = 120.0  # how long a worker retries while the notebook is not listening yet
# A worker that torchrun restarted finds the notebook already listening for it (the pool keeps
# its port open while restarts are left); if not, the notebook is gone: give up soon, so that
# a dead kernel's torchrun jobs end instead of restarting workers that wait minutes each.
_RECONNECT_SECONDS = 15.0


class Link:
    """The rank's end of its connection: one lock for every sender (the main thread's replies,
    the control thread's answers, the output forwarder), so messages never interleave, and a
    reader thread that answers questions at once and queues commands for the main thread."""

    def __init__(self, chan: Channel, outputs: dict[str, int], copies: dict[str, int]):
        self.chan, self.outputs, self.copies = chan, outputs, copies
        self.lock = threading.Lock()
        self.commands: list = []
        self.ready = threading.Condition()
        self.closed = False

    # -- rank -> notebook -------------------------------------------------------------------

    def send(self, message) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """A reply: first whatever output is still in the pipes, so it arrives before it."""
        with self.lock:
            self._forward_pending()
            self.chan.send_encoded(data)

    def _forward_pending(self) -> None:
        for kind, fd in self.outputs.items():
            while True:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                os.write(self.copies[kind], data)  # torchrun's log keeps the lines too
                self.chan.send(Output(kind, data))

    def forward_output(self) -> None:
        """Thread: relay the rank's output as it comes."""
        fds = list(self.outputs.values())
        while not self.closed:
            ready, _, _ = select.select(fds, [], [], 0.5)
            if ready:
                try:
                    with self.lock:
                        self._forward_pending()
                except (OSError, ValueError):
                    return

    def feed_ledger(self, call) -> None:
        """The rank's ledger feed (ledger_feed.py), called before each collective runs, on the
        thread that calls it. The line goes out at once, from this thread: a rank that gloo
        aborts (a shape mismatch) dies within milliseconds, and a line still held in this
        process would die with it, while one in the socket's buffer reaches the notebook. (Held
        back and sent in batches, a loop's shape mismatch ended as "rank 0 died" in 1 of 3
        tries here; sent at once, it was named in 6 of 6.)"""
        data = encode(Output("led", ledger_feed.encode(call)))
        try:
            with self.lock:  # output still in the pipes may follow it: it is not a reply
                self.chan.send_encoded(data)
        except (OSError, ValueError):
            pass  # the notebook is gone: the command thread exits the rank

    # -- notebook -> rank -------------------------------------------------------------------

    def read_commands(self, main_thread: int) -> None:
        """Thread: answer AskWhere at once (the main thread may be in a collective); queue the
        rest. The connection closing means the notebook is gone: leave at once."""
        from .cell_server import where

        while True:
            try:
                message = self.chan.recv()
            except Unreadable as e:
                message = e
            except (EOFError, OSError):
                _notebook_gone()
                return
            if isinstance(message, AskWhere):
                try:
                    self.send(where(main_thread))
                except (OSError, ValueError):
                    pass
                continue
            with self.ready:
                self.commands.append(message)
                self.ready.notify()

    def recv(self):
        """The next command, for cell_server's loop (an Unreadable is raised as it would be)."""
        with self.ready:
            while not self.commands:
                self.ready.wait()
            message = self.commands.pop(0)
        if isinstance(message, Unreadable):
            raise message
        return message


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


def _capture_output() -> tuple[dict[str, int], dict[str, int]]:
    """Point fds 1 and 2 (C++ output too) at pipes the link forwards; keep copies of the
    originals so torchrun's log still shows every line."""
    outputs, copies = {}, {}
    for kind, fd in (("out", 1), ("err", 2)):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        copies[kind] = os.dup(fd)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.dup2(w, fd)
        os.close(w)
        outputs[kind] = r
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
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
    chan = channel(sock)
    chan.send(me)
    answer = recv_small(chan, seconds)
    if isinstance(answer, Refused):
        raise SystemExit(f"ddp_helpers.serve: rank {me.rank}: the notebook refused it: "
                         f"{answer.reason}")
    return chan, me, answer


def serve(address: str, token_file: str) -> None:
    """Attach to the notebook, then run its cells until Stop (see the module docstring)."""
    from ..runtime import process_group
    from . import cell_server

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
    outputs, copies = _capture_output()
    link = Link(chan, outputs, copies)
    ledger_feed.feed_with(link.feed_ledger)
    threading.Thread(target=link.forward_output, name="ddp_helpers-output", daemon=True).start()
    threading.Thread(target=link.read_commands, args=(threading.get_ident(),),
                     name="ddp_helpers-commands", daemon=True).start()
    namespace = cell_server._namespace(me.rank, me.world_size)
    namespace.update(local_rank=me.local_rank, group_rank=me.group_rank, host=me.host)
    try:
        if setup.group:
            with process_group(me.rank, me.world_size, timeout_s=setup.timeout) as device:
                namespace["device"] = device
                cell_server._loop(link, link, namespace)
        else:
            namespace["device"] = cell_server._device_without_group(me.world_size, me.rank)
            cell_server._loop(link, link, namespace)
    except BaseException as e:  # noqa: BLE001 - setting up failed: tell the notebook why
        try:
            link.send(Error.from_exception(e))
        finally:
            raise
    finally:
        cell_server.flush()
        with link.lock:
            link._forward_pending()
        link.closed = True


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

