"""A private RabbitMQ node for one bench run: own name, ports, data and logs; stopped after.

The shared node on 127.0.0.1:5672 runs with 1,024 file descriptors and stops answering
past a few hundred quorum queues (issue 23), so a run that may declare thousands (the
scale variant, one queue per model touched) starts a node of its own:

    with PrivateRabbit(keep_logs_in=run_dir) as node:  # ulimit -n 20000, free ports,
        node.url                      # amqp://guest:guest@127.0.0.1:<port>/   await_startup
    # rabbitmqctl -n NODE stop; logs copied to keep_logs_in; the node's folder removed

The node reads no configuration of the machine's node: it gets its own config file
(listener on its own port; /etc/rabbitmq/rabbitmq.conf names 5672), its own plugins file
(none) and its own mnesia and log folders under a fresh folder in /tmp. Standing in
until the broker's reusable private-node fixture lands (helper H4's): same variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

NOFILE = 20_000


class RabbitFailed(RuntimeError):
    pass


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(low: int = 0, high: int = 0) -> int:
    """A free loopback port; within [low, high) when given (the distribution port must stay
    below 55,536: the CLI tools listen on it + 10,000)."""
    if not low:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = random.randrange(low, high)
        if _port_free(port):
            return port
    raise RabbitFailed(f"no free port in [{low}, {high})")


def _service_user() -> tuple[int, int, str] | None:
    """(uid, gid, home) of Debian's ``rabbitmq`` user when running as root, else None."""
    if os.geteuid() != 0:
        return None
    try:
        import pwd

        user = pwd.getpwnam("rabbitmq")
    except KeyError:
        return None
    return user.pw_uid, user.pw_gid, user.pw_dir


def _child_setup(user: tuple[int, int, str] | None) -> Callable[[], None]:
    """In the child, before exec: raise the descriptor limit, then drop to the service user.

    Debian's /usr/sbin/rabbitmq-server would drop privileges with ``su``, whose PAM session
    resets the limit to the system's (about 1,024): so the bench execs the real script
    (/usr/lib/rabbitmq/bin/rabbitmq-server) as that user itself.
    """
    def setup() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if os.geteuid() == 0:  # root may raise the hard limit too
            hard = hard if hard == resource.RLIM_INFINITY else max(hard, NOFILE)
        soft = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if user is not None:
            uid, gid, _ = user
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
    return setup


def _hand_to_service_user(folder: Path, user: tuple[int, int, str] | None) -> None:
    """The node runs as the ``rabbitmq`` user when the bench runs as root: give it the node's
    folder (and the right to traverse the folders above)."""
    if user is None:
        return
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, user[0], user[1])
    for parent in folder.parents:
        if not parent.stat().st_mode & 0o001:
            raise RabbitFailed(f"{parent} is not traversable by the rabbitmq user: give the "
                               "node a folder under /tmp (the default)")


class PrivateRabbit:
    """One RabbitMQ node on free loopback ports, its files under ``folder``."""

    def __init__(self, folder: Path | None = None, start_timeout_s: float = 120.0,
                 server: str = "rabbitmq-server", ctl: str = "rabbitmqctl",
                 keep_logs_in: Path | None = None) -> None:
        # A fresh folder under /tmp by default: the node runs as the rabbitmq user when the
        # bench runs as root, and must reach it (a home or a pytest folder may be private).
        self.folder = folder if folder is not None else Path(
            tempfile.mkdtemp(prefix="bench-rabbit-"))
        self.own_folder = folder is None
        self.keep_logs_in = keep_logs_in
        self.start_timeout_s = start_timeout_s
        self.server_bin, self.ctl_bin = server, ctl
        self.node = f"bench-{uuid.uuid4().hex[:10]}@localhost"
        self.port = free_port()
        self.dist_port = free_port(20_000, 30_000)
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self.popen: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    # -- environment ------------------------------------------------------------------------

    def _env(self, for_server: bool) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env["RABBITMQ_NODENAME"] = self.node
        if for_server:
            env.update({
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self.folder / "log"),
                "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(self.folder / "node.pid"),
                "RABBITMQ_FEATURE_FLAGS_FILE": str(self.folder / "mnesia" / "feature_flags"),
            })
        return env

    def real_server(self) -> str:
        """The server script itself, not Debian's wrapper that drops privileges with su."""
        found = shutil.which(self.server_bin)
        if found is None:
            raise RabbitFailed(f"{self.server_bin} is not installed (apt-get install "
                               "rabbitmq-server): the private node cannot start")
        real = Path("/usr/lib/rabbitmq/bin") / Path(found).name
        return str(real) if real.is_file() else found

    def _ctl(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.ctl_bin, "-n", self.node, *args], env=self._env(False),
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def log_tail(self, lines: int = 30) -> str:
        texts = []
        for path in [*sorted((self.folder / "log").glob("*.log")), self.folder / "stdout.log"]:
            with contextlib.suppress(OSError):
                texts.append(f"--- {path.name}:\n" + "\n".join(
                    path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)

    # -- life -------------------------------------------------------------------------------

    def start(self) -> PrivateRabbit:
        """Start the node and wait until it accepts; on any failure nothing is left behind
        (the node stopped, its folder removed, its logs kept where asked)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> PrivateRabbit:
        self.real_server()  # fails early when RabbitMQ is not installed
        for sub in ("log", "mnesia"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        (self.folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n")
        (self.folder / "enabled_plugins").write_text("[].\n")
        user = _service_user()
        _hand_to_service_user(self.folder, user)
        env = self._env(True)
        if user is not None:
            env.update({"HOME": user[2], "USER": "rabbitmq", "LOGNAME": "rabbitmq"})
        started = time.monotonic()
        out = (self.folder / "stdout.log").open("ab")
        argv = [self.real_server()]
        self.popen = subprocess.Popen(argv, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=self.folder, start_new_session=True,
                                      preexec_fn=_child_setup(user))
        out.close()
        deadline = started + self.start_timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RabbitFailed(f"rabbitmq-server {self.node} exited with "
                                   f"{self.popen.returncode}:\n{self.log_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RabbitFailed(f"rabbitmq node {self.node} not up after "
                                   f"{self.start_timeout_s:.0f}s:\n{self.log_tail()}")
            try:
                done = self._ctl("await_startup", "--timeout", str(max(1, int(remaining))),
                                 timeout_s=remaining + 10)
            except subprocess.TimeoutExpired:
                continue
            if done.returncode == 0 and self._accepts():
                self.startup_s = time.monotonic() - started
                return self
            time.sleep(0.5)

    def _accepts(self) -> bool:
        with socket.socket() as s:
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", self.port))
            except OSError:
                return False
            return True

    def descriptor_limit(self) -> int | None:
        """The node's own limit on open files, as it reports it (``rabbitmqctl status``)."""
        try:
            done = self._ctl("status", "--formatter", "json", timeout_s=60)
            return int(json.loads(done.stdout)["file_descriptors"]["total_limit"])
        except (subprocess.SubprocessError, ValueError, KeyError, TypeError):
            return None

    def stop(self, timeout_s: float = 60.0) -> None:
        """``rabbitmqctl -n NODE stop``, then signals to its process group; folder removed."""
        if self.popen is None:
            if self.own_folder:
                shutil.rmtree(self.folder, ignore_errors=True)
            return
        if self.popen.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._ctl("stop", timeout_s=timeout_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(15)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.popen.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        # Erlang's helpers (erl_child_setup, inet_gethost) share the node's process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        if self.keep_logs_in is not None:
            with contextlib.suppress(OSError):
                self.keep_logs_in.mkdir(parents=True, exist_ok=True)
                for path in [*(self.folder / "log").glob("*.log"), self.folder / "stdout.log"]:
                    if path.is_file():
                        shutil.copyfile(path, self.keep_logs_in / path.name)
        shutil.rmtree(self.folder if self.own_folder else self.folder / "mnesia",
                      ignore_errors=True)

    def __enter__(self) -> PrivateRabbit:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
