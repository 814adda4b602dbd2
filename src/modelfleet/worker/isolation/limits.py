"""Per-runtime memory limits: a cgroup v2 where the machine allows it, else an RSS watchdog.

The supervisor spawns a runtime, then ``attach``es it at once (the child is still
starting its interpreter, so it cannot have allocated much yet)::

    limiter = choose_limiter()                  # once per worker
    env = dict(os.environ) | runtime_env(limit_bytes)
    process = await asyncio.create_subprocess_exec(python, "-m", "modelfleet.runtime", ...,
                                                   env=env)
    handle = limiter.attach(process.pid, name, limit_bytes)
    ...
    await process.wait()
    if handle.killed_for_memory():              # the restart reason is "memory"
        log.warning("%s: %s", name, handle.kill_reason)
    await handle.close()

Two limiters behind one protocol, chosen by ``choose_limiter``:

- ``CgroupV2Limiter``: the kernel enforces ``memory.max`` on the runtime's own cgroup
  (``<delegated>/modelfleet/<name>``), with no swap and ``memory.oom.group`` so an OOM
  kills the whole runtime, never half of it. OOM kills are read from
  ``memory.events``. Needs cgroup v2 with the memory controller in a subtree this
  process may write (a systemd unit with ``Delegate=yes``, or root on a v2 host).
- ``RssWatchdog``: samples the runtime's process tree (RSS, via psutil) every
  ``interval_s`` and SIGKILLs the tree once it passes the limit. Works anywhere, but
  an allocation faster than one interval can outrun it, and shared pages count
  once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

import psutil

from modelfleet.errors import ConfigError
from modelfleet.ipc.protocol import MEMORY_LIMIT_ENV

log = logging.getLogger("modelfleet.worker.isolation.limits")

MiB = 1024 * 1024
LimiterKind = Literal["auto", "cgroup-v2", "watchdog"]


def runtime_env(limit_bytes: int | None) -> dict[str, str]:
    """Environment variables that tell a runtime its own memory limit (none: no limit)."""
    return {} if limit_bytes is None else {MEMORY_LIMIT_ENV: str(int(limit_bytes))}


class LimitHandle(Protocol):
    """One runtime under a limit."""

    pid: int
    name: str
    limit_bytes: int

    def killed_for_memory(self) -> bool:
        """Whether the runtime was killed for passing its limit (ask after it exited)."""
        ...

    @property
    def kill_reason(self) -> str | None:
        """Why it was killed, for logs and the restart reason; None if it was not."""
        ...

    async def close(self) -> None:
        """Stop limiting; kills whatever of the runtime's tree is still in the limit."""
        ...


class MemoryLimiter(Protocol):
    kind: str

    def attach(self, pid: int, name: str, limit_bytes: int) -> LimitHandle:
        """Put process ``pid`` (and every process it starts later) under ``limit_bytes``."""
        ...


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


# --- the fallback: sample and kill ------------------------------------------------------


def tree_rss_bytes(process: psutil.Process) -> int:
    """Resident bytes of ``process`` and all its descendants (raises if it is gone)."""
    total = int(process.memory_info().rss)
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += int(child.memory_info().rss)
    return total


def kill_tree(process: psutil.Process) -> None:
    """SIGKILL ``process`` first (it cannot start more children), then its descendants."""
    with contextlib.suppress(psutil.NoSuchProcess):
        children = process.children(recursive=True)
        process.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


class WatchdogHandle:
    def __init__(self, pid: int, name: str, limit_bytes: int, interval_s: float,
                 on_sample: Callable[[int], None] | None) -> None:
        self.pid = pid
        self.name = name
        self.limit_bytes = limit_bytes
        self.peak_rss_bytes = 0
        self._reason: str | None = None
        self._interval_s = interval_s
        self._on_sample = on_sample
        self._process: psutil.Process | None = None
        self._task: asyncio.Task[None] | None = None
        with contextlib.suppress(psutil.NoSuchProcess):  # already gone: nothing to watch
            self._process = psutil.Process(pid)  # keeps the start time: a reused pid is safe
            self._task = asyncio.create_task(self._watch(self._process),
                                             name=f"memory-watchdog-{name}")

    def killed_for_memory(self) -> bool:
        return self._reason is not None

    @property
    def kill_reason(self) -> str | None:
        return self._reason

    async def _watch(self, process: psutil.Process) -> None:
        while True:
            try:
                rss = tree_rss_bytes(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return  # exited (or a zombie awaiting its parent's wait)
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            if self._on_sample is not None:
                self._on_sample(rss)
            if rss > self.limit_bytes:
                self._reason = (f"runtime {self.name} (pid {self.pid}) used {_mib(rss)}, over "
                                f"its memory limit of {_mib(self.limit_bytes)}: killed")
                log.warning("%s", self._reason)
                kill_tree(process)
                return
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._process is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                if self._process.status() != psutil.STATUS_ZOMBIE:
                    kill_tree(self._process)


class RssWatchdog:
    """Samples each runtime's process tree every ``interval_s`` and kills it over its limit.

    ``on_sample(rss_bytes)`` is called after each sample (tests await it instead of sleeping).
    """

    kind = "watchdog"

    def __init__(self, interval_s: float = 0.5,
                 on_sample: Callable[[int], None] | None = None) -> None:
        self.interval_s = interval_s
        self._on_sample = on_sample

    def attach(self, pid: int, name: str, limit_bytes: int) -> WatchdogHandle:
        return WatchdogHandle(pid, name, limit_bytes, self.interval_s, self._on_sample)


# --- the kernel's way: cgroup v2 ----------------------------------------------------------


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:  # one write(2) per value, as cgroupfs expects
        f.write(value)


def _oom_kills(group: Path) -> int:
    """The ``oom_kill`` count of ``memory.events`` (0 when unreadable)."""
    try:
        text = (group / "memory.events").read_text()
    except OSError:
        return 0
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


class CgroupHandle:
    def __init__(self, group: Path, pid: int, name: str, limit_bytes: int) -> None:
        self.pid = pid
        self.name = name
        self.limit_bytes = limit_bytes
        self.group = group
        self._baseline = _oom_kills(group)
        self._final: int | None = None  # the count read just before the cgroup was removed

    def _count(self) -> int:
        return (self._final if self._final is not None else _oom_kills(self.group)) - self._baseline

    def killed_for_memory(self) -> bool:
        return self._count() > 0

    @property
    def kill_reason(self) -> str | None:
        if not self.killed_for_memory():
            return None
        return (f"runtime {self.name} (pid {self.pid}) passed its memory limit of "
                f"{_mib(self.limit_bytes)}: killed by the kernel (cgroup {self.group})")

    async def close(self) -> None:
        if self._final is None:
            self._final = _oom_kills(self.group)
        await _remove_group(self.group)


def _try_rmdir(group: Path) -> bool:
    """Remove ``group``; False while processes are still leaving it. cgroupfs is in memory:
    these calls never wait on a disk, so they are fine on the event loop."""
    try:
        group.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        log.warning("cannot remove cgroup %s: %s", group, exc.strerror)
    return True


def _kill_group(group: Path) -> None:
    with contextlib.suppress(OSError):  # kernel 5.14+: SIGKILL every process inside
        _write(group / "cgroup.kill", "1")


async def _remove_group(group: Path, timeout_s: float = 2.0) -> None:
    """Kill what is left in ``group`` and remove it; a cgroup is only removable once empty."""
    _kill_group(group)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not _try_rmdir(group):
        if loop.time() > deadline:
            log.warning("cgroup %s still busy after %.0fs; left in place", group, timeout_s)
            return
        await asyncio.sleep(0.02)  # the killed processes are still exiting


def _cgroup2_mount(mountinfo: str) -> Path | None:
    for line in mountinfo.splitlines():
        fields, _, fs = line.partition(" - ")
        if fs.split(" ", 1)[0] == "cgroup2":
            return Path(fields.split()[4])
    return None


def _own_cgroup(proc_cgroup: str) -> str | None:
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _enable_memory(group: Path) -> str | None:
    """Enable the memory controller for ``group``'s children; a reason if it cannot."""
    controllers = (group / "cgroup.controllers").read_text().split()
    if "memory" not in controllers:
        return (f"the memory controller is not available in {group} "
                f"(cgroup.controllers: {' '.join(controllers) or 'none'})")
    if "memory" in (group / "cgroup.subtree_control").read_text().split():
        return None
    try:
        _write(group / "cgroup.subtree_control", "+memory")
    except OSError as exc:
        hint = (" (it holds processes: run the worker in a delegated cgroup, e.g. systemd "
                "Delegate=yes with DelegateSubgroup=)" if exc.errno == errno.EBUSY else "")
        return f"cannot enable memory in {group}/cgroup.subtree_control: {exc.strerror}{hint}"
    return None


class CgroupV2Limiter:
    """Puts each runtime in its own cgroup ``<parent>/<name>`` under ``memory.max``.

    Build it with ``probe()``, which finds (or is given) a writable cgroup v2 subtree
    with the memory controller, and prepares ``<subtree>/modelfleet``.
    """

    kind = "cgroup-v2"

    def __init__(self, parent: Path) -> None:
        self.parent = parent

    @classmethod
    def probe(cls, base: Path | None = None, *, mountinfo: Path = Path("/proc/self/mountinfo"),
              proc_cgroup: Path = Path("/proc/self/cgroup")) -> CgroupV2Limiter | str:
        """A ready limiter, or the reason this machine does not allow one."""
        try:
            if base is not None:
                candidates = [base]
            else:
                mount = _cgroup2_mount(mountinfo.read_text())
                own = _own_cgroup(proc_cgroup.read_text())
                if mount is None or own is None:
                    return "no cgroup v2 hierarchy is mounted (cgroup v1 only)"
                here = mount / own.lstrip("/")
                # Our own cgroup, or its parent when we run in a leaf of a delegated subtree.
                candidates = [here] if here == mount else [here, here.parent]
            reasons = []
            for candidate in candidates:
                if not os.access(candidate, os.W_OK):
                    reasons.append(f"{candidate} is not writable by this process")
                    continue
                reason = _enable_memory(candidate)
                if reason is None:
                    parent = candidate / "modelfleet"
                    parent.mkdir(exist_ok=True)
                    reason = _enable_memory(parent)
                    if reason is None:
                        return cls(parent)
                reasons.append(reason)
            return "; ".join(reasons)
        except OSError as exc:
            return f"cannot read the cgroup v2 hierarchy: {exc}"

    def attach(self, pid: int, name: str, limit_bytes: int) -> CgroupHandle:
        group = self.parent / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        if group.is_dir():  # left by a coordinator that died: start clean
            _kill_group(group)
            _try_rmdir(group)
        try:
            group.mkdir(exist_ok=True)
            _write(group / "memory.max", str(limit_bytes))
            for setting, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                with contextlib.suppress(FileNotFoundError):  # no swap accounting: no cap
                    _write(group / setting, value)
            handle = CgroupHandle(group, pid, name, limit_bytes)
            with contextlib.suppress(ProcessLookupError):  # exited already: nothing to limit
                _write(group / "cgroup.procs", str(pid))
        except OSError as exc:
            raise ConfigError(f"cannot put runtime {name} under a memory limit in {group}: "
                              f"{exc.strerror or exc}") from exc
        return handle


def choose_limiter(kind: LimiterKind = "auto", *, interval_s: float = 0.5,
                   cgroup_base: Path | None = None) -> MemoryLimiter:
    """The limiter for this machine: a cgroup v2 where allowed, else the RSS watchdog.

    ``kind="cgroup-v2"`` insists on the cgroup (``ConfigError`` with the reason if this
    machine refuses); ``"watchdog"`` always samples.
    """
    if kind == "watchdog":
        return RssWatchdog(interval_s)
    probed = CgroupV2Limiter.probe(cgroup_base)
    if isinstance(probed, CgroupV2Limiter):
        log.info("memory limits: cgroup v2 under %s", probed.parent)
        return probed
    if kind == "cgroup-v2":
        raise ConfigError(f"cgroup v2 memory limits are not available here: {probed}")
    log.info("memory limits: RSS watchdog every %.1fs (cgroup v2 unavailable: %s)",
             interval_s, probed)
    return RssWatchdog(interval_s)

