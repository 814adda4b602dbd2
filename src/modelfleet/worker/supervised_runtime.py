"""One runtime process under supervision: started, pinged, restarted, and its spare.

A ``SupervisedRuntime`` is started by a ``Launcher`` (``ipc.protocol``): in production a
spawned interpreter (``python -m modelfleet.runtime``) reached over a Unix socket
(``process_launcher``); in tests, the same server code in this process
(``runtime.inprocess``), supervised the same way. It is pinged every
``ping_interval_s``; a runtime that dies, or does not answer a ping within
``ping_timeout_s`` (wedged), is killed and restarted with exponential backoff. Pings
are answered by the runtime's event loop while loads run on threads, so a long model
load is not a hang. A shared runtime may keep a started spare (a standby) that takes
over after a crash. What a runtime process is told (no secrets, its thread pools) is
here too. Which runtimes a worker runs, and which task goes where, is
``worker/supervisor.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from modelfleet import metrics
from modelfleet.backoff import Backoff
from modelfleet.errors import (
    ConfigError,
    ModelfleetError,
    ModelLoadFailed,
    ModelNotFound,
    RuntimeCrashed,
)
from modelfleet.ipc.protocol import (
    NICE_ENV,
    PRELOAD_ENV,
    SETTINGS_ENV,
    Launcher,
    Runtime,
    Started,
)
from modelfleet.settings import BrokerSettings, Settings
from modelfleet.worker.isolation.environments import (
    EnvironmentBuilder,
    EnvironmentBuildFailed,
    venv_process_env,
)
from modelfleet.worker.isolation.limits import (
    LimitHandle,
    MemoryLimiter,
    runtime_env,
)

log = logging.getLogger("modelfleet.worker")
# The pause before a crashed runtime's first restart, doubling on each crash in a row up
# to worker.restart_backoff_max_s. Its bystanders wait it out (a restart is a fork and
# their models' reloads, ~0.2 s): it only has to keep a runtime that dies at start from
# spinning. 0.2 s had been half of the pill bench's bystander stall.
FIRST_RESTART_PAUSE_S = 0.05
State = Literal["starting", "ready", "down", "failed", "stopped"]
RETRY_FAILED_BUILD_S = 30.0
# A shared runtime's spare starts once the runtime has been up this long with no load in
# flight (see SupervisedRuntime._keep_standby).
STANDBY_DELAY_S = 2.0


@dataclass(frozen=True)
class Isolation:
    """What a dedicated runtime needs: its requirements, its limit, and the tools."""

    requirements: tuple[str, ...]
    memory_limit_bytes: int | None
    builder: EnvironmentBuilder | None
    limiter: MemoryLimiter | None


def runtime_settings(settings: Settings, device_budget_bytes: int | None = None) -> Settings:
    """What a runtime is told: no broker credentials, no payload-signing secret.

    Runtimes run model code and its dependencies; they need neither to do their work.
    ``device_budget_bytes``: a shared runtime's starting part of the worker's pool.
    """
    update: dict[str, object] = {"secret": "", "broker": BrokerSettings()}
    if device_budget_bytes is not None:
        update["runtime"] = settings.runtime.model_copy(
            update={"device_budget_bytes": max(1, device_budget_bytes)})
    return settings.model_copy(update=update)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def compute_thread_env(env: dict[str, str], settings: Settings) -> dict[str, str]:
    """Thread-pool sizes for a runtime's numerical libraries (BLAS, OpenMP, torch).

    Each library sizes its pool to every core by default, so N runtimes on C cores run
    N x C compute threads that preempt each other (measured: a batch of 8 through a
    19 MB MLP took 8 ms with 2 BLAS threads per runtime beside a busy neighbour, 3 ms
    with 1). The default gives each shared runtime cores / shared runtimes threads;
    ``runtime.compute_threads`` sets it; a variable the operator set is left alone.
    """
    threads = settings.runtime.compute_threads or max(
        1, (os.cpu_count() or 1) // settings.worker.shared_runtimes)
    return {name: str(threads) for name in THREAD_VARIABLES if name not in env}


def _is_secret(variable: str) -> bool:
    """Environment a runtime must not inherit: the signing secret and broker credentials."""
    return variable in ("MODELFLEET_SECRET", "MODELFLEET_BROKER") \
        or variable.startswith("MODELFLEET_BROKER__")


class SupervisedRuntime:
    """One runtime, kept running: started by a ``Launcher``, pinged, restarted when it dies."""

    def __init__(self, name: str, settings: Settings, launcher: Launcher,
                 on_change: Callable[[], None],
                 isolation: Callable[[], Isolation] | None = None,
                 device_budget_bytes: int | None = None, eager_standby: bool = False,
                 device_env: dict[str, str] | None = None, nice: int = 0) -> None:
        self.name = name
        self._nice = nice  # lowers its CPU priority (the quarantine runtime's)
        # A spare from the first start, not only after a crash (the quarantine runtime:
        # crashes are what it is for).
        self._eager_standby = eager_standby
        self._spare_at_once = False  # its spare starts as soon as it is up (keep_spare)
        self._device_env = device_env or {}  # CUDA_VISIBLE_DEVICES (worker/devices.py)
        self._device_budget_bytes = device_budget_bytes  # a shared one's starting part
        self._settings = settings
        self._launcher = launcher
        # A started spare runtime, kept for a while after a crash (see _adopt_standby).
        self._standby: asyncio.Task[Started] | None = None
        self._last_crash = 0.0
        self._ready_at = 0.0  # loop time: when it last became ready
        self.killed_at = -1e9  # monotonic: when it was last found SIGKILLed (not by itself)
        self._frameworks: list[str] = []  # what its models imported (a standby preloads it)
        self._standby_frameworks: list[str] = []  # what the current standby preloaded
        self._isolation = isolation
        self._on_change = on_change
        self._limit: LimitHandle | None = None
        self.failure: ModelfleetError | None = None
        self._failed_at = 0.0
        self._retry = asyncio.Event()
        self.state: State = "starting"
        self._started_runtime: Started | None = None
        self.restarts = 0
        self.loading: list[str] = []
        self._watch: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._settled = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def runtime(self) -> Runtime | None:
        """The runtime to call, while one is up."""
        started = self._started_runtime
        return None if started is None else started.runtime

    @property
    def accepting(self) -> bool:
        """Whether its queues should be pulled: ready, starting up, or failing fast."""
        return self.state in ("starting", "ready", "failed")

    def connection_lost(self) -> None:
        """The coordinator's connection to it dropped mid-call: it is down from now on.

        Said before the supervisor reaps the process, so that no task waiting for its
        turn (the suspect gate) is sent to a runtime that is already gone.
        """
        if self.state == "ready":
            self._set("down")

    def request_retry(self) -> None:
        """A task wants this failed runtime: try building it again, if it failed long ago."""
        loop_time = asyncio.get_running_loop().time()
        if self.state == "failed" and loop_time - self._failed_at >= RETRY_FAILED_BUILD_S:
            self._retry.set()

    def start(self) -> None:
        self._watch = asyncio.create_task(self._run(), name=f"supervise-{self.name}")

    async def wait_started(self) -> None:
        await self._started.wait()

    @property
    def stopped(self) -> bool:
        return self.state == "stopped"

    def _set(self, state: State) -> None:
        if state != "ready":
            self.loading = []  # a runtime that is not up loads nothing
        if self.state != state:
            self.state = state
            if state in ("ready", "failed"):
                self._settled.set()
            else:
                self._settled.clear()
            self._on_change()

    async def wait_settled(self, timeout_s: float) -> bool:
        """Wait until this runtime is ready or has failed (True); False after ``timeout_s``."""
        if self.state in ("ready", "failed"):
            return True
        try:
            await asyncio.wait_for(self._settled.wait(), max(timeout_s, 0))
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        backoff = Backoff(FIRST_RESTART_PAUSE_S,
                          max(FIRST_RESTART_PAUSE_S, self._settings.worker.restart_backoff_max_s))
        while not self.stopped:
            reason = "crashed"
            try:
                if not self._adopt_standby():
                    await self._spawn()
                self._set("ready")
                self._ready_at = asyncio.get_running_loop().time()
                if self._spare_at_once:
                    self._keep_standby()
                self._started.set()
                backoff.reset()
                reason = await self._watch_until_down()
            except (EnvironmentBuildFailed, ConfigError, ModelLoadFailed, ModelNotFound) as exc:
                # Deterministic: restarting will not help; answer tasks with it meanwhile.
                await self._fail(exc)
                continue
            except ModelfleetError as exc:
                log.error("runtime %s failed to start: %s", self.name, exc)
                self._started.set()
            except Exception as exc:  # e.g. OSError spawning it: a crash, retried with backoff
                log.exception("runtime %s failed to start", self.name)
                reason = f"start_failed ({exc!r})"
                self._started.set()
            if self.stopped:
                return
            self._set("down")
            if self._limit is not None and self._limit.killed_for_memory():
                reason = "memory"
                log.warning("runtime %s: %s", self.name, self._limit.kill_reason)
            await self._kill()
            if self._started_runtime is not None \
                    and self._started_runtime.exit_code == -signal.SIGKILL:
                self.killed_at = time.monotonic()  # from outside: see mark_crashing
            metrics.RUNTIME_RESTARTS.labels(reason.split(" ")[0]).inc()
            self.restarts += 1
            if self._standby_ready():
                log.warning("runtime %s %s; its standby takes over", self.name, reason)
                continue
            pause = backoff.next()
            log.warning("runtime %s %s; restarting in %.2fs", self.name, reason, pause)
            await asyncio.sleep(pause)

    async def _fail(self, exc: ModelfleetError) -> None:
        """Park in ``failed`` (tasks get ``exc`` at once) until a retry is asked for."""
        log.error("runtime %s cannot start: %s", self.name, exc)
        self.failure = exc
        self._failed_at = asyncio.get_running_loop().time()
        self._retry.clear()
        self._set("failed")
        self._started.set()
        await self._retry.wait()
        self.failure = None
        self._set("starting")

    async def _spawn(self) -> None:
        self._started_runtime, self._limit = await self._launch()

    def _standby_ready(self) -> bool:
        standby = self._standby
        return standby is not None and standby.done() and not standby.cancelled() \
            and standby.exception() is None

    def _adopt_standby(self) -> bool:
        """After a crash, swap in the standby process if one is up; start the next one.

        A shared runtime that crashed keeps a started spare process for
        ``worker.standby_keep_s``: a crash then costs a swap, not an interpreter start
        (measured: 0.9 s of the ~2.5 s every model on the runtime stalled per crash).
        Crashes come in series (a poison pill is retried; an input pattern recurs), so
        the spare is started at the first crash and dropped after a quiet spell, so that
        no memory is spent on it while nothing crashes.
        """
        if self.restarts == 0:
            return False
        self._last_crash = asyncio.get_running_loop().time()
        if not self._standby_ready():
            return False
        assert self._standby is not None
        started = self._standby.result()
        self._standby = None
        if started.exit_code is not None:  # died while it waited: start afresh
            return False
        self._started_runtime, self._limit = started, None
        return True

    @property
    def spare(self) -> Literal["none", "starting", "ready"]:
        """Its started spare process (a standby), for the fleet page: "ready" once it is
        up with what the runtime's models import."""
        if self._standby is None:
            return "none"
        if not self._standby_ready() or set(self._frameworks) - set(self._standby_frameworks):
            return "starting"
        return "ready"

    def keep_spare(self) -> None:
        """Keep a started spare from now on, started as soon as it is up (the quarantine
        runtime, once used: its pills come in bursts)."""
        if not self._spare_at_once:
            self._eager_standby = self._spare_at_once = True
            if self.ready:
                self._keep_standby()

    def _keep_standby(self) -> None:
        """After a crash, (re)start the spare of a shared runtime, once the runtime is up.

        A shared runtime's spare waits until the runtime has been up for
        ``STANDBY_DELAY_S`` with no load in flight (``_watch_until_down``): an interpreter
        importing every framework its models use takes a core for seconds, and right
        after a crash the cores are needed for the reloads the other models are waiting
        on (measured on two cores: iris reloaded in 6.4 s beside a starting spare and
        the quarantine runtime's start)."""
        if self._isolation is None and (self.restarts or self._eager_standby) \
                and self._standby is None \
                and self._settings.worker.standby_keep_s:
            self._standby = asyncio.create_task(self._start_standby(),
                                                name=f"standby-{self.name}")

    async def _start_standby(self) -> Started:
        self._standby_frameworks = list(self._frameworks)
        started, _ = await self._launch({PRELOAD_ENV: ",".join(self._frameworks)},
                                        standby=True)
        return started

    async def _refresh_stale_standby(self) -> None:
        """A spare started before its runtime's models imported their frameworks (an eager
        one, ``worker.standby_eager``) would not spare their imports: start it afresh."""
        if self._standby is None or not self._standby_ready() \
                or not set(self._frameworks) - set(self._standby_frameworks):
            return
        standby, self._standby = self._standby, None
        await self._stop_standby(standby)
        self._keep_standby()

    async def _retire_standby_when_quiet(self) -> None:
        """Stop the standby once no crash came for ``worker.standby_keep_s``."""
        standby = self._standby
        if standby is None or self._eager_standby:  # kept while the runtime is up
            return
        idle = asyncio.get_running_loop().time() - self._last_crash
        if idle < self._settings.worker.standby_keep_s:
            return
        self._standby = None
        await self._stop_standby(standby)

    @staticmethod
    async def _stop_standby(standby: asyncio.Task[Started]) -> None:
        if not standby.done():
            standby.cancel()
            await asyncio.wait({standby})
            return
        if standby.cancelled() or standby.exception() is not None:
            return
        await standby.result().kill()

    async def _launch(self, extra_env: dict[str, str] | None = None, standby: bool = False
                      ) -> tuple[Started, LimitHandle | None]:
        """Start a runtime (built for its model when isolated) and attach its memory limit."""
        python = sys.executable
        limit = None
        env = dict(os.environ)
        isolation = None
        if self._isolation is not None:  # reads the package (maybe remote): off the loop
            isolation = await asyncio.to_thread(self._isolation)
            limit = isolation.memory_limit_bytes
            if isolation.requirements and isolation.builder is not None:
                python = str(await isolation.builder.ensure(
                    isolation.requirements,
                    lambda line: log.info("runtime %s: %s", self.name, line)))
                env = venv_process_env(os.environ)
        env = {k: v for k, v in env.items() if not _is_secret(k)}
        env.update({SETTINGS_ENV: runtime_settings(
            self._settings, self._device_budget_bytes).model_dump_json(),
                    **runtime_env(limit)})
        env.update(compute_thread_env(env, self._settings))
        env.update(self._device_env)
        if self._nice:
            env[NICE_ENV] = str(self._nice)
        env.update(extra_env or {})
        started = await self._launcher.launch(self.name, python, env, standby)
        handle = None
        if limit is not None and isolation is not None and isolation.limiter is not None:
            try:
                handle = isolation.limiter.attach(started.pid, self.name, limit)
            except BaseException:
                await started.kill()
                raise
        return started, handle

    async def _watch_until_down(self) -> str:
        started = self._started_runtime
        assert started is not None
        exited = asyncio.create_task(started.wait_exit())
        try:
            # Not ``while True``: on Python 3.11 a cancel (``stop``) that lands as a ping's
            # answer arrives is swallowed by ``asyncio.wait_for``, and the watch went on
            # pinging forever (seen: a worker's stop hung, ~1 in 10 with 0.1 s pings).
            while not self.stopped:
                interval = self._settings.runtime.ping_interval_s
                done, _ = await asyncio.wait({exited}, timeout=interval)
                await self._retire_standby_when_quiet()
                if done:
                    return f"exited (code {started.exit_code})"
                try:
                    health = await started.runtime.health(
                        timeout_s=self._settings.runtime.ping_timeout_s)
                    self.loading = list(health.loading)
                    # Kept across restarts: a runtime just restarted has imported little.
                    self._frameworks = sorted(set(self._frameworks).union(health.frameworks))
                    if not self.loading and asyncio.get_running_loop().time() \
                            - self._ready_at >= STANDBY_DELAY_S:
                        if self._isolation is None:  # a zygote imports them, for a restart
                            self._launcher.preload(self._frameworks)
                        # A spare once the reloads are done, with what its models import.
                        await self._refresh_stale_standby()
                        self._keep_standby()
                    stuck = [m for m, age in health.load_ages_s.items()
                             if age > self._settings.runtime.load_timeout_s]
                    if stuck:
                        # A thread cannot be killed: restarting the process is the only
                        # way to get the load slot and the memory back.
                        log.error("runtime %s: load of %s exceeded %.0fs", self.name,
                                  ", ".join(stuck), self._settings.runtime.load_timeout_s)
                        return "load_hung"
                except TimeoutError:
                    return "hung"
                except RuntimeCrashed:
                    return "crashed"
            return "stopped"
        finally:
            exited.cancel()

    async def _kill(self) -> None:
        if self._started_runtime is not None:
            await self._started_runtime.kill()
        if self._limit is not None:
            await self._limit.close()
            self._limit = None

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Ask the runtime to exit; terminate, then kill, if it does not."""
        previous, self.state = self.state, "stopped"
        self._retry.set()
        if self._watch is not None:
            self._watch.cancel()
            # wait(), not await: our own cancellation must not be swallowed with its.
            await asyncio.wait({self._watch})
        if self._standby is not None:
            standby, self._standby = self._standby, None
            await self._stop_standby(standby)
        started = self._started_runtime
        if started is not None and started.exit_code is None:
            if previous == "ready":
                with contextlib.suppress(ModelfleetError, TimeoutError):
                    await started.runtime.shutdown(timeout_s=1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.wait_exit(), timeout_s)
            if started.exit_code is None:
                started.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(started.wait_exit(), 1.0)
        await self._kill()
        self._on_change()
