"""Every accepted HTTP connection has TCP_NODELAY set, checked on the server's own socket.

Without it a kept-alive response's header and body segments wait on the client's
delayed ACK (~40 ms a request). The check is functional, not a timing: the test opens a
kept-alive connection, finds the server process's file descriptor for it (by the
connection's ports in /proc), takes a duplicate of it with ``pidfd_getfd`` and reads the
option off the very socket the server writes to.
"""

from __future__ import annotations

import ctypes
import os
import socket
import uuid
from pathlib import Path

import pytest

from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.procs import gateway, serve

_SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64


def _inode_of_connection(pid: int, server_port: int, client_port: int) -> int:
    """The socket inode of the server side of (server_port <- client_port), from /proc."""
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if (local_port, remote_port) == (server_port, client_port):
                return int(fields[9])
    raise AssertionError(f"no connection {server_port} <- {client_port} in process {pid}")


def _fd_of_inode(pid: int, inode: int) -> int:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                return int(fd)
        except OSError:
            continue
    raise AssertionError(f"process {pid} holds no fd for socket inode {inode}")


def _server_nodelay(pid: int, server_port: int, client: socket.socket) -> int:
    """TCP_NODELAY as set on the server's socket for ``client``'s connection."""
    inode = _inode_of_connection(pid, server_port, client.getsockname()[1])
    remote_fd = _fd_of_inode(pid, inode)
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, remote_fd, 0)
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"pidfd_getfd: {os.strerror(errno)}")
    finally:
        os.close(pidfd)
    with socket.socket(fileno=fd) as server_side:
        return server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _keep_alive_request(port: int) -> socket.socket:
    """A connection that has had one full request and response, and stays open."""
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = client.recv(4096)
        assert chunk, "the server closed the connection"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return client


def _check(pid: int, base: str) -> None:
    port = int(base.rsplit(":", 1)[1])
    with _keep_alive_request(port) as client:
        assert _server_nodelay(pid, port, client) != 0, \
            "the server's socket for a kept-alive connection has Nagle on (no TCP_NODELAY)"


def test_serve_sets_nodelay_on_accepted_connections(tmp_path: Path) -> None:
    proc, base = serve(tmp_path)
    try:
        _check(proc.pid, base)
    finally:
        proc.stop()


@pytest.mark.rabbitmq
def test_gateway_sets_nodelay_on_accepted_connections(tmp_path: Path) -> None:
    require_rabbitmq()
    # Queues and events of its own: the shared broker serves the other test process too.
    proc, base = gateway(tmp_path, rabbitmq_url(),
                         own_deployment(f"nodelay{uuid.uuid4().hex[:8]}"),
                         "gateway")
    try:
        _check(proc.pid, base)
    finally:
        proc.stop()
