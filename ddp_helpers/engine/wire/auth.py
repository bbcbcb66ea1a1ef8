"""The handshake every socket between the notebook and a served rank starts with: both sides
prove they hold the same token (HMAC-SHA256 over fresh random nonces) before either reads a
single message as a command. Raw bytes only: nothing here unpickles anything.

    notebook -> rank   MAGIC + server nonce (32 bytes)
    rank -> notebook   client nonce (32) + HMAC(token, b"rank" + server nonce + client nonce)
    notebook -> rank   HMAC(token, b"notebook" + client nonce + server nonce)

A fresh server nonce per connection makes a recorded answer worthless on the next one (no
replay); the second step makes the rank refuse a listener that does not hold the token (a fake
notebook cannot feed it cells). Every read is bounded in size (fixed lengths) and in time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import tempfile
import time

MAGIC = b"DDPH-SERVE-1\n"  # the handshake's name and version: another is refused before any nonce
NONCE = 32
DIGEST = 32
HANDSHAKE_SECONDS = 10.0  # how long a connecting peer may take to answer the challenge


class AuthError(Exception):
    """The peer did not prove it holds the token (or spoke another protocol)."""


def new_token_file(directory: str | None = None) -> str:
    """A fresh random token in a new file readable and writable by its owner only (0600)."""
    fd, path = tempfile.mkstemp(prefix="ddp_helpers_token_", dir=directory)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path


def token_file_at(path: str) -> str:
    """`path` holding a token: a fresh one (mode 0600) if the file does not exist yet."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        try:
            os.write(fd, secrets.token_hex(32).encode())
        finally:
            os.close(fd)
    return path


def read_token(path: str) -> bytes:
    """The token in `path`; refuses a file that others may read (someone could copy it)."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}): "
                        "chmod 600 it, since whoever reads it can run code on the ranks")
    with open(path, "rb") as f:
        token = f.read(1024).strip()
    if len(token) < 16:
        raise AuthError(f"{path} holds no token")
    return token


def _mac(token: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, role + b"".join(nonces), hashlib.sha256).digest()


def serve_challenge(sock: socket.socket, token: bytes, seconds: float = HANDSHAKE_SECONDS) -> None:
    """Notebook side: challenge a fresh connection; raise AuthError unless it answers right."""
    deadline = time.monotonic() + seconds
    server_nonce = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + server_nonce)
    answer = _read_exactly(sock, NONCE + DIGEST, deadline)
    client_nonce, digest = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(digest, _mac(token, b"rank", server_nonce, client_nonce)):
        raise AuthError("wrong answer to the challenge (no token, a wrong one, or a replay)")
    sock.sendall(_mac(token, b"notebook", client_nonce, server_nonce))


def answer_challenge(sock: socket.socket, token: bytes, seconds: float) -> None:
    """Rank side: answer the listener's challenge and check that it, too, holds the token."""
    deadline = time.monotonic() + seconds
    hello = _read_exactly(sock, len(MAGIC) + NONCE, deadline)
    if not hmac.compare_digest(hello[:len(MAGIC)], MAGIC):
        raise AuthError("the listener does not speak the ddp_helpers serve protocol")
    server_nonce = hello[len(MAGIC):]
    client_nonce = secrets.token_bytes(NONCE)
    sock.sendall(client_nonce + _mac(token, b"rank", server_nonce, client_nonce))
    proof = _read_exactly(sock, DIGEST, deadline)
    if not hmac.compare_digest(proof, _mac(token, b"notebook", client_nonce, server_nonce)):
        raise AuthError("the listener refused the token or does not hold it")


def _read_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError("the handshake took too long")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise AuthError("the handshake took too long") from None
        except OSError as e:
            raise AuthError(f"the connection failed during the handshake: {e}") from None
        if not chunk:
            raise AuthError("the peer closed the connection during the handshake")
        data += chunk
    return data
