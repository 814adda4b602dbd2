"""Processes of the peers bench: servers in their own process groups, readiness, RSS, stop.

Every server is started with ``start_new_session=True`` (its own session and process
group, so a Ctrl-C in the terminal reaches only the bench, which stops them in order).
Stopping one: SIGTERM to the server, then to its group, then SIGKILL to the group and
to every descendant seen before the stop (Ray's and MLServer's workers included, even
those that made sessions of their own) that is still alive after the grace periods.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StartFailed(RuntimeError):
    pass


class Server:
    """One server process (and the tree under it), logging to a file of its own."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path,
                 log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.popen = subprocess.Popen(self.argv, env=env, cwd=cwd, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the server (it shuts its own children down in order), then the group;
        then SIGKILL the group and every descendant seen before the stop still alive."""
        seen = self.tree()
        for target, wait_s in ((self.popen.send_signal, grace_s),
                               (lambda sig: os.killpg(self.pid, sig), 3.0)):
            if not self.alive():
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                target(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(wait_s)
        # Children may outlive their parent briefly while shutting down in order.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(_running(p) for p in seen):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for proc in seen:
            if _running(proc):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_ready(servers: Sequence[Server], health_urls: Sequence[str], timeout_s: float,
               probe: Callable[[], bool] | None = None) -> float:
    """Poll until every health URL answers 200 and ``probe()`` is true; seconds taken.

    Raises ``StartFailed`` (with the log's tail) when a server exits or time runs out.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    pending = list(health_urls)
    with httpx.Client(timeout=5) as client:
        while True:
            for server in servers:
                if not server.alive():
                    raise StartFailed(f"{server.name} exited with {server.popen.returncode} "
                                      f"while starting:\n{server.log_tail()}")
            while pending:
                try:
                    if client.get(pending[0]).status_code != 200:
                        break
                except httpx.HTTPError:
                    break
                pending.pop(0)
            if not pending and (probe is None or probe()):
                return time.monotonic() - started
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}:\n{s.log_tail()}" for s in servers)
                raise StartFailed(f"not ready after {timeout_s:.0f}s (waiting for "
                                  f"{pending or 'the probe request'}):\n{tails}")
            time.sleep(0.25)


class RssSampler:
    """Resident memory and CPU time of process trees (roots and all their descendants),
    summed, sampled every ``interval_s`` from a thread: the peak, and the whole series.

    Each sample is ``(unix time, RSS bytes, CPU seconds, processes)``. CPU seconds are
    cumulative user + system time of every process seen in the trees since the sampler
    started (a process that exits keeps the time it was last seen with), so CPU over a
    window is the difference of two interpolated samples (``cpu_between``). The first
    sample is taken on entry: the start-up RSS when the sampler starts once a system is
    ready. Shared pages are counted in every process that maps them (RSS); ``pss_series``
    has the same trees' summed PSS at each sample (``/proc/PID/smaps_rollup``: a page
    shared by n processes counts 1/n in each, so the sum is what the tree holds), which
    is what compares a system of forked processes (modelfleet's zygote) with others.
    """

    def __init__(self, servers: Sequence[Server], interval_s: float = 0.5,
                 extra_pids: Callable[[], Sequence[int]] | None = None) -> None:
        self._servers = list(servers)
        self._interval_s = interval_s
        self._extra_pids = extra_pids
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._cpu_seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> cpu s
        self.peak_bytes = 0
        self.peak_processes = 0
        self.samples = 0
        self.series: list[tuple[float, int, float, int]] = []
        self.pss_series: list[tuple[float, int]] = []  # (unix time, PSS bytes summed)
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _processes(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        for server in self._servers:
            procs += server.tree()
        if self._extra_pids is not None:
            for pid in self._extra_pids():
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(pid)
                    procs += [root, *root.children(recursive=True)]
        return procs

    def sample(self) -> int:
        total, pss, count = 0, 0, 0
        seen: set[int] = set()
        with self._lock:
            for proc in self._processes():
                if proc.pid in seen:
                    continue
                seen.add(proc.pid)
                with contextlib.suppress(psutil.Error):
                    with proc.oneshot():
                        rss = proc.memory_info().rss
                        times = proc.cpu_times()
                        key = (proc.pid, proc.create_time())
                    total += rss
                    pss += pss_bytes(proc.pid, rss)
                    count += 1
                    self._cpu_seen[key] = times.user + times.system
            cpu = sum(self._cpu_seen.values())
            now = time.time()
            self.series.append((now, total, cpu, count))
            self.pss_series.append((now, pss))
            self.samples += 1
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_processes = total, count
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    # -- reading the series -----------------------------------------------------------------

    def cpu_between(self, t0: float, t1: float) -> float | None:
        """CPU seconds the trees used between unix times t0 and t1 (interpolated)."""
        return cpu_between(self.series, t0, t1)

    def rss_summary(self, t0: float | None = None, t1: float | None = None) -> dict[str, int]:
        return rss_summary(self.series, t0, t1)

    def pss_summary(self, t0: float | None = None, t1: float | None = None) -> dict[str, int]:
        return rss_summary([(t, b, 0.0, 0) for t, b in self.pss_series], t0, t1)


def pss_bytes(pid: int, rss: int) -> int:
    """A process's PSS (``/proc/PID/smaps_rollup``); its RSS where that cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss


def _at(series: Sequence[tuple[float, int, float, int]], t: float) -> float | None:
    """Cumulative CPU seconds at unix time t, linearly interpolated; None outside."""
    if not series or t < series[0][0] or t > series[-1][0]:
        return None
    for (ta, _, ca, _), (tb, _, cb, _) in itertools.pairwise(series):
        if ta <= t <= tb:
            return ca if tb == ta else ca + (cb - ca) * (t - ta) / (tb - ta)
    return series[-1][2]


def cpu_between(series: Sequence[tuple[float, int, float, int]], t0: float,
                t1: float) -> float | None:
    a, b = _at(series, t0), _at(series, t1)
    return None if a is None or b is None else max(0.0, b - a)


def rss_summary(series: Sequence[tuple[float, int, float, int]], t0: float | None = None,
                t1: float | None = None) -> dict[str, int]:
    """Start (first sample), max and end (last sample) RSS bytes, within [t0, t1] if given."""
    picked = [s for s in series if (t0 is None or s[0] >= t0) and (t1 is None or s[0] <= t1)]
    if not picked:
        return {}
    return {"start_bytes": picked[0][1], "max_bytes": max(s[1] for s in picked),
            "end_bytes": picked[-1][1], "samples": len(picked)}
