"""`make lab` and `make kernel`: the lessons where learners open them.

A plain `jupyter lab` fails learners in three common places:

- as root (most Docker images, rented GPU boxes) it refuses to start without `--allow-root`;
- on a remote two-GPU box there is no display: it tries to open a browser that cannot open,
  and the learner needs the URL with its token and an ssh tunnel to reach it from a laptop;
- in VS Code, an existing JupyterLab or JupyterHub, the kit's environment must be a kernel.

`python -m ddp_helpers.lab serve [--port N] [--ip ADDR]` starts JupyterLab on `notebooks/`,
waits until it answers, and prints the URL with its token (plus the ssh line without a display).
`python -m ddp_helpers.lab kernel` registers this environment as the Jupyter kernel `ddp-kit`.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
DEFAULT_PORT = 8888
PORT_CHOICES = 50  # as Jupyter's own --port-retries: 8888, 8889, ... when PORT is not given
KERNEL_NAME = "ddp-kit"  # the conda environment's name too (environment.yml)
KERNEL_DISPLAY_NAME = "Python (ddp-kit)"
# Addresses that include the loopback interface: the URL says localhost and the tunnel ends there.
_WILDCARDS = {"0.0.0.0", "::", "*", ""}
_LOOPBACKS = {"localhost", "127.0.0.1", "::1"}
# Our own server is on this machine: never through an http_proxy a cluster may set.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class LabError(RuntimeError):
    """Why the lab could not start, and what to do."""


def is_root() -> bool:
    """True when running as root, which JupyterLab refuses unless given --allow-root."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def over_ssh(env: dict[str, str] | None = None) -> bool:
    """True in an ssh session: a browser opened here would not be the learner's."""
    env = os.environ if env is None else env
    return any(env.get(k) for k in ("SSH_CONNECTION", "SSH_CLIENT", "SSH_TTY"))


def has_display(env: dict[str, str] | None = None, platform: str = sys.platform) -> bool:
    """True where a browser can open: macOS and Windows always, Linux with X11 or Wayland."""
    env = os.environ if env is None else env
    if not platform.startswith("linux"):
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def opens_browser(env: dict[str, str] | None = None, platform: str = sys.platform) -> bool:
    """Whether JupyterLab should open a browser: a display, and not one forwarded over ssh (an
    X-forwarded browser would run on the remote box, slowly, not on the learner's laptop)."""
    return has_display(env, platform) and not over_ssh(env)


def user_name() -> str:
    """The name to ssh in as: the sudo caller's under sudo, else this process's user."""
    if os.environ.get("SUDO_USER") and is_root():
        return os.environ["SUDO_USER"]
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):  # Windows, or a container uid with no passwd entry
        return os.environ.get("USER") or os.environ.get("USERNAME") or "user"


def _port_is_free(ip: str, port: int) -> bool:
    """True if a server could listen on ip:port now. SO_REUSEADDR as Jupyter sets it, so a
    port left in TIME_WAIT by the previous lab counts as free, as it is for Jupyter."""
    host = None if ip in _WILDCARDS else ip
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LabError(f"IP={ip} is not an address of this machine ({e}); leave IP out for "
                       "localhost, or IP=0.0.0.0 for every interface") from e
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return False
                # e.g. ::1 on a host without IPv6: Jupyter skips that address too
    return True


def pick_port(ip: str, wanted: int | None) -> int:
    """`wanted` if free (else LabError naming the fix); without one, the first free port from
    8888 on, so the printed URL and ssh line name the port the server really has."""
    if wanted is not None:
        if not _port_is_free(ip, wanted):
            raise LabError(f"port {wanted} is in use on this machine (another lab?): choose "
                           f"another with `make lab PORT={wanted + 1}`, or stop the other server")
        return wanted
    for port in range(DEFAULT_PORT, DEFAULT_PORT + PORT_CHOICES):
        if _port_is_free(ip, port):
            return port
    raise LabError(f"ports {DEFAULT_PORT}-{DEFAULT_PORT + PORT_CHOICES - 1} are all in use: "
                   "choose one with `make lab PORT=...`")


def jupyter_command(root: Path, ip: str, port: int, *, as_root: bool, browser: bool
                    ) -> list[str]:
    """The `jupyter lab` command line (the token travels in the environment, see serve)."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", f"--ip={ip}",
           f"--port={port}", "--port-retries=0"]  # exactly the port we print, or fail
    if as_root:
        cmd.append("--allow-root")
    if not browser:
        cmd.append("--no-browser")
    return cmd


def _url_host(ip: str) -> str:
    """The host part of a URL that reaches a server bound to `ip` from this machine."""
    if ip in _WILDCARDS or ip in _LOOPBACKS:
        return "localhost"
    return f"[{ip}]" if ":" in ip else ip


def banner(ip: str, port: int, token: str, *, browser: bool, user: str, host: str
           ) -> list[str]:
    """What `make lab` prints once the server answers: the URL with its token, and how to reach
    it from a laptop when this machine has no browser of its own."""
    target = _url_host(ip)
    lines = ["lab: JupyterLab serves notebooks/ at", f"  http://{target}:{port}/lab?token={token}"]
    if not browser:
        tunnel_end = "localhost" if target == "localhost" else target.strip("[]")
        lines += ["lab: no browser opens here (no display, or an ssh session). From your "
                  "laptop, tunnel to it (with the name or address you ssh to):",
                  f"  ssh -L {port}:{tunnel_end}:{port} {user}@{host}",
                  "lab: then open the URL above on the laptop."]
    if ip in _WILDCARDS:
        lines += [f"lab: or directly, wherever port {port} of {host} is reachable:",
                  f"  http://{host}:{port}/lab?token={token}"]
    lines.append("lab: Ctrl-C stops the server (JupyterLab asks to confirm).")
    return lines


def _answers(base: str, token: str) -> bool:
    """True once the server's REST API answers an authenticated /api/status."""
    req = urllib.request.Request(f"{base}/api/status",
                                 headers={"Authorization": f"token {token}"})
    try:
        with _DIRECT.open(req, timeout=5) as resp:
            return "started" in json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_until_up(proc: subprocess.Popen, base: str, token: str, timeout: float,
                  stop: list[int]) -> bool:
    """Poll until the server answers (True), exits, is asked to stop or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not stop and time.monotonic() < deadline:
        if _answers(base, token):
            return True
        time.sleep(0.5)
    return False


def wait_for_exit(proc: subprocess.Popen, stop: list[int], grace: float = 2.0) -> int:
    """Wait for JupyterLab to exit; pass on a stop signal that it did not get itself.

    Ctrl-C, a closed terminal and a process-group kill reach JupyterLab directly (it shares our
    process group); forwarding those too would stop it twice. Only a signal sent to this process
    alone (`kill <pid>`) leaves JupyterLab running past the grace period, and is passed on."""
    forward_at = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if stop and forward_at is None:
            forward_at = time.monotonic() + grace
        elif forward_at is not None and time.monotonic() > forward_at:
            proc.send_signal(stop.pop())
            forward_at = None


def serve(ip: str = "localhost", port: int | None = None, root: Path = NOTEBOOKS,
          ready_timeout: float = 300) -> int:
    """Run JupyterLab on `root` until it stops; returns its exit status."""
    if not root.is_dir():
        raise LabError(f"{root} is not a folder: run `make lab` in the kit's checkout")
    port = pick_port(ip, port)
    as_root, browser = is_root(), opens_browser()
    if as_root:
        print("lab: running as root (as in most containers): passing --allow-root to JupyterLab")
    if ip in _WILDCARDS:
        who = "root" if as_root else "you"
        print(f"lab: WARNING: IP={ip or '*'} listens on every interface: anyone who can reach "
              f"port {port} and has the token can run code here as {who}. The token is the only "
              "protection; the ssh tunnel (leave IP out) is safer.", file=sys.stderr)
    # The token goes in the environment, not on the command line: other users of a shared box
    # can read any process's arguments (ps), but not its environment. A JUPYTER_TOKEN the learner
    # set is kept; an empty one would mean no token at all, which we never do.
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    env = {**os.environ, "JUPYTER_TOKEN": token}
    cmd = jupyter_command(root, ip, port, as_root=as_root, browser=browser)
    stop: list[int] = []  # stop signals received, for wait_for_exit
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda s, _frame: stop.append(s))
    # JupyterLab decides whether Ctrl-C stops it (it asks to confirm); we wait for its decision.
    signal.signal(signal.SIGINT, lambda *_: None)
    proc = subprocess.Popen(cmd, env=env)  # our process group: the terminal's signals reach it
    if wait_until_up(proc, f"http://{_url_host(ip)}:{port}", token, ready_timeout, stop):
        lines = banner(ip, port, token, browser=browser, user=user_name(),
                       host=socket.gethostname())
        print("\n" + "\n".join(lines) + "\n", flush=True)
    elif proc.poll() is not None:
        print(f"lab: JupyterLab exited with status {proc.returncode} before it answered (its "
              "messages are above).", file=sys.stderr)
    elif not stop:
        print(f"lab: JupyterLab has not answered within {ready_timeout:.0f} s; still waiting "
              f"(its token: {token}).", flush=True)
    returncode = wait_for_exit(proc, stop)
    return returncode if returncode >= 0 else 128 - returncode


def install_kernel(name: str = KERNEL_NAME, display_name: str = KERNEL_DISPLAY_NAME) -> Path:
    """Register this interpreter (the kit's environment) as a Jupyter kernel for this user, in
    Jupyter's data directory (JUPYTER_DATA_DIR when set); returns the kernelspec's folder."""
    from ipykernel.kernelspec import install

    return Path(install(user=True, kernel_name=name, display_name=display_name))


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ddp_helpers.lab {serve,kernel}`."""
    parser = argparse.ArgumentParser(prog="python -m ddp_helpers.lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve", help="JupyterLab on notebooks/, for root and remote boxes too")
    run.add_argument("--port", type=int, default=None,
                     help=f"the port (default: {DEFAULT_PORT}, or the next free one)")
    run.add_argument("--ip", default="localhost",
                     help="the address to listen on (default localhost; 0.0.0.0: everywhere)")
    sub.add_parser("kernel", help=f"register this environment as the Jupyter kernel "
                                  f"'{KERNEL_NAME}' (VS Code, another JupyterLab, JupyterHub)")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve(ip=args.ip, port=args.port)
        where = install_kernel()
    except LabError as e:
        print(f"lab: {e}", file=sys.stderr)
        return 2
    print(f"kernel: registered {sys.executable} as the Jupyter kernel '{KERNEL_DISPLAY_NAME}' "
          f"({where})\nkernel: pick it in VS Code (Select Kernel > Jupyter Kernel...), JupyterLab "
          f"or JupyterHub (Kernel > Change Kernel...); `jupyter kernelspec uninstall "
          f"{KERNEL_NAME}` removes it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
