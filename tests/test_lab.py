"""`make lab` and `make kernel` work where learners open the lessons: as root (this machine's
case, and most containers'), as an ordinary user, on a box without a display (the URL with its
token, and the ssh line to reach it), and from another front end (the kit's kernel).

The server tests run the real `make lab` with a fresh Jupyter configuration of their own, and
stop it by killing its process group, whatever the test's outcome."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from ddp_helpers import lab

REPO = Path(__file__).resolve().parents[1]
URL = re.compile(r"http://localhost:(\d+)/lab\?token=([0-9A-Za-z_-]+)")
# Variables that would change what make lab decides or serves: a display, an ssh session, a
# learner's token or Jupyter configuration, a sudo caller, make's own PORT and IP.
_OUTSIDE = ("DISPLAY", "WAYLAND_DISPLAY", "SSH_CONNECTION", "SSH_CLIENT", "SSH_TTY", "SUDO_USER",
            "PORT", "IP", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jupyter_env(state: Path) -> dict[str, str]:
    """This environment, headless, with Jupyter's configuration, data and runtime in `state`."""
    env = {k: v for k, v in os.environ.items()
           if k not in _OUTSIDE and not k.startswith(("JUPYTER", "JPY"))}
    for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                      ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                      ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
        (state / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(state / sub)
    return env


def _get(url: str, token: str | None = None):
    headers = {"Authorization": f"token {token}"} if token else {}
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy
    with direct.open(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return r.status, json.loads(r.read())


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _in_group(pgid: int) -> list[str]:
    """Live processes of process group `pgid`, wherever they were reparented."""
    left = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and _pgid(p.info["pid"]) == pgid:
            left.append(" ".join(p.info["cmdline"] or [])[:120])
    return left


class MakeLab:
    """One `make lab` in a session of its own, its output in a log file."""

    def __init__(self, state: Path, user: str | None):
        self.state, self.user = state, user
        self.log = state / "make-lab.log"
        self.port = _free_port()
        env = _jupyter_env(state)
        run_as = {}
        if user is not None:  # an unprivileged user: its own home, no bytecode written here
            import pwd

            entry = pwd.getpwnam(user)
            shutil.chown(state, entry.pw_uid, entry.pw_gid)
            for sub in state.iterdir():
                shutil.chown(sub, entry.pw_uid, entry.pw_gid)
            env.update(HOME=str(state), USER=user, LOGNAME=user, PYTHONDONTWRITEBYTECODE="1")
            run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["make", "--no-print-directory", "lab", f"PORT={self.port}"], cwd=REPO, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, **run_as)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_url(self, timeout: float = 300) -> tuple[int, str]:
        """The port and token of the URL make lab printed once its server answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = URL.search(self.output())
            if found:
                return int(found.group(1)), found.group(2)
            if self.proc.poll() is not None:
                pytest.fail(f"make lab exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.5)
        pytest.fail(f"make lab printed no URL within {timeout:.0f} s:\n{self.output()}")

    def server_process(self) -> psutil.Process:
        """The JupyterLab process below make and the launcher."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            if "jupyterlab" in " ".join(p.cmdline()):
                return p
        pytest.fail(f"no JupyterLab process below make lab:\n{self.output()}")

    def stop(self) -> list[str]:
        """Kill the session's process group (TERM, then KILL); what is still alive in it."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            deadline = time.monotonic() + wait
            while _in_group(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not _in_group(self.proc.pid):
                break
        return _in_group(self.proc.pid)


@pytest.fixture
def make_lab():
    """Start `make lab` as this user (None) or another; always stopped at the end."""
    started: list[MakeLab] = []
    folders: list[Path] = []

    def start(user: str | None = None) -> MakeLab:
        state = Path(tempfile.mkdtemp(prefix="kit-lab-"))  # not under pytest's 0700 folders
        os.chmod(state, 0o755)
        folders.append(state)
        started.append(MakeLab(state, user))
        return started[-1]

    yield start
    left = [line for run in started for line in run.stop()]
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"make lab left processes running: {left}"


def _unprivileged_user() -> str:
    """'nobody', when this test runs as root and the machine has it; else skip."""
    if not lab.is_root():
        pytest.skip("runs the server as another user: needs root (as this user, it is covered)")
    import pwd

    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here to run the server as")
    # A venv made from an interpreter in root's home (pyenv's) cannot run as anyone else.
    python = REPO / ".venv" / "bin" / "python"
    try:
        probe = subprocess.run([str(python), "-c", "import jupyterlab"], user="nobody",
                               cwd="/", capture_output=True, text=True, timeout=120)
        why = probe.stderr.strip()[-200:] if probe.returncode else ""
    except PermissionError as e:
        why = str(e)
    if why:
        pytest.skip(f"'nobody' cannot run the venv's python here: {why}")
    return "nobody"


@pytest.mark.slow
@pytest.mark.parametrize("who", ["this-user", "unprivileged-user"])
def test_make_lab_serves_the_notebooks_with_the_printed_token_and_stops(make_lab, who):
    user = _unprivileged_user() if who == "unprivileged-user" else None
    run = make_lab(user)
    port, token = run.wait_for_url()
    out = run.output()
    assert port == run.port
    server = run.server_process()
    expected_user = user or lab.user_name()
    import pwd

    assert pwd.getpwuid(server.uids().effective).pw_name == expected_user
    # root gets --allow-root, said in one line; an ordinary user neither needs nor sees it
    as_root = server.uids().effective == 0
    assert ("running as root" in out) == as_root
    assert ("--allow-root" in " ".join(server.cmdline())) == as_root
    assert "Running as root is not recommended" not in out
    # no display: no browser, and the line that tunnels to this port from a laptop
    assert "--no-browser" in server.cmdline()
    assert f"ssh -L {port}:localhost:{port} {expected_user}@{socket.gethostname()}" in out

    base = f"http://127.0.0.1:{port}"
    status, body = _get(f"{base}/api/status", token)
    assert status == 200 and "started" in body
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(f"{base}/api/contents")  # without the token
    assert refused.value.code == 403
    _, listing = _get(f"{base}/api/contents", token)
    assert "00_check_your_setup.ipynb" in {item["name"] for item in listing["content"]}

    assert run.stop() == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_busy_port_is_refused_with_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(lab.LabError, match=rf"port {port} is in use.*make lab PORT={port + 1}"):
            lab.pick_port("localhost", port)
        with pytest.raises(lab.LabError, match="IP=0.0.0.0"):
            lab.pick_port("no-such-host.invalid", port)


def test_without_a_port_the_first_free_one_from_8888_is_taken():
    first = lab.pick_port("localhost", None)
    assert lab.DEFAULT_PORT <= first < lab.DEFAULT_PORT + lab.PORT_CHOICES
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        second = lab.pick_port("localhost", None)
    assert second != first and lab.DEFAULT_PORT <= second < lab.DEFAULT_PORT + lab.PORT_CHOICES


@pytest.mark.parametrize("as_root", [True, False])
def test_allow_root_is_passed_only_as_root(as_root):
    cmd = lab.jupyter_command(REPO / "notebooks", "localhost", 8888, as_root=as_root,
                              browser=True)
    assert ("--allow-root" in cmd) == as_root
    assert "--no-browser" not in cmd and "--port-retries=0" in cmd


@pytest.mark.parametrize("env, platform, opens", [
    ({}, "linux", False),
    ({"DISPLAY": ":0"}, "linux", True),
    ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", True),
    ({"DISPLAY": "localhost:10.0", "SSH_CONNECTION": "10.0.0.2 5555 10.0.0.1 22"}, "linux", False),
    ({}, "darwin", True),
    ({"SSH_TTY": "/dev/pts/0"}, "darwin", False),
])
def test_a_browser_opens_only_on_a_local_display(env, platform, opens):
    assert lab.opens_browser(env, platform) is opens


def test_the_banner_says_how_to_reach_the_server():
    headless = "\n".join(lab.banner("localhost", 8890, "abc", browser=False, user="ada",
                                    host="gpubox"))
    assert "http://localhost:8890/lab?token=abc" in headless
    assert "ssh -L 8890:localhost:8890 ada@gpubox" in headless
    local = "\n".join(lab.banner("localhost", 8890, "abc", browser=True, user="ada",
                                 host="laptop"))
    assert "http://localhost:8890/lab?token=abc" in local and "ssh" not in local
    exposed = "\n".join(lab.banner("0.0.0.0", 8890, "abc", browser=False, user="ada",
                                   host="gpubox"))
    assert "http://gpubox:8890/lab?token=abc" in exposed
    assert "http://localhost:8890/lab?token=abc" in exposed


@pytest.mark.slow
def test_make_kernel_registers_the_kits_venv_python(tmp_path):
    env = _jupyter_env(tmp_path)
    done = subprocess.run(["make", "--no-print-directory", "kernel"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    spec_file = tmp_path / "data" / "kernels" / lab.KERNEL_NAME / "kernel.json"
    spec = json.loads(spec_file.read_text())
    python = Path(spec["argv"][0])
    # The venv's own python, not the interpreter its symlink points to (that lacks the kit).
    assert python.name.startswith("python")
    assert python.parent.resolve() == (REPO / ".venv" / "bin").resolve()
    assert spec["argv"][spec["argv"].index("-m") + 1] == "ipykernel_launcher"
    assert spec["display_name"] == lab.KERNEL_DISPLAY_NAME
    # Jupyter itself finds it there, and that python imports this checkout's kit and ipykernel.
    listed = subprocess.run([str(python), "-m", "jupyter", "kernelspec", "list", "--json"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)["kernelspecs"][lab.KERNEL_NAME]
    assert Path(found["resource_dir"]).resolve() == spec_file.parent.resolve()
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('ddp_helpers').origin);"
                            " print(u.find_spec('ipykernel') is not None)"],
        env=env, capture_output=True, text=True, timeout=120)
    origin, has_ipykernel = probe.stdout.split()
    assert Path(origin).resolve() == (REPO / "ddp_helpers" / "__init__.py").resolve()
    assert has_ipykernel == "True"


def test_start_here_says_how_to_reach_the_lab_and_when_to_use_the_kernel():
    readme = (REPO / "README.md").read_text()
    start = readme[readme.index("## Start here"):readme.index("\n## ", readme.index("## Start"))]
    for needed in ("make lab", "make lab PORT=", "IP=0.0.0.0", "ssh -L", "make kernel",
                   "VS Code", "JupyterHub", "--allow-root"):
        assert needed in start, f"README's Start here does not mention {needed!r}"
