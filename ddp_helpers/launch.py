"""Parent side: start N ranks from a notebook or a script, relay their output into the caller,
bring their results and errors back, enforce the timeout, and leave no process behind.

Ranks start through torch.multiprocessing.start_processes (torch's own process context, its
`_wrap` with parent-death signal and error file) on a forkserver whose interpreter preloads torch
but never the learner's modules and never CUDA: a warm launch costs a fork, not a Python + torch
start-up, and a module edited between launches is imported afresh by the next one. Supervision is
our own: torch's ProcessContext.join gives failing runs a SIGTERM and up to 30 s of grace, while
a rank blocked in a collective must be stopped at once, and output must be relayed meanwhile.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time

import torch.multiprocessing as tmp

from ._rank import RankSpec, rank_entry
from .errors import LaunchError, LaunchRefused, LaunchTimeout, RankDied, RankRaised
from .launch_checks import check_launch, check_port_free
from .relay import OutputRelay

_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data",
            "numpy", "torchvision", "ddp_helpers._rank"]
_DRAIN_SECONDS = 1.0  # how long output from finished ranks may keep arriving (their workers)
_SETTLE_SECONDS = 0.5  # a rank whose peer died errors first; its root cause arrives within this
_BACKEND_VAR = "DDP_HELPERS_BACKEND"


def launch(fn, args: tuple = (), nprocs: int = 2, timeout: float = 300, *,
           start_method: str = "forkserver", output: str = "live", env: dict | None = None,
           backend: str | None = None, master_port: int | None = None) -> list:
    """Run fn(rank, *args) on nprocs ranks and return their return values in rank order."""
    payload = check_launch(fn, args, nprocs, timeout, start_method, output)
    extra_env = _check_env(env)
    if backend is not None:
        from .runtime import choose_backend  # late: runtime is rank-side code

        try:  # refuses an unknown backend, or nccl without GPUs, before starting anything
            chosen = choose_backend(backend, nprocs)[0]
        except ValueError as e:
            raise LaunchRefused(f"{e} Nothing was started.") from e
        if backend != "auto":
            extra_env[_BACKEND_VAR] = chosen
    addr = "127.0.0.1"
    if master_port is not None:
        check_port_free(addr, master_port)
    port = master_port or free_port(addr)
    rendezvous = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
                  "LOCAL_WORLD_SIZE": str(nprocs)}
    run = _Run(nprocs, output, start_method)
    return run.execute(payload, {**os.environ, **extra_env, **rendezvous}, timeout)


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, chosen by the kernel."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _check_env(env: dict | None) -> dict[str, str]:
    env = dict(env or {})
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise LaunchError(f"env={{{k!r}: {v!r}}}: environment variables are strings; write "
                              f"env={{{str(k)!r}: {str(v)!r}}}.")
    return env


def _prepare_start_server(start_method: str) -> None:
    if start_method == "forkserver":
        present = [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])]
        multiprocessing.get_context("forkserver").set_forkserver_preload(present)


class _Run:
    """One launch: its processes, pipes and what came back."""

    def __init__(self, nprocs: int, output: str, start_method: str):
        self.nprocs = nprocs
        self.start_method = start_method
        self.ctx = multiprocessing.get_context(start_method)
        self.relay = OutputRelay(nprocs, output)
        self.results: dict[int, object] = {}
        self.errors: dict[int, tuple] = {}
        self.exitcodes: dict[int, int] = {}
        self.context = None
        self.stopped = False

    def execute(self, payload: bytes, env: dict, timeout: float) -> list:
        _prepare_start_server(self.start_method)
        parent_ends, child_specs, lifeline_w = self._pipes(payload, env)
        try:
            with _inherited_env(env if self.start_method == "spawn" else None):
                self.context = tmp.start_processes(rank_entry, args=(child_specs,),
                                                   nprocs=self.nprocs, join=False,
                                                   start_method=self.start_method)
            for spec in child_specs:  # the ranks hold these now; our copies would hide EOF
                for conn in (spec.out, spec.err, spec.result, spec.lifeline):
                    conn.close()
            failure = self._supervise(parent_ends, time.monotonic() + timeout)
        except BaseException:  # KeyboardInterrupt included: stop everything, then re-raise
            self._stop_all()
            self.relay.flush()
            raise
        finally:
            lifeline_w.close()
        self._stop_all()
        self._drain(parent_ends)
        self.relay.flush()
        self._cleanup_error_files()
        if failure is not None:
            raise failure
        return [self.results[r] for r in range(self.nprocs)]

    def _pipes(self, payload: bytes, env: dict):
        parent_ends, specs = {}, []
        lifeline_r, lifeline_w = self.ctx.Pipe(duplex=False)
        for rank in range(self.nprocs):
            out_r, out_w = self.ctx.Pipe(duplex=False)
            err_r, err_w = self.ctx.Pipe(duplex=False)
            res_r, res_w = self.ctx.Pipe(duplex=False)
            parent_ends.update({out_r: ("out", rank), err_r: ("err", rank), res_r: ("res", rank)})
            specs.append(RankSpec(payload=payload, env=env, sys_path=list(sys.path),
                                  cwd=os.getcwd(),
                                  start_method=multiprocessing.get_start_method(allow_none=True),
                                  out=out_w, err=err_w, result=res_w,
                                  lifeline=lifeline_r))
        return parent_ends, specs, lifeline_w

    def _supervise(self, ends: dict, deadline: float) -> LaunchError | None:
        procs = self.context.processes
        waiting = {p.sentinel: r for r, p in enumerate(procs)}
        settle = None  # when only knock-on errors are known, wait briefly for the root cause
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                return self._timeout_error(sorted(waiting.values()))
            limit = min(deadline, settle or deadline, now + 1.0) - now
            ready = multiprocessing.connection.wait(list(ends) + list(waiting), max(limit, 0))
            for conn in [o for o in ready if o in ends]:
                self._read(conn, ends)
            for sentinel in [o for o in ready if o in waiting]:
                rank = waiting.pop(sentinel)
                procs[rank].join()
                self.exitcodes[rank] = procs[rank].exitcode
                self._drain_result(rank, ends)
            found = self._first_failure()
            if found is not None:
                knock_on, failure = found
                settle = settle or time.monotonic() + _SETTLE_SECONDS
                if not knock_on or time.monotonic() >= settle:
                    return failure
        found = self._first_failure()
        return found[1] if found else None

    def _read(self, conn, ends: dict) -> None:
        kind, rank = ends[conn]
        if kind == "res":
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                del ends[conn]
                conn.close()
                return
            if message[0] == "ok":
                self.results[rank] = message[1]
            else:
                self.errors.setdefault(rank, message[1:])
            return
        data = _read_some(conn)
        if data:
            self.relay.feed(rank, kind, data)
        else:
            del ends[conn]
            conn.close()

    def _drain_result(self, rank: int, ends: dict) -> None:
        for conn, (kind, r) in list(ends.items()):
            if r == rank and kind == "res":
                while conn in ends and conn.poll(0):
                    self._read(conn, ends)

    def _drain(self, ends: dict) -> None:
        """Relay what the ranks printed last; stop waiting after a short grace."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        while ends and time.monotonic() < deadline:
            ready = multiprocessing.connection.wait(list(ends), deadline - time.monotonic())
            for conn in ready:
                self._read(conn, ends)
        for conn in list(ends):
            conn.close()
        ends.clear()

    def _first_failure(self) -> tuple[bool, LaunchError] | None:
        """(is it only a knock-on error?, the root cause among failures so far), or None."""
        candidates = []
        for rank, (exc_type, message, _tb) in self.errors.items():
            peer_fault = _looks_like_peer_failure(exc_type, message)
            candidates.append((2 if peer_fault else 0, rank, "raised"))
        for rank, code in self.exitcodes.items():
            if rank not in self.errors and (code != 0 or rank not in self.results):
                candidates.append((1, rank, "died"))
        if not candidates:
            return None
        priority, rank, kind = min(candidates)
        error = self._raised_error(rank) if kind == "raised" else self._died_error(rank)
        return priority == 2, error

    def _finished(self) -> tuple[list, list[int]]:
        done = sorted(self.results)
        return [self.results.get(r) for r in range(self.nprocs)], done

    def _raised_error(self, rank: int) -> RankRaised:
        exc_type, message, tb = self.errors[rank]
        results, done = self._finished()
        text = (f"rank {rank} of {self.nprocs} raised {exc_type}: {message}\n"
                f"The other ranks were stopped. The rank's traceback:\n{tb.rstrip()}"
                + _hint(exc_type, message) + _finished_note(done))
        return RankRaised(text, rank=rank, exc_type=exc_type, exc_message=message,
                          traceback_text=tb, results=results, finished=done)

    def _died_error(self, rank: int) -> RankDied:
        code = self.exitcodes[rank]
        signame = None
        if code < 0:
            signame = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            how = f"was killed by signal {signame}"
            hint = {"SIGKILL": " (killed from outside, or by the kernel's out-of-memory killer)",
                    "SIGSEGV": " (a crash in C/C++ code: a segmentation fault)"}.get(signame, "")
        else:
            how = f"exited with code {code} without returning a result"
            hint = " (os._exit or sys.exit in the rank's code?)"
        results, done = self._finished()
        last = self.relay.last_line(rank)
        text = (f"rank {rank} of {self.nprocs} {how}{hint}. The other ranks were stopped."
                + (f"\nIts last line of output: {last}" if last else "") + _finished_note(done))
        return RankDied(text, rank=rank, exitcode=code, signal_name=signame, results=results,
                        finished=done)

    def _timeout_error(self, unfinished: list[int]) -> LaunchTimeout:
        results, done = self._finished()
        last = {r: self.relay.last_line(r) for r in unfinished}
        lines = "\n".join(f"  rank {r}: {last[r] or '(printed nothing)'}" for r in unfinished)
        text = (f"timeout: rank(s) {', '.join(map(str, unfinished))} of {self.nprocs} had not "
                "finished; every rank was stopped. Last line each printed:\n" + lines +
                "\nA rank waiting forever is usually in a collective or barrier another rank never "
                "reached. Raise timeout= if the work is just slow." + _finished_note(done))
        return LaunchTimeout(text, unfinished=unfinished, last_lines=last, results=results,
                             finished=done)

    def _stop_all(self) -> None:
        """SIGKILL every rank's process group (the rank and its workers); reap the ranks."""
        if self.context is None or self.stopped:
            return
        self.stopped = True
        for p in self.context.processes:
            if p.pid is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)  # rank_entry made pid its process-group id
            except (ProcessLookupError, PermissionError):
                pass
            if p.is_alive():  # killed before setsid ran: its group was still ours
                p.kill()
        for p in self.context.processes:
            p.join(5)
            if p.exitcode is not None:
                p.close()  # release its sentinel fd now, not whenever the GC gets to it

    def _cleanup_error_files(self) -> None:
        for path in getattr(self.context, "error_files", []) or []:
            try:
                os.unlink(path)
            except (FileNotFoundError, TypeError):
                pass


@contextlib.contextmanager
def _inherited_env(env: dict | None):
    """With spawn, each rank's interpreter imports torch before rank_entry runs, so variables
    torch reads at import (TORCH_CPP_LOG_LEVEL) must be in the environment it is started with.
    Set them only while the ranks start, then restore the caller's environment exactly."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _read_some(conn) -> bytes:
    try:
        return os.read(conn.fileno(), 65536)
    except OSError:
        return b""


def _looks_like_peer_failure(exc_type: str, message: str) -> bool:
    """An error a rank raises because another rank failed first (not the root cause)."""
    text = f"{exc_type} {message}".lower()
    return any(s in text for s in ("connection closed by peer", "connection reset",
                                   "broken pipe", "distbackenderror", "timed out",
                                   "keyboardinterrupt"))


_HINTS = [
    (("clients joined", "waiting for clients"),
     "Rank 0's rendezvous store waited for ranks that never arrived: a rank did not call "
     "init_process_group (or returned or failed before it), or used another MASTER_PORT."),
    (("timed out", "timeout"),
     "A collective or barrier timed out: another rank never called the matching collective (a "
     "desync) or was stuck. Rerun with env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'} to have torch "
     "check that every rank calls the same collectives, or use dist.monitored_barrier to name "
     "the rank that did not arrive."),
]


def _hint(exc_type: str, message: str) -> str:
    text = f"{exc_type} {message}".lower()
    for needles, hint in _HINTS:
        if any(n.lower() in text for n in needles):
            return "\nWhat to do: " + hint
    return ""


def _finished_note(done: list[int]) -> str:
    if not done:
        return ""
    return (f"\nRanks {', '.join(map(str, done))} had finished: their return values are in this "
            "error's .results.")
