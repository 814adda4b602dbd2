"""Per-runtime memory limits, against real child processes.

The RSS watchdog runs everywhere. The cgroup v2 limiter runs where this machine lets
us create a cgroup with the memory controller, and is skipped with the kernel's
reason elsewhere; its file protocol is also checked against a fake cgroup folder.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modelfleet.errors import ConfigError
from modelfleet.ipc.protocol import MEMORY_LIMIT_ENV
from modelfleet.worker.isolation.limits import (
    CgroupV2Limiter,
    LimitHandle,
    MemoryLimiter,
    RssWatchdog,
    choose_limiter,
    runtime_env,
)

MiB = 1024 * 1024

# Allocates and touches ``mb`` MiB (b"x" * n writes every page), says so, then waits for
# stdin to close: it lives until the test lets it go, or until a limiter kills it.
HOG = textwrap.dedent("""
    import sys
    block = b"x" * ({mb} * 1024 * 1024)
    print("allocated", flush=True)
    sys.stdin.read()
""")

# The same, one generation down: the runtime starts a worker process that hogs.
PARENT_OF_HOG = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", {hog!r}], stdin=subprocess.PIPE)
    child.wait()
""")


async def spawn(code: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)


async def exit_code(process: asyncio.subprocess.Process, timeout_s: float = 30) -> int:
    return await asyncio.wait_for(process.wait(), timeout_s)


class SampleCounter:
    """Lets a test await the watchdog's n-th sample instead of sleeping."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def __call__(self, rss_bytes: int) -> None:
        self.count += 1
        self.changed.set()

    async def wait_for(self, n: int) -> None:
        while self.count < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)


# --- the environment a runtime learns its limit from ------------------------------------


def test_runtime_env_names_the_limit_in_bytes() -> None:
    assert runtime_env(200 * MiB) == {MEMORY_LIMIT_ENV: str(200 * MiB)}
    assert MEMORY_LIMIT_ENV == "MODELFLEET_MEMORY_LIMIT_BYTES"


def test_runtime_env_is_empty_without_a_limit() -> None:
    assert runtime_env(None) == {}


# --- RSS watchdog ---------------------------------------------------------------------------


async def test_watchdog_kills_a_process_over_its_limit_and_says_why() -> None:
    limiter = RssWatchdog(interval_s=0.05)
    process = await spawn(HOG.format(mb=150))
    handle = limiter.attach(process.pid, "runtime-hog", 100 * MiB)
    try:
        assert await exit_code(process) == -signal.SIGKILL
        assert handle.killed_for_memory()
        assert handle.kill_reason is not None
        assert "runtime-hog" in handle.kill_reason and "100 MiB" in handle.kill_reason
    finally:
        await handle.close()


async def test_watchdog_leaves_a_process_under_its_limit_alone() -> None:
    samples = SampleCounter()
    limiter = RssWatchdog(interval_s=0.02, on_sample=samples)
    process = await spawn(HOG.format(mb=20))
    handle = limiter.attach(process.pid, "runtime-small", 100 * MiB)
    try:
        assert process.stdout is not None
        assert await process.stdout.readline() == b"allocated\n"
        await samples.wait_for(samples.count + 5)  # sampled with its 20 MiB in place
        assert process.returncode is None
        assert process.stdin is not None
        process.stdin.close()
        assert await exit_code(process) == 0
        assert not handle.killed_for_memory()
        assert handle.kill_reason is None
    finally:
        await handle.close()


async def test_watchdog_counts_and_kills_the_runtimes_children_too() -> None:
    limiter = RssWatchdog(interval_s=0.05)
    process = await spawn(PARENT_OF_HOG.format(hog=HOG.format(mb=150)))
    handle = limiter.attach(process.pid, "runtime-parent", 100 * MiB)
    try:
        assert await exit_code(process) == -signal.SIGKILL
        assert handle.killed_for_memory()
    finally:
        await handle.close()


async def test_watchdog_attached_to_an_exited_process_reports_nothing() -> None:
    process = await spawn("pass")
    await exit_code(process)
    handle = RssWatchdog().attach(process.pid, "gone", 100 * MiB)
    await handle.close()
    assert not handle.killed_for_memory()


# --- choosing ---------------------------------------------------------------------------------


def test_choose_limiter_falls_back_to_the_watchdog_where_cgroups_are_refused(
        tmp_path: Path) -> None:
    fake = fake_cgroup(tmp_path, controllers="hugetlb")
    limiter = choose_limiter(cgroup_base=fake)
    assert isinstance(limiter, RssWatchdog)
    with pytest.raises(ConfigError, match="memory controller is not available"):
        choose_limiter("cgroup-v2", cgroup_base=fake)
    assert choose_limiter("watchdog").kind == "watchdog"


def test_probe_reads_this_process_cgroup_from_proc(tmp_path: Path) -> None:
    mount = tmp_path / "unified"
    fake_cgroup(mount, controllers="hugetlb")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        f"35 25 0:30 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("4:memory:/x\n0::/\n")
    reason = CgroupV2Limiter.probe(mountinfo=mountinfo, proc_cgroup=proc_cgroup)
    assert reason == (f"the memory controller is not available in {mount} "
                      "(cgroup.controllers: hugetlb)")
    mountinfo.write_text("30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert "no cgroup v2" in str(CgroupV2Limiter.probe(mountinfo=mountinfo,
                                                       proc_cgroup=proc_cgroup))


# --- cgroup v2: the file protocol, on a fake cgroup folder ---------------------------------


def fake_cgroup(path: Path, controllers: str = "cpu memory pids") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text("")
    return path


async def test_cgroup_limiter_writes_limit_no_swap_group_oom_and_the_pid(tmp_path: Path) -> None:
    delegated = fake_cgroup(tmp_path / "delegated")
    fake_cgroup(delegated / "modelfleet")  # cgroupfs would create these files by itself
    probed = CgroupV2Limiter.probe(delegated)
    assert isinstance(probed, CgroupV2Limiter)
    assert probed.parent == delegated / "modelfleet"
    assert (delegated / "cgroup.subtree_control").read_text() == "+memory"
    assert (probed.parent / "cgroup.subtree_control").read_text() == "+memory"

    handle = probed.attach(4242, "runtime/7", 64 * MiB)
    group = probed.parent / "runtime_7"
    assert (group / "memory.max").read_text() == str(64 * MiB)
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "memory.oom.group").read_text() == "1"
    assert (group / "cgroup.procs").read_text() == "4242"
    assert not handle.killed_for_memory()

    (group / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    assert handle.killed_for_memory()
    assert "64 MiB" in str(handle.kill_reason)
    await handle.close()  # a plain folder will not rmdir; the count read at close stays
    assert (group / "cgroup.kill").read_text() == "1"
    (group / "memory.events").write_text("oom_kill 0\n")
    assert handle.killed_for_memory()


# --- cgroup v2: the real thing, where the kernel allows it ----------------------------------


@pytest.fixture
async def cgroup_limiter() -> AsyncIterator[CgroupV2Limiter]:
    probed = CgroupV2Limiter.probe()
    if isinstance(probed, str):
        pytest.skip(f"cgroup v2 memory limits unavailable on this machine: {probed}")
    yield probed


async def run_under(limiter: MemoryLimiter, code: str, limit_bytes: int,
                    ) -> tuple[int, LimitHandle]:
    process = await spawn(code)
    handle = limiter.attach(process.pid, f"test-{process.pid}", limit_bytes)
    assert process.stdin is not None
    process.stdin.close()  # a survivor exits as soon as it has allocated
    try:
        return await exit_code(process), handle
    finally:
        await handle.close()


async def test_cgroup_kernel_kills_a_process_over_its_limit(
        cgroup_limiter: CgroupV2Limiter) -> None:
    code, handle = await run_under(cgroup_limiter, HOG.format(mb=150), 100 * MiB)
    assert code == -signal.SIGKILL
    assert handle.killed_for_memory()


async def test_cgroup_leaves_a_process_under_its_limit_alone(
        cgroup_limiter: CgroupV2Limiter) -> None:
    code, handle = await run_under(cgroup_limiter, HOG.format(mb=20), 100 * MiB)
    assert code == 0
    assert not handle.killed_for_memory()
    assert not (cgroup_limiter.parent / f"test-{handle.pid}").exists()
