"""Served ranks (`python -m ddp_helpers.serve`, `dh.Ranks.listen`): ranks that torchrun started,
attached to the notebook over authenticated sockets. Two torchrun agents act as two nodes (c10d
on loopback); the security cases attack the listening port with junk, a wrong token, a replayed
handshake and a connection after every rank is in; under `torchrun --max-restarts` the
restarted workers attach again as a fresh group (and a stale worker of the old one cannot).
Real processes, real gloo.

Where two processes fail together, only what is guaranteed is asserted: the killed rank's
connection closes at once, while its peer first gets a gloo error (a knock-on, reported after a
death) and is stopped by the pool, so the killed rank is the one named."""

import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest

import ddp_helpers as dh
from ddp_helpers.engine.rank import serve as served_rank
from ddp_helpers.engine.sets.listener import Attached, Listener
from ddp_helpers.engine.wire import auth
from ddp_helpers.engine.wire.channel import over_socket, parse_address
from ddp_helpers.engine.wire.messages import Hello, Setup
from ddp_helpers.lessons import beyond_one_machine as lesson

HANG_GUARD = 240  # seconds: only stops a hung run, never a pass/fail criterion


def test_two_torchrun_nodes_attach_run_collectives_and_report_a_killed_worker(tmp_path):
    pool = dh.Ranks.listen(2, timeout=60)
    agents = lesson.served_agents(pool, nnodes=2, nproc_per_node=1, log_dir=tmp_path)
    try:
        pool.wait_ready(HANG_GUARD, progress=False)
        seen = pool.run("import os\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
                        "(int(os.environ['RANK']), int(os.environ['GROUP_RANK']), "
                        "int(os.environ['LOCAL_RANK']), t.item())", output="none")
        assert [s[0] for s in seen] == [0, 1]  # run() returns in RANK order
        assert sorted(s[1] for s in seen) == [0, 1]  # one rank on each "node"
        assert [s[2] for s in seen] == [0, 0]  # the only worker of its node
        assert [s[3] for s in seen] == [3.0, 3.0]
        table = str(pool.status())
        assert "GROUP_RANK" in table and f"host {socket.gethostname()}" in table
        pool.push(x=5)
        assert pool.get("x") == [5, 5]
        with pytest.raises(dh.RankDied) as info:
            # Rank 0 waits outside any collective: were it in an all-reduce, its gloo error
            # could reach the notebook before rank 1's closed connection, and which rank is
            # named first would be a race.
            pool.run("import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), "
                     "signal.SIGKILL)\ntime.sleep(60)", timeout=HANG_GUARD, output="none")
        text = str(info.value)
        assert info.value.rank == 1
        assert f"host {socket.gethostname()}" in text and "GROUP_RANK" in text
        assert "torchrun" in text  # says what became of the jobs
        # the killed rank did not exit with code 3: only the ranks still running were closed
        assert "ranks still running, so each of them exited (code 3)" in text
        codes = lesson.agents_ended(agents, timeout=HANG_GUARD)
        assert None not in codes  # both agents ended by themselves: nothing left behind
        assert 0 not in codes  # each agent reports a failure: none waits in its exit barrier
        with pytest.raises(dh.LaunchRefused, match="listen"):
            pool.run("1")
    finally:
        pool.stop()
        lesson.agents_ended(agents, timeout=30)


def test_served_ranks_feed_the_ledger_and_a_mismatch_is_named(tmp_path, capsys):
    # Served ranks send their ledger lines over the connection: --ledger's record and the
    # mismatch naming work as for the ranks the kit forks.
    pool = dh.Ranks.listen(2, timeout=60)
    agents = lesson.served_agents(pool, log_dir=tmp_path, max_restarts=1)
    try:
        pool.wait_ready(HANG_GUARD, progress=False)
        pool.run("t = torch.ones(3)\ndist.all_reduce(t)\ndist.broadcast(t, src=0)",
                 label="In [4]", first_line=2, output="none")
        calls = pool.collectives()
        assert [[c.text() for c in calls[r]] for r in (0, 1)] == \
            [["all_reduce #1 float32[3]", "broadcast #2 float32[3]"]] * 2
        assert pool.place(calls[1][1].where) == "In [4], line 4"
        # Looking inside served ranks works as for forked ones: post-mortem, where, compare.
        with pytest.raises(dh.RankRaised):
            pool.run("y = t * rank\nif rank == 1:\n    raise KeyError('y')", output="none")
        assert "keeps for post-mortem (%ranks debug 1): KeyError" in str(pool.where())
        pool.debug(1, commands=["p y", "q"])
        assert "(Pdb rank 1) p y\ntensor([2., 2., 2.])" in capsys.readouterr().out
        assert pool.compare("t", "y").differs == ["y"]
        with pytest.raises(dh.CollectiveMismatch) as info:
            pool.run("t = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n"
                     "    dist.broadcast(t, src=0)", label="In [5]", first_line=2,
                     timeout=HANG_GUARD, output="none")
        text = str(info.value)
        assert "rank 0 is in all_reduce #1 float32[4] (In [5], line 4)" in text
        assert "rank 1 is in broadcast #1 float32[4] (In [5], line 6)" in text
        assert "torchrun restarts the workers" in text
        # A shape mismatch after a loop of matching calls: gloo aborts a rank within
        # milliseconds, and each line left the rank before its collective began.
        with pytest.raises(dh.CollectiveMismatch) as info:
            pool.run("for step in range(11):\n    t = torch.ones(4 + (rank if step == 10 else 0))"
                     "\n    dist.all_reduce(t)", label="In [6]", first_line=2,
                     timeout=HANG_GUARD, output="none")
        assert "float32[4] on rank 0, float32[5] on rank 1" in str(info.value)
        assert "all_reduce #11" in str(info.value)
        codes = lesson.agents_ended(agents, timeout=HANG_GUARD)
        assert None not in codes  # the mismatch ended the jobs: nothing left behind
    finally:
        pool.stop()
        lesson.agents_ended(agents, timeout=30)


def _hello_from(pool, hello: Hello):
    """Attach as `hello` with the right token; the listener's answer (a Setup or Refused)."""
    host, port = parse_address(pool.address)
    sock = socket.create_connection((host, port), timeout=10)
    auth.answer_challenge(sock, auth.read_token(pool.token_file), seconds=10)
    chan = over_socket(sock)
    try:
        chan.send(hello)
        return chan.recv_small(10)
    finally:
        chan.transport.close()


def test_torchrun_max_restarts_reattach_as_a_fresh_group(tmp_path, capsys):
    """torchrun --max-restarts 2: a worker killed in a cell, then one killed between cells;
    each time torchrun restarts every worker, the next cell says so once and runs on the
    fresh group, and a stale worker of the old group cannot attach."""
    pool = dh.Ranks.listen(2, timeout=60)
    agents = lesson.served_agents(pool, log_dir=tmp_path, max_restarts=2)
    try:
        pool.wait_ready(HANG_GUARD, progress=False)
        old = pool.hosts()
        pool.run("kept = 7", output="none")
        assert "torchrun restarts so far: 0 (--max-restarts 2)" in str(pool.status())
        with pytest.raises(dh.RankDied) as info:  # killed in a cell (see the first test)
            pool.run("import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), "
                     "signal.SIGKILL)\ntime.sleep(60)", timeout=HANG_GUARD, output="none")
        assert info.value.rank == 1 and "torchrun restarts the workers" in str(info.value)
        # A worker of the old group (its pid) is refused, though it holds the token.
        stale = _hello_from(pool, old[1])
        assert "old generation" in stale.reason
        capsys.readouterr()
        cell = ("t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
                "(t.item(), 'kept' in globals(), __import__('os').getpid())")
        first = pool.run(cell, timeout=HANG_GUARD, output="none")
        said = capsys.readouterr().out
        assert "torchrun restarted the workers (restart 1): rank 1 on " in said
        assert "the 2 ranks are a fresh group" in said
        assert [f[:2] for f in first] == [(3.0, False), (3.0, False)]  # a group; kept is gone
        assert not {f[2] for f in first} & {h.pid for h in old}  # new processes
        assert "torchrun restarts so far: 1" in str(pool.status())
        assert pool.run("kept = 8", output="none") == [None, None]  # and it goes on working
        # Killed between cells: the next cell notices before it runs anything.
        os.kill(first[1][2], signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD
        while pool.connected() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # torchrun restarted both workers; they attached again
        second = pool.run(cell, timeout=HANG_GUARD, output="none")
        said = capsys.readouterr().out
        assert "torchrun restarted the workers (restart 2): " in said and "had died" in said
        assert [f[:2] for f in second] == [(3.0, False), (3.0, False)]
        pool.stop()
        assert lesson.agents_ended(agents, timeout=HANG_GUARD) == [0, 0]  # clean, nothing left
        assert not os.path.exists(pool.token_file)
    finally:
        pool.stop()
        lesson.agents_ended(agents, timeout=30)


def test_the_listener_takes_only_a_fresh_generation_after_a_restartable_group():
    """The admission rule on its own: after a group whose agents have restarts left, the port
    stays open for workers that are new processes with restart counts no lower than theirs."""
    listener = Listener(2, "127.0.0.1", 0, Setup())
    try:
        host = socket.gethostname()
        old = [Hello(r, 2, 0, r, host, 100 + r, restart=1, max_restarts=3) for r in range(2)]
        listener.previous = old
        assert "old generation" in listener._why_not(old[1])  # the same process again
        older = Hello(1, 2, 0, 1, host, 201, restart=0, max_restarts=3)
        assert "TORCHELASTIC_RESTART_COUNT 0" in listener._why_not(older)
        # Node 0 counted no failure (it restarted because node 1 did): its count may stay.
        assert listener._why_not(Hello(0, 2, 0, 0, host, 200, restart=1, max_restarts=3)) is None
        assert listener._why_not(Hello(1, 2, 0, 1, host, 201, restart=2, max_restarts=3)) is None
        assert "WORLD_SIZE is 4" in listener._why_not(Hello(1, 4, 0, 1, host, 202, restart=2))
        listener.attached = {r: Attached(h, None) for r, h in enumerate(old)}
        listener.take()
        assert listener.listening  # restarts left on every node: open for the next group
        spent = [Hello(r, 2, 0, r, host, 300 + r, restart=3, max_restarts=3) for r in range(2)]
        listener.attached = {r: Attached(h, None) for r, h in enumerate(spent)}
        listener.take()
        assert not listener.listening  # no restart left: nobody else may attach
    finally:
        listener.shutdown()


class _RunsCode:
    """Unpickling this creates `path`: the proof that a peer's bytes were unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload  # multiprocessing.Connection's framing


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(auth.HANDSHAKE_SECONDS * 2)
    try:
        while sock.recv(4096):
            pass
        return True
    except OSError:  # reset: closed as well
        return True


def _served_rank(pool, rank: int, world: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "ddp_helpers.serve", "--connect",
                             pool.address, "--token-file", pool.token_file], env=env,
                            cwd=lesson.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_port_runs_nothing_for_a_peer_without_the_token(tmp_path):
    marker = tmp_path / "unpickled"
    evil = _framed(pickle.dumps(_RunsCode(marker))) + b"\0" * 128
    pool = dh.Ranks.listen(2, timeout=60)
    port = dh.free_port()
    ranks = [_served_rank(pool, 0, 2, port)]
    try:
        host, p = pool.address.split(":")
        # Junk (a pickle that would run code) instead of answering the challenge.
        with socket.create_connection((host, int(p))) as junk:
            junk.sendall(evil)
            assert _closed_by_peer(junk)
        # A wrong token: the listener does not answer with its proof, and closes.
        wrong = tmp_path / "wrong"
        wrong.write_text("0" * 64)
        wrong.chmod(0o600)
        with socket.create_connection((host, int(p))) as bad:
            with pytest.raises(auth.AuthError):
                auth.answer_challenge(bad, auth.read_token(str(wrong)), seconds=10)
            with pytest.raises(OSError):
                bad.sendall(evil)
                bad.sendall(evil)
                assert not bad.recv(1)  # closed
                raise OSError("closed")
        # A replay: an answer that was right for one connection's nonce, sent on the next.
        token = auth.read_token(pool.token_file)
        with socket.create_connection((host, int(p))) as first:
            first.settimeout(10)
            nonce = auth._read_exactly(first, len(auth.MAGIC) + auth.NONCE, 1e9)[len(auth.MAGIC):]
            mine = os.urandom(auth.NONCE)
            recorded = mine + auth._mac(token, b"rank", nonce, mine)
        with socket.create_connection((host, int(p))) as replay:
            auth._read_exactly(replay, len(auth.MAGIC) + auth.NONCE, 1e9)
            replay.sendall(recorded + evil)
            assert _closed_by_peer(replay)
        # The pool still takes the ranks it waits for, and works.
        ranks.append(_served_rank(pool, 1, 2, port))
        pool.wait_ready(HANG_GUARD, progress=False)
        assert pool.refusals >= 4  # junk, wrong token, the recorded one, the replay
        # Every rank is in: the port is closed, so no one else can attach (nor a 2nd notebook).
        with pytest.raises(OSError):
            with socket.create_connection((host, int(p)), timeout=5) as late:
                late.sendall(evil)
                assert not late.recv(1)
                raise OSError("closed")
        assert pool.run("rank * 10", output="none") == [0, 10]
        assert not marker.exists()  # nothing any attacker sent was unpickled
        pool.stop()
        assert [r.wait(HANG_GUARD) for r in ranks] == [0, 0]  # `%ranks stop`: clean exits
        assert not os.path.exists(pool.token_file)
    finally:
        pool.stop()
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()


def test_a_rank_refuses_a_listener_that_lacks_its_token(tmp_path):
    """A second notebook (another token) cannot feed cells to a rank meant for the first."""
    token_file = auth.new_token_file(str(tmp_path))
    other = Listener(1, "127.0.0.1", 0, Setup())  # its own fresh token
    try:
        with pytest.raises(SystemExit, match="refused|closed"):
            served_rank.attach(other.address, token_file, seconds=10)
        assert not other.attached and other.refusals == 1
    finally:
        other.close()
        other.remove_token()


def test_token_files_are_private(tmp_path):
    path = auth.new_token_file(str(tmp_path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(auth.AuthError, match="chmod 600"):
        auth.read_token(path)


def test_listen_prints_what_to_paste_and_warns_off_loopback(capsys):
    pool = dh.Ranks.listen(4, timeout=60)
    assert pool.address.startswith("127.0.0.1:")  # loopback unless told otherwise
    assert "reachable" not in capsys.readouterr().out
    wide = dh.Ranks.listen(1, host="0.0.0.0")
    wide.stop()
    assert "reachable from other machines" in capsys.readouterr().out
    try:
        lines = pool.command_lines(nnodes=2)
        assert f"--connect {pool.address} --token-file {pool.token_file}" in lines["torchrun"]
        assert "--nnodes 2 --nproc-per-node 2" in lines["torchrun"] and "srun" in lines["srun"]
        with pytest.raises(dh.LaunchRefused, match="0 of 4 ranks connected"):
            pool.wait_ready(0.5, progress=False)
    finally:
        pool.stop()


_NOTEBOOK = """
import sys, time
import ddp_helpers as dh
pool = dh.Ranks.listen(1, port=int(sys.argv[1]), token_file=sys.argv[2], output="none")
pool.wait_ready(240, progress=False)
print(pool.run("rank + 41", output="none")[0], flush=True)
time.sleep(600)
"""


def test_a_dying_kernel_makes_its_served_ranks_exit(tmp_path):
    token_file = auth.token_file_at(str(tmp_path / "token"))
    port = dh.free_port()
    kernel = subprocess.Popen([sys.executable, "-c", _NOTEBOOK, str(port), token_file],
                              stdout=subprocess.PIPE, text=True, cwd=lesson.ROOT)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(dh.free_port())}
    rank = subprocess.Popen([sys.executable, "-m", "ddp_helpers.serve", "--connect",
                             f"127.0.0.1:{port}", "--token-file", token_file], env=env,
                            cwd=lesson.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert kernel.stdout.readline().strip() == "41"  # attached, and ran a cell
        kernel.kill()  # the kernel dies without stopping its ranks
        kernel.wait()
        assert rank.wait(HANG_GUARD) == served_rank._GONE_EXIT
    finally:
        for p in (kernel, rank):
            if p.poll() is None:
                p.kill()
                p.wait()
        kernel.stdout.close()


def test_ranks_listen_magic_prints_the_lines_and_makes_the_pool_current(capsys):
    from ddp_helpers.engine import current
    from ddp_helpers.engine.magic import ranks_line

    pool = ranks_line("listen 2 --nodes 2")
    try:
        out = capsys.readouterr().out
        assert f"--connect {pool.address} --token-file {pool.token_file}" in out
        assert "srun" in out and current() is pool
        assert "not running (not attached yet" in str(ranks_line("status"))
        with pytest.raises(dh.LaunchRefused, match="cannot be restarted"):
            ranks_line("restart")
    finally:
        ranks_line("stop")
    assert not os.path.exists(pool.token_file)
