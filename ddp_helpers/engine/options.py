"""Every option and every refusal of bad input, for `launch`, `Ranks` and the `%ranks` magics
alike, made before anything starts or is sent: each message says what to do instead.

The magics' options are declared once, in OPTIONS and COMMANDS below: the magics' parsers,
their usage lines and `%ranks?`'s help are built from that table, and a value the magic parsed
is checked by the same functions as the Python API's (check_pool, check_cell, check_push,
check_launch; the rest are their parts)."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import pickletools
import socket
from pathlib import Path
from typing import Any

from .sets import main_guard
from .words.errors import LaunchRefused

START_METHODS = ("forkserver", "spawn")
OUTPUT_MODES = ("live", "by_rank", "none")

_MODULE_FIX = (
    "Spawned ranks are fresh processes: they import the function by its module and name, and a "
    "notebook's __main__ is not importable from another process. Put the function in a .py file "
    "and import it, for example:\n"
    "    %%writefile my_ranks.py\n"
    "    def work(rank, world_size):\n"
    "        ...\n"
    "then `import my_ranks` and `dh.launch(my_ranks.work, args=(2,), nprocs=2)`."
)


def max_procs() -> int:
    """The most ranks one launch may start here: each rank is a process with its own torch."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_launch(fn, args, nprocs, timeout, start_method, output, *, env=None, backend=None,
                 master_port=None) -> tuple[dict[str, str], int | None]:
    """Validate everything checkable in the parent, before any process starts (fn and args
    must reach the ranks by pickle).

    Returns the extra environment for the ranks and the caller's master_port (None: pick a
    free one)."""
    check_run_options(nprocs, timeout, start_method, output)
    if not isinstance(args, tuple):
        raise LaunchRefused(
            f"args must be a tuple (got {type(args).__name__}): fn is called as fn(rank, *args), "
            "as torch.multiprocessing.spawn does; write args=(x,) for one argument.")
    check_importable(fn)
    _check_payload(fn, args)
    extra_env = check_env(env)
    extra_env.update(check_backend(backend, nprocs))
    if master_port is not None:
        check_port_free("127.0.0.1", master_port)
    return extra_env, master_port


def start_line(nprocs: int, backend: str = "auto") -> str:
    """`%ranks start 3 --backend gloo`: the magic that starts ranks like these again. The
    backend is named if it was: left out, `auto` would start NCCL on a box with a GPU per
    rank, where a lesson's CPU tensors fail."""
    named = f" --backend {backend}" if backend != "auto" else ""
    return f"`%ranks start {nprocs}{named}`"


def check_pool(nprocs, backend, timeout, output, env, start_method="forkserver") -> dict:
    """Every refusal Ranks(...) (and `%ranks start`, before it stops running ranks) makes;
    returns the ranks' extra environment, which carries the backend."""
    check_run_options(nprocs, timeout, start_method, output)
    if timeout == float("inf"):
        raise LaunchRefused("timeout=inf: the ranks' process group needs a finite timeout for "
                            "one collective; give seconds, e.g. timeout=3600. Nothing was "
                            "started.")
    return {**check_env(env), **check_backend(backend, nprocs)}


def check_cell(code, targets, timeout, output, nprocs: int, returns=None) -> list[int]:
    """Refuse a cell that is not a string, bad targets, timeout, output or names to return;
    return the target ranks, sorted (all of them for None)."""
    if not isinstance(code, str):
        raise LaunchRefused(f"code must be a string of Python (got {type(code).__name__}).")
    targets = check_targets(targets, nprocs)
    check_timeout(timeout)
    check_output(output)
    check_returns(returns)
    return targets


def check_returns(names) -> None:
    """Refuse names to bring back that are not variable names (--return, returns=)."""
    if names is None:
        return
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise LaunchRefused(f"returns={names!r}: give a tuple of variable names, e.g. "
                            "returns=('loss', 'grads') (--return loss,grads in a %%ranks line). "
                            "Nothing was run.")
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise LaunchRefused(f"--return / returns=: {bad[0]!r} is not a variable name; give "
                            "names separated by commas, e.g. --return loss,grads "
                            "(returns=('loss', 'grads') in Python). Nothing was run.")


def check_push(values: dict, targets, nprocs: int) -> list[int]:
    """Refuse bad targets, and a pushed value the ranks could not receive; return the targets."""
    targets = check_targets(targets, nprocs)
    for name, value in values.items():
        check_sendable(value, f"push: {name} (a {type(value).__name__})",
                       plain_fix="Push plain data (numbers, strings, lists, dicts, CPU "
                                 "tensors). Nothing was sent.",
                       main_fix="Define it in a %%ranks cell and build the value there, or "
                                "push plain data. Nothing was sent.")
    return targets


def check_targets(targets, nprocs: int) -> list[int]:
    """Refuse ranks outside 0..nprocs-1; return the targets sorted, all ranks for None."""
    if targets is None:
        return list(range(nprocs))
    if isinstance(targets, int):
        targets = [targets]
    bad = [t for t in targets if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < nprocs]
    if bad or not targets:
        raise LaunchRefused(f"targets={targets!r}: give ranks from 0 to {nprocs - 1}, "
                            "e.g. targets=[0] (or --targets 0,1). Nothing was run.")
    return sorted(set(targets))


def check_run_options(nprocs, timeout, start_method, output) -> None:
    """Refuse a bad rank count, timeout, start method or output mode (launch and Ranks)."""
    check_nprocs(nprocs)
    check_timeout(timeout)
    if start_method not in START_METHODS:
        hint = (" 'fork' would copy this (multi-threaded, possibly CUDA-initialised) kernel into "
                "every rank, which can deadlock or crash." if start_method == "fork" else "")
        raise LaunchRefused(f"start_method={start_method!r}: use one of {START_METHODS}.{hint}")
    check_output(output)


def check_timeout(timeout) -> None:
    """Refuse a timeout that is not a number of seconds above 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchRefused(
            f"timeout={timeout!r}: give the number of seconds the whole run may take, above 0 "
            "(for example timeout=120). Nothing was started.")


def check_output(output) -> None:
    """Refuse an unknown output mode (a callable sink(rank, stream, line) is a mode too)."""
    if not callable(output) and output not in OUTPUT_MODES:
        raise LaunchRefused(f"output={output!r}: use one of {OUTPUT_MODES}, or a function "
                            "sink(rank, stream, line) that receives each line.")


def check_env(env: dict | None) -> dict[str, str]:
    """Refuse environment variables that are not strings; return a copy."""
    env = dict(env or {})
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise LaunchRefused(f"env={{{k!r}: {v!r}}}: environment variables are strings; "
                                f"write env={{{str(k)!r}: {str(v)!r}}}. Nothing was started.")
    return env


def check_backend(backend: str | None, nprocs: int) -> dict[str, str]:
    """Refuse an unknown backend, or nccl without GPUs; return the variable that forces it."""
    if backend is None:
        return {}
    from ..runtime import BACKEND_VAR, choose_backend  # late: runtime imports torch.distributed

    try:
        chosen = choose_backend(backend, nprocs)[0]
    except ValueError as e:
        raise LaunchRefused(f"{e} Nothing was started.") from e
    return {} if backend == "auto" else {BACKEND_VAR: chosen}


def check_nprocs(nprocs) -> None:
    """Refuse a rank count that is not an int from 1 to max_procs()."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise LaunchRefused(f"nprocs={nprocs!r}: give the number of ranks as an int, e.g. 2.")
    if nprocs < 1:
        raise LaunchRefused(
            f"nprocs={nprocs}: a run needs at least 1 rank (usually 2 here). Nothing was started.")
    if nprocs > max_procs():
        raise LaunchRefused(
            f"nprocs={nprocs} is more than this machine can hold: each rank is a process with its "
            f"own copy of torch (a few hundred MB), and this machine has {os.cpu_count()} cores; "
            f"the limit here is {max_procs()}. Use fewer ranks. Nothing was started.")


def check_importable(fn: Any) -> None:
    """Refuse a function the ranks could not import by module and name."""
    target = getattr(fn, "func", fn)  # functools.partial: check the wrapped function
    target = getattr(target, "__func__", target)  # bound method: check the function itself
    if not callable(target):
        raise LaunchRefused(f"fn={fn!r} is not callable: pass a function defined in a module.")
    name = getattr(target, "__qualname__", repr(target))
    module = getattr(target, "__module__", None)
    if name.endswith("<lambda>") or "<lambda>" in name:
        raise LaunchRefused(f"fn is a lambda ({name}): the ranks cannot import it by name. "
                            + _MODULE_FIX)
    if "<locals>" in name:
        raise LaunchRefused(
            f"fn {name} is defined inside another function (a nested function or closure): the "
            "ranks cannot import it by name. Define it at the top level of a module. "
            + _MODULE_FIX)
    if module == "__main__" and main_guard.main_is_script():
        # A script's function reaches the ranks as mp.spawn sends it: they re-run the script.
        check_guarded(f"fn {name}")
        return
    if module in (None, "__main__", "__mp_main__", "builtins"):
        where = "in the notebook (module __main__)" if module != "builtins" else "as a builtin"
        raise LaunchRefused(f"fn {name} is defined {where}, so the ranks cannot import it. "
                            + _MODULE_FIX)
    if importlib.util.find_spec(module) is None:
        raise LaunchRefused(
            f"fn {name} comes from module {module!r}, which a new process cannot import (it has "
            "no file on sys.path). " + _MODULE_FIX)


def _check_payload(fn, args: tuple) -> None:
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        raise LaunchRefused(f"fn {fn!r} cannot be pickled ({type(e).__name__}: {e}). "
                            + _MODULE_FIX) from e
    for i, arg in enumerate(args):
        check_sendable(arg, f"args[{i}] (a {type(arg).__name__})",
                       plain_fix="Pass plain data (numbers, strings, lists, dicts, CPU tensors) "
                                 "and build the rest inside the rank.",
                       main_fix="Move that class or function into a .py module. " + _MODULE_FIX)


def check_sendable(value, what: str, plain_fix: str, main_fix: str) -> None:
    """Refuse a value the ranks could not receive: one that cannot be pickled (`plain_fix` says
    what to send instead), or one that needs a class or function from the notebook's __main__,
    which the ranks cannot import (`main_fix` says where to define it)."""
    try:
        blob = pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        raise LaunchRefused(f"{what} cannot be pickled, so it cannot be sent to the ranks: "
                            f"{type(e).__name__}: {e}. {plain_fix}") from e
    main_refs = _main_globals(blob)
    if main_refs and main_guard.main_is_script():
        check_guarded(f"{what} refers to {', '.join(main_refs)}, which")
    elif main_refs:
        raise LaunchRefused(f"{what} refers to {', '.join(main_refs)} from the notebook "
                            f"(__main__), which the ranks cannot import. {main_fix}")


def guard_fix(site: main_guard.CallSite) -> str:
    """The paragraph that shows the guard around the call that needs it."""
    return (
        f"The call at {site.where()} runs at the script's top level, not under the guard "
        "`if __name__ == \"__main__\":`. Spawned ranks re-run the script to find what it "
        "defines, so without the guard every rank would start ranks of its own. Put the "
        "script's work under the guard:\n"
        "    if __name__ == \"__main__\":\n"
        f"        {site.text}\n"
        "or define the function in a module of its own and import it. Nothing was started.")


def check_guarded(what: str) -> None:
    """Refuse `what` (a function or value defined in the script) when the call is unguarded:
    the ranks could only find it by re-running the whole script."""
    site = main_guard.unguarded_call()
    if site is not None:
        raise LaunchRefused(f"{what} is defined in the script {Path(site.path).name}, which the "
                            "ranks would have to re-run to find it. " + guard_fix(site))


def _main_globals(blob: bytes) -> list[str]:
    """Names a pickle looks up in __main__ (they fail to unpickle in another process)."""
    found, strings, memo = [], [], {}
    last = None  # the string the previous opcode pushed, if any
    for op, arg, _ in pickletools.genops(io.BytesIO(blob)):
        pushed = None
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            pushed = arg
        elif op.name == "MEMOIZE":
            memo[len(memo)] = last
            pushed = last
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed = memo.get(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] == "__main__":
            found.append(f"__main__.{strings[-1]}")
        elif op.name == "GLOBAL" and str(arg).startswith("__main__ "):
            found.append("__main__." + str(arg).split(" ", 1)[1])
        if pushed is not None and op.name != "MEMOIZE":
            strings.append(pushed)
        last = pushed
    return found


def check_port_free(addr: str, port: int) -> None:
    """Refuse a caller-chosen MASTER_PORT that is no port, or that another process holds."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise LaunchRefused(f"master_port={port!r}: give a port number from 1 to 65535, or leave "
                            "it unset and launch picks a free one. Nothing was started.")
    with socket.socket() as s:
        # As torch's TCPStore does: a port whose last connections wait in TIME_WAIT can be
        # listened on again; one that a process listens on still fails to bind.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise LaunchRefused(
                f"master_port={port} on {addr} is already in use ({e.strerror}), so rank 0 could "
                "not start the rendezvous store there. Leave master_port unset and launch picks a "
                "free port, or stop the process holding it. Nothing was started.") from e
