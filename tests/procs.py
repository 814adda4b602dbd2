"""Real modelfleet processes for end-to-end tests: start, wait until ready, stop, check."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from modelfleet.devtools.rabbit_node import free_port as free_port_in
from modelfleet.gateway.resolve import Outcome
from modelfleet.gateway.service import GatewayService
from modelfleet.messages import now_ms
from modelfleet.runtime.zygote import ZYGOTE_COMM
from modelfleet.tenancy.access import CALLER
from modelfleet.tenancy.keys import Role
from tests.waiting import eventually_blocking

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
MODELFLEET = [sys.executable, "-m", "modelfleet"]


def loopback_client(**kwargs: object) -> httpx.Client:
    """An HTTP client for the servers a test starts: plain HTTP on loopback, so it loads
    no certificates. (httpx loads certifi's bundle into every new client by default:
    ~20 ms of CPU each, and readiness is polled ten times a second.)"""
    return httpx.Client(verify=False, trust_env=False, **kwargs)  # type: ignore[arg-type]


def metric_sum(base: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    with loopback_client() as client:
        text = client.get(f"{base}/metrics").text
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


# A handler module that answers each text body with {"echo": body} (accepts text/plain).
ECHO_HANDLER = '''
    from modelfleet import Model, Request

    class Echo(Model):
        async def preprocess(self, request: Request) -> str:
            return request.text()

        def predict(self, batch):
            return [{"echo": text} for text in batch]
'''


def runtime_name(process: psutil.Process) -> str | None:
    """The runtime a process runs (its ``--name``), None for any other process.

    A runtime started as a process says so in its command line; one forked from the
    worker's zygote (``worker.runtime_zygote``) has the zygote's command line and is named
    after its runtime instead (``runtime/zygote.py``: ``set_comm``)."""
    cmdline = process.cmdline()
    if "modelfleet.runtime.zygote" in cmdline:
        name = process.name()
        return None if name == ZYGOTE_COMM else name
    if "modelfleet.runtime" in cmdline and "--name" in cmdline:
        return cmdline[cmdline.index("--name") + 1]
    return None


def write_package(root: Path, name: str, manifest: str, handler: str) -> Path:
    """A model package ``root/name/1`` from a model.toml body and a handler module."""
    folder = root / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(textwrap.dedent(manifest))
    (folder / "handler.py").write_text(textwrap.dedent(handler))
    return folder


# Ports a test names before its server starts (a gRPC port, a restart on the same port)
# come from below the kernel's ephemeral range (32768-60999 here), where no outgoing
# connection takes them meanwhile, and each pytest-xdist process has a slice of its own,
# so two test processes never pick the same one. (Private RabbitMQ nodes use 20000-30000.)
_PORTS_LOW, _PORTS_HIGH = 10_000, 20_000


def _port_slice() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") else 0
    width = (_PORTS_HIGH - _PORTS_LOW) // max(1, count)
    return _PORTS_LOW + index * width, _PORTS_LOW + (index + 1) * width


def free_port() -> int:
    """A loopback port nobody listens on now, from this test process's own slice."""
    return free_port_in(*_port_slice())


# The line each of serve, gateway and worker logs once it has bound its HTTP port (asked
# for port 0: the kernel picks one, and nobody else can take it between pick and bind).
_ANNOUNCED_PORT = re.compile(r"modelfleet (?:serving|gateway|worker) .*?on http://\S+?:(\d+)")


class Proc:
    """One ``modelfleet`` process with its own log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path,
                 ready_url: str | None) -> None:
        self.args = args
        self.ready_url = ready_url
        self.log_path = log_path
        self.api_key = ""  # the admin key gateway() made for it
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen([*MODELFLEET, *args], env={**os.environ, **env},
                                      stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.pid = self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def announced_port(self, timeout_s: float = 60) -> int:
        """The HTTP port the process bound and logged (it was started with port 0)."""
        def announced() -> re.Match[str] | None:
            self._check_alive()
            return _ANNOUNCED_PORT.search(self.log())

        found = eventually_blocking(announced, timeout_s, every_s=0.05,
                                    what=f"{self.args[0]} announcing its port",
                                    state=lambda: f"its log:\n{self.log()}")
        return int(found.group(1))

    def _check_alive(self) -> None:
        """Fail at once, with its log, once the process has exited."""
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.args[0]} exited with {self.popen.returncode}:\n"
                                 f"{self.log()}")

    def wait_ready(self, timeout_s: float = 60) -> None:
        ready_url = self.ready_url
        assert ready_url is not None

        def ready() -> bool:
            self._check_alive()
            try:
                return client.get(ready_url).status_code == 200
            except httpx.HTTPError:
                return False

        with loopback_client(timeout=1) as client:
            eventually_blocking(ready, timeout_s, what=f"{self.args[0]} being ready",
                                state=lambda: f"its log:\n{self.log()}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.popen.returncode

    def runtimes(self, quarantine: bool = False) -> list[psutil.Process]:
        """Its runtime processes (children running ``modelfleet.runtime``): the shared and
        isolated ones, and the quarantine runtime (and its spares) only if asked (it stands
        from the worker's start: ``worker.quarantine_standing``)."""
        found = []
        for p in self.descendants():
            try:
                name = runtime_name(p)
            except psutil.Error:  # gone meanwhile
                continue
            if name is not None and (quarantine or name != "quarantine"):
                found.append(p)
        return found

    def kill(self) -> None:
        for child in self.descendants():
            child.kill()
        self.popen.kill()
        self.popen.wait()


@contextmanager
def running(args: list[str], tmp_path: Path, name: str, ready_url: str | None,
            env: dict[str, str] | None = None) -> Iterator[Proc]:
    proc = Proc(args, env or {}, tmp_path / f"{name}.log", ready_url)
    try:
        if ready_url is not None:
            proc.wait_ready()
        yield proc
    finally:
        children = proc.descendants()
        proc.stop()
        for child in children:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                child.kill()


def _own_state(tmp_path: Path) -> dict[str, str]:
    """The test's own state dir (databases, caches), not ~/.cache/modelfleet, which the
    other test process and every earlier run share; the processes of one test share it."""
    return {"MODELFLEET_STATE_DIR": str(tmp_path / "state")}


def _started(args: list[str], env: dict[str, str], log_path: Path, ready_path: str
             ) -> tuple[Proc, int]:
    """Start a process that binds port 0 and logs the port; wait for ``ready_path`` there."""
    proc = Proc(args, env, log_path, None)
    try:
        port = proc.announced_port()
        proc.ready_url = f"http://127.0.0.1:{port}{ready_path}"
        proc.wait_ready()
    except BaseException:
        proc.kill()
        raise
    return proc, port


def serve(tmp_path: Path, env: dict[str, str] | None = None, name: str = "serve",
          repo: Path | str = EXAMPLES, broker: str = "memory") -> tuple[Proc, str]:
    """Start ``modelfleet serve``; returns (process, base URL). Caller stops it.

    ``repo``: a folder, or any fsspec URL (``s3://bucket/models``)."""
    proc, port = _started(["serve", "--repo", str(repo), "--port", "0", "--broker", broker],
                          {"MODELFLEET_EXAMPLE_SLOWLOAD_S": "3",
                           # serve archives its dead letters: into this test's folder
                           "MODELFLEET_DLQ_DB": str(tmp_path / f"{name}-dlq.sqlite3"),
                           **_own_state(tmp_path), **(env or {})},
                          tmp_path / f"{name}.log", "/readyz")
    return proc, f"http://127.0.0.1:{port}"


def provision_key(db: str, role: Role = "admin", tenant: str = "", plan: str = "enterprise"
                  ) -> str:
    """A new API key in the tenants' store at ``db`` (a fresh tenant unless named)."""
    from modelfleet.tenancy.store import open_store

    store = open_store(db)
    try:
        _, key = store.create_key(tenant or f"harness-{uuid.uuid4().hex[:8]}", role,
                                  "tests/procs.py", plan)
    finally:
        store.close()
    return key


def gateway(tmp_path: Path, broker: str, env: dict[str, str], name: str,
            repo: Path | str = EXAMPLES) -> tuple[Proc, str]:
    """Start ``modelfleet gateway``; returns (process, base URL). Caller stops it.

    Auth is on for a gateway: an admin key is made in the tenants' store the gateway
    reads (``tmp_path/tenants.sqlite3`` unless ``env`` names one), kept in
    ``proc.api_key``, and carried by the base URL as Basic credentials
    (``http://KEY:@host:port``), which httpx sends with every request.
    """
    db = (env.get("MODELFLEET_TENANCY__DB") or env.get("MODELFLEET_DLQ_DB")
          or str(tmp_path / "tenants.sqlite3"))
    key = provision_key(db)
    proc, port = _started(["gateway", "--repo", str(repo), "--port", "0", "--broker", broker],
                          {"MODELFLEET_TENANCY__DB": db, **_own_state(tmp_path), **env},
                          tmp_path / f"{name}.log",
                          "/readyz")
    proc.api_key = key
    return proc, f"http://{key}:@127.0.0.1:{port}"


def worker(tmp_path: Path, broker: str, env: dict[str, str], name: str,
           repo: Path | str = EXAMPLES, extra: list[str] | None = None) -> tuple[Proc, str]:
    """Start ``modelfleet worker --worker-id NAME``; returns (process, probe URL)."""
    proc, port = _started(["worker", "--repo", str(repo), "--broker", broker,
                           "--worker-id", name, "--probe-port", "0", *(extra or [])],
                          {"MODELFLEET_EXAMPLE_SLOWLOAD_S": "3", **_own_state(tmp_path), **env},
                          tmp_path / f"{name}.log", "/readyz")
    return proc, f"http://127.0.0.1:{port}"


async def ask(service: GatewayService, model: str, version: str | None, body: bytes,
              content_type: str, deadline_ms: int, params: dict[str, str] | None = None
              ) -> Outcome:
    """One request through ``GatewayService`` as a handler sends it: resolved once (for
    the caller the auth layer set, if any; the timeout of ``deadline_ms``), the worker's
    failure raised as the error it names, as the handlers answer it."""
    resolved = service.resolve(model, version, max(0.001, (deadline_ms - now_ms()) / 1000),
                               CALLER.get())
    outcome = await service.infer(resolved, body, content_type, params or {})
    if outcome.error is not None:
        raise outcome.error
    return outcome
