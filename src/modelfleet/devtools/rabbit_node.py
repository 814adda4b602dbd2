"""A private RabbitMQ node for scale tests and benchmarks, never the shared one.

A machine's shared RabbitMQ is usually started with the OS default of 1,024 file
descriptors, and a quorum queue holds descriptors of its own: a test or benchmark
that declares hundreds of model queues on it can lock every other client out until
the queues expire. ``RabbitNode`` starts a node of its own instead: a unique node
name, AMQP and distribution ports free at run time, its data and logs under a
directory of its own, a config file that listens on loopback only, and a raised
descriptor limit (``ulimit -n``). ``stop`` shuts it down and removes nothing but
what it created.

Used by the tests (``tests/private_rabbit.py`` wraps it in a pytest fixture) and by
the benchmarks (``bench/``): it lives in the package, rather than under ``tests/``,
so that a benchmark can import it without importing the test tree. It is a
development tool, not part of serving: nothing in ``modelfleet`` imports it.

    with RabbitNode.started(Path("/tmp/x")) as node:
        broker = AmqpBroker(BrokerSettings(url=node.url))
        ...
        node.resources()  # descriptors and memory of the node, for measurements
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_FD_LIMIT = 20_000
# The CLI tools (rabbitmqctl) take their own distribution port at the node's + 10,000
# (RABBITMQ_CTL_DIST_PORT_MIN): a node's port above 55,535 would leave them none.
DIST_PORT_RANGE = (20_000, 30_000)


class RabbitNodeError(RuntimeError):
    """The private node could not be started or asked; the message says why."""


@dataclass(frozen=True)
class NodeResources:
    """What the node's Erlang VM holds, as ``rabbitmqctl status`` reports it."""

    file_descriptors: int  # open by the beam process (/proc; RabbitMQ's own count if unreadable)
    file_descriptor_limit: int  # what RabbitMQ allows itself (below the ulimit)
    handles_used: int  # RabbitMQ's own count against that limit (its file handle cache)
    memory_bytes: int  # the VM's own total
    rss_bytes: int  # the beam process's resident set (0 where /proc cannot tell)


def free_port(low: int = 0, high: int = 0) -> int:
    """A loopback TCP port nobody listens on right now; within [low, high) when given."""
    if not low:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RabbitNodeError(f"no free port in [{low}, {high})")


def _script(name: str) -> str:
    """RabbitMQ's own script, not Debian's wrapper around it: run as root, the wrapper
    becomes the ``rabbitmq`` user through ``su``, whose PAM session puts the descriptor
    limit back to the system default (measured: 927 usable instead of 20,000)."""
    direct = Path("/usr/lib/rabbitmq/bin") / name
    return str(direct) if direct.exists() else name


class RabbitNode:
    """One private RabbitMQ node under ``base_dir`` (see the module docstring)."""

    def __init__(self, base_dir: Path, *, fd_limit: int = DEFAULT_FD_LIMIT,
                 env_config: str = "") -> None:
        self.base_dir = base_dir
        self.fd_limit = fd_limit
        self._env_config = env_config  # rabbitmq-env.conf (a shell script it sources)
        self._server = _script("rabbitmq-server")
        self._ctl = _script("rabbitmqctl")
        self.node_name = f"mf-{uuid.uuid4().hex[:10]}@localhost"
        self.port = 0
        self.dist_port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path = base_dir / "server.out"
        self.startup_s: float | None = None  # how long the last start took to accept

    @classmethod
    @contextlib.contextmanager
    def started(cls, base_dir: Path, *, fd_limit: int = DEFAULT_FD_LIMIT,
                timeout_s: float = 90) -> Iterator[RabbitNode]:
        node = cls(base_dir, fd_limit=fd_limit)
        node.start(timeout_s)
        try:
            yield node
        finally:
            node.stop()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int | None:
        """The node's process (the root of its process tree) while it runs."""
        return None if self._process is None else self._process.pid

    def _env(self) -> dict[str, str]:
        # Nothing of the caller's RABBITMQ_* settings (they describe the shared node).
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update({
            "RABBITMQ_NODENAME": self.node_name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base_dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base_dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.base_dir / "rabbitmq.conf"),
            # The machine's rabbitmq-env.conf and plugins belong to the shared node.
            "RABBITMQ_CONF_ENV_FILE": str(self.base_dir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base_dir / "enabled_plugins"),
            "RABBITMQ_LOGS": str(self.base_dir / "log" / "node.log"),
            "ERL_CRASH_DUMP": str(self.base_dir / "erl_crash.dump"),
            # The node and its rabbitmqctl share an Erlang cookie of their own.
            "HOME": str(self.base_dir),
        })
        return env

    def start(self, timeout_s: float = 90) -> None:
        """Start the node and return once it accepts AMQP connections."""
        if shutil.which(self._server) is None or shutil.which(self._ctl) is None:
            raise RabbitNodeError(f"{self._server}/{self._ctl} not found on PATH "
                                  "(apt-get install rabbitmq-server)")
        for sub in ("mnesia", "log"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        self.port, self.dist_port = free_port(), free_port(*DIST_PORT_RANGE)
        (self.base_dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n")
        (self.base_dir / "rabbitmq-env.conf").write_text(self._env_config)
        (self.base_dir / "enabled_plugins").write_text("[].\n")
        cookie = self.base_dir / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(uuid.uuid4().hex)
            cookie.chmod(0o400)
        with self._log_path.open("wb") as out:
            # A shell of our own raises the soft limit (the hard one must allow it; root
            # may raise the hard one too), then becomes the server; its own session, so
            # stop() can end all of it by group.
            raise_limit = (f"{{ ulimit -S -n {self.fd_limit} 2>/dev/null || "
                           f"ulimit -n {self.fd_limit}; }}")
            self._process = subprocess.Popen(
                ["bash", "-c", f'{raise_limit} && exec "$0"', self._server],
                env=self._env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        started = time.monotonic()
        deadline = started + timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    raise RabbitNodeError(f"rabbitmq-server {self.node_name} exited with "
                                          f"{self._process.returncode}: {self._tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RabbitNodeError(f"rabbitmq-server {self.node_name} did not start "
                                          f"within {timeout_s:.0f} s: {self._tail()}")
                done = subprocess.run(
                    [self._ctl, "-q", "-n", self.node_name, "await_startup", "--timeout",
                     str(max(1, int(min(left, 10))))],
                    env=self._env(), capture_output=True, timeout=left + 15, check=False)
                if done.returncode == 0 and self._accepts():
                    self.startup_s = time.monotonic() - started
                    return
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def _tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            text = self._log_path.read_text(errors="replace").strip().splitlines()
            return " | ".join(text[-lines:]) or "(no output)"
        return "(no output)"

    def ctl(self, *args: str, timeout_s: float = 60) -> str:
        """``rabbitmqctl -n <this node> ARGS``; its stdout, or RabbitNodeError."""
        done = subprocess.run([self._ctl, "-q", "-n", self.node_name, *args], env=self._env(),
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RabbitNodeError(f"rabbitmqctl {' '.join(args)} on {self.node_name}: "
                                  f"{(done.stderr or done.stdout).strip()}")
        return done.stdout

    def queue_count(self, prefix: str = "") -> int:
        """Queues on the node whose names start with ``prefix`` (its own listing: for
        tests and measurements only)."""
        return len([line for line in self.ctl("list_queues", "name", "--no-table-headers"
                                              ).splitlines()
                    if line.strip() and line.strip().startswith(prefix)])

    def resources(self) -> NodeResources:
        status = json.loads(self.ctl("status", "--formatter", "json"))
        fds = status.get("file_descriptors", {})
        memory = status.get("memory", {})
        rss = 0
        open_fds = int(fds.get("total_used", 0))
        pid = str(status.get("pid", ""))
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            # RabbitMQ 3.10 counts only its file handle cache, not the Raft logs and
            # segments that quorum queues keep open: the OS count is the true one.
            open_fds = len(os.listdir(f"/proc/{pid}/fd"))
        return NodeResources(
            file_descriptors=open_fds,
            file_descriptor_limit=int(fds.get("total_limit", 0)),
            handles_used=int(fds.get("total_used", 0)),
            memory_bytes=int(memory.get("total", {}).get("erlang", 0))
            if isinstance(memory.get("total"), dict) else int(memory.get("total", 0)),
            rss_bytes=rss)

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the node (politely, then by its process group); idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(Exception):
                subprocess.run([self._ctl, "-q", "-n", self.node_name, "stop"],
                               env=self._env(), capture_output=True, timeout=timeout_s,
                               check=False)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        # Erlang's helpers (erl_child_setup, inet_gethost) share the node's process group
        # and may outlive it: nothing of the node is left running.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
