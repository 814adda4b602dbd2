"""Runtimes forked from a zygote (``worker/zygote_launcher.py``), as real processes.

Each test starts a real zygote and real runtimes forked from it: their environment,
session and parent, exit codes reported through the zygote, BLAS and scikit-learn work
in a forked child, the fallback to a process of its own, the zygote's restart after it
died, and that stopping leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from modelfleet.ipc.flight import FLIGHT_ENV
from modelfleet.ipc.protocol import NICE_ENV, SETTINGS_ENV
from modelfleet.settings import Settings
from modelfleet.worker.process_launcher import ProcessLauncher
from modelfleet.worker.supervised_runtime import THREAD_VARIABLES, runtime_settings
from modelfleet.worker.supervisor import RuntimeSupervisor
from modelfleet.worker.zygote_launcher import ZygoteLauncher, ZygoteStarted
from tests.procs import EXAMPLES, write_package
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)


def runtime_env(repo: Path, state: Path, **extra: str) -> dict[str, str]:
    """What a shared runtime is started with (``SupervisedRuntime._launch``), in short."""
    settings = Settings(repo=str(repo), state_dir=state)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
    env.update({name: "2" for name in THREAD_VARIABLES})
    env[SETTINGS_ENV] = runtime_settings(settings).model_dump_json()
    env.update(extra)
    return env


@pytest.fixture
async def launcher(tmp_path: Path) -> AsyncIterator[ZygoteLauncher]:
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    launcher = ZygoteLauncher(ProcessLauncher(sockets, start_timeout_s=60, ping_timeout_s=10))
    yield launcher
    await launcher.close()


def maps(pid: int | None) -> str:
    """What a process has mapped (its shared libraries: what it imported)."""
    return Path(f"/proc/{pid}/maps").read_text()


def exists(path: str) -> bool:
    return Path(path).exists()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_runtime_is_forked_with_its_own_environment_and_session(
        tmp_path: Path, launcher: ZygoteLauncher) -> None:
    # What the runtime's code sees (os.environ after the fork; /proc/PID/environ still
    # shows the zygote's), written by a model's load.
    seen_file = tmp_path / "seen.json"
    repo = tmp_path / "repo"
    write_package(repo, "probe", """
        name = "probe"
        version = "1"
        entrypoint = "handler:Probe"
        device = "cpu"
        """, f"""
        import json, os
        from modelfleet import Model

        class Probe(Model):
            def load(self, ctx):
                with open({str(seen_file)!r}, "w") as f:
                    json.dump(dict(os.environ), f)

            def predict(self, batch):
                return batch
        """)
    env = runtime_env(repo, tmp_path, **{NICE_ENV: "3"})
    started = await launcher.launch("runtime-0", sys.executable, env)
    assert isinstance(started, ZygoteStarted)
    process = psutil.Process(started.pid)
    assert process.ppid() == launcher.zygote_pid != os.getpid()
    assert process.nice() == 3  # NICE_ENV, applied by the runtime after the fork
    assert os.getsid(started.pid) == started.pid  # a session of its own
    assert (await started.runtime.health(timeout_s=10)).pid == started.pid
    await started.runtime.load("probe", "1")
    seen = json.loads(seen_file.read_text())
    flight = seen.pop(FLIGHT_ENV)
    assert flight.endswith(".flight") and exists(flight)  # its flight record
    assert seen == env  # exactly what it was launched with: nothing of the zygote's
    await started.kill()
    assert started.exit_code == -signal.SIGKILL and gone(started.pid)
    assert not exists(flight)


async def test_exit_codes_come_from_the_zygote(tmp_path: Path,
                                               launcher: ZygoteLauncher) -> None:
    env = runtime_env(EXAMPLES, tmp_path)
    first = await launcher.launch("runtime-0", sys.executable, env)
    os.kill(first.pid, signal.SIGSEGV)  # as a crashing extension would
    assert await asyncio.wait_for(first.wait_exit(), 30) == -signal.SIGSEGV
    second = await launcher.launch("runtime-0", sys.executable, env)
    await second.runtime.shutdown(timeout_s=10)  # an orderly exit
    assert await asyncio.wait_for(second.wait_exit(), 30) == 0
    third = await launcher.launch("runtime-0", sys.executable, env)
    third.terminate()
    assert await asyncio.wait_for(third.wait_exit(), 30) is not None
    for started in (first, second, third):
        await started.kill()


async def test_blas_and_scikit_learn_work_in_a_forked_runtime(
        tmp_path: Path, launcher: ZygoteLauncher) -> None:
    # Threads of numpy's BLAS pool exist in the zygote once numpy is imported; the child
    # has only the thread that forked. A matmul big enough to use the pool, and a
    # scikit-learn fit and predict, in the child's load: a deadlock times the load out.
    repo = tmp_path / "repo"
    write_package(repo, "blas", """
        name = "blas"
        version = "1"
        entrypoint = "handler:Blas"
        device = "cpu"
        """, """
        import numpy as np
        from sklearn.linear_model import LogisticRegression
        from modelfleet import Model

        class Blas(Model):
            def load(self, ctx):
                a = np.random.default_rng(0).random((600, 600))
                self.trace = float(np.trace(a @ a.T))
                x = a[:, :4]
                y = (x[:, 0] > 0.5).astype(int)
                self.classes = sorted(set(LogisticRegression().fit(x, y).predict(x).tolist()))
                if self.classes != [0, 1]:
                    raise RuntimeError(self.classes)

            def predict(self, batch):
                return [self.trace for _ in batch]
        """)
    env = runtime_env(repo, tmp_path)
    first = await launcher.launch("runtime-0", sys.executable, env)  # starts the zygote
    launcher.preload(["numpy", "sklearn"])
    zygote = psutil.Process(launcher.zygote_pid)

    def imported() -> bool:
        mapped = maps(zygote.pid)
        return "openblas" in mapped.lower() and "sklearn" in mapped
    await eventually(imported, timeout_s=60)
    await first.kill()
    started = await launcher.launch("runtime-0", sys.executable, env)
    assert psutil.Process(started.pid).ppid() == zygote.pid
    await started.runtime.load("blas", "1")
    await started.kill()


async def test_a_runtime_with_other_thread_sizes_is_a_process_of_its_own(
        tmp_path: Path, launcher: ZygoteLauncher) -> None:
    env = runtime_env(EXAMPLES, tmp_path)
    forked = await launcher.launch("runtime-0", sys.executable, env)
    other = await launcher.launch("model-x", sys.executable,
                                  {**env, "OMP_NUM_THREADS": "1"})
    assert psutil.Process(forked.pid).ppid() == launcher.zygote_pid
    assert psutil.Process(other.pid).ppid() == os.getpid()  # started as before
    assert not isinstance(other, ZygoteStarted)
    for started in (forked, other):
        await started.kill()


async def test_a_dead_zygote_takes_its_runtimes_and_is_restarted(
        tmp_path: Path, launcher: ZygoteLauncher) -> None:
    env = runtime_env(EXAMPLES, tmp_path)
    started = await launcher.launch("runtime-0", sys.executable, env)
    first_zygote = launcher.zygote_pid
    assert first_zygote is not None
    os.kill(first_zygote, signal.SIGKILL)
    # Its runtime dies with it (PR_SET_PDEATHSIG) and is reported so.
    assert await asyncio.wait_for(started.wait_exit(), 30) == -signal.SIGKILL
    assert gone(started.pid)
    await eventually(lambda: launcher.zygote_pid not in (None, first_zygote), timeout_s=60)
    again = await launcher.launch("runtime-0", sys.executable, env)
    assert psutil.Process(again.pid).ppid() == launcher.zygote_pid
    await again.kill()


async def test_closing_leaves_no_process_behind(tmp_path: Path,
                                                launcher: ZygoteLauncher) -> None:
    env = runtime_env(EXAMPLES, tmp_path)
    runtimes = [await launcher.launch(f"runtime-{i}", sys.executable, env) for i in range(2)]
    zygote = launcher.zygote_pid
    assert zygote is not None
    await launcher.close()  # the runtimes still up: the zygote kills them first
    for pid in (zygote, *(r.pid for r in runtimes)):
        await eventually(lambda pid=pid: gone(pid), timeout_s=10)  # type: ignore[misc]
    assert all(r.exit_code is not None for r in runtimes)


async def test_a_workers_runtimes_are_forked_and_its_stop_leaves_nothing(
        tmp_path: Path) -> None:
    settings = Settings(repo=str(EXAMPLES), state_dir=tmp_path, worker={
        "restart_backoff_max_s": 0.2, "quarantine_standing": True, "runtime_zygote": True},
        runtime={"ping_interval_s": 0.1})
    supervisor = RuntimeSupervisor(settings)
    await supervisor.start()
    await eventually(lambda: all(r.ready for r in supervisor.all()), timeout_s=60)
    me = psutil.Process()
    [zygote] = me.children()  # the runtimes are the zygote's children, not the worker's
    runtimes = zygote.children()
    assert len(runtimes) == len(supervisor.all()) == 2
    [shared] = supervisor.shared
    runtimes[0].kill()  # a crash: restarted by a fork
    await eventually(lambda: shared.restarts + (supervisor.all()[1].restarts) == 1
                     and shared.ready and supervisor.all()[1].ready, timeout_s=60)
    assert len(zygote.children()) == 2
    await asyncio.wait_for(supervisor.stop(), 60)
    assert me.children(recursive=True) == [] or all(
        gone(p.pid) for p in me.children(recursive=True))
    assert gone(zygote.pid) and all(gone(p.pid) for p in runtimes)


async def test_runtime_logs_reach_the_workers_output(
        tmp_path: Path, launcher: ZygoteLauncher, capfd: pytest.CaptureFixture[str]) -> None:
    started = await launcher.launch("runtime-logged", sys.executable,
                                    runtime_env(EXAMPLES, tmp_path))
    await started.kill()
    assert "[runtime-logged]" in capfd.readouterr().err  # the runtime's own log line


async def test_what_models_imported_is_kept_for_the_next_zygote(tmp_path: Path) -> None:
    sockets, known = tmp_path / "sockets", tmp_path / "state" / "zygote-modules.txt"
    sockets.mkdir()
    env = runtime_env(EXAMPLES, tmp_path)
    first = ZygoteLauncher(ProcessLauncher(sockets, 60, 10), known)
    try:
        await (await first.launch("runtime-0", sys.executable, env)).kill()
        first.preload(["numpy"])  # as a runtime's health reports it
    finally:
        await first.close()
    assert known.read_text().split() == ["numpy"]
    second = ZygoteLauncher(ProcessLauncher(sockets, 60, 10), known)  # a worker restarted
    try:
        started = await second.launch("runtime-0", sys.executable, env)
        # Imported before the first fork: the runtime maps numpy's pages from the zygote.
        assert "numpy" in maps(second.zygote_pid) and "numpy" in maps(started.pid)
        await started.kill()
    finally:
        await second.close()


async def test_a_restart_during_a_long_preload_is_forked_between_two_imports(
        tmp_path: Path, launcher: ZygoteLauncher) -> None:
    # Two modules whose import waits for a file each: the zygote is busy importing the
    # first when a runtime dies and its restart is asked for. Both are answered once that
    # import ends, before the second one (blocked here until the restart is done): a
    # crash during a first preload no longer waits for every import it holds.
    modules = tmp_path / "modules"
    modules.mkdir()
    for name in ("gated_a", "gated_b"):
        (modules / f"{name}.py").write_text(
            "import os, time\n"
            f"open({str(tmp_path / name)!r} + '.started', 'w').close()\n"
            f"while not os.path.exists({str(tmp_path / name)!r}):\n"
            "    time.sleep(0.01)\n")
    env = runtime_env(EXAMPLES, tmp_path, PYTHONPATH=str(modules))
    first = await launcher.launch("runtime-0", sys.executable, env)
    zygote = launcher._zygote
    assert zygote is not None
    launcher.preload(["gated_a", "gated_b"])
    await eventually(lambda: (tmp_path / "gated_a.started").exists(), timeout_s=30)
    os.kill(first.pid, signal.SIGKILL)  # its exit is reaped only between two imports
    restart = asyncio.create_task(launcher.launch("runtime-0", sys.executable, env))
    await eventually(lambda: len(zygote._answers) == 2, timeout_s=10)  # preload and fork
    (tmp_path / "gated_a").touch()
    assert await asyncio.wait_for(first.wait_exit(), 30) == -signal.SIGKILL
    again = await asyncio.wait_for(restart, 30)
    assert psutil.Process(again.pid).ppid() == zygote.pid
    assert not (tmp_path / "gated_b").exists()  # the preload is still importing it
    (tmp_path / "gated_b").touch()
    await eventually(lambda: not zygote._answers, timeout_s=30)  # and then answers it
    await again.kill()
