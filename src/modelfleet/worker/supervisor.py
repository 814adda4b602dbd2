"""Runtimes: starting them, pinging them, restarting them.

Each ``SupervisedRuntime`` is started by a ``Launcher`` (``ipc.protocol``): in
production a spawned interpreter (``python -m modelfleet.runtime``) reached over a
Unix socket (``process_launcher``); in tests, the same server code in this process
(``runtime.inprocess``), supervised the same way. The supervisor pings it every
``ping_interval_s``; a runtime that dies, or does not answer a ping within
``ping_timeout_s`` (wedged), is killed and restarted with exponential backoff. Pings
are answered by the runtime's event loop while loads run on threads, so a long model
load is not a hang.

When a runtime goes down its socket closes, so every call in flight on it raises
``RuntimeCrashed`` at once: the coordinator hands those tasks back to the broker.
``changed`` is set on every state change so the coordinator can stop pulling the
affected queues without polling.

Which shared runtime holds a model, and how the worker's one device budget is split
among the shared runtimes, is decided by ``worker/spread.py`` and carried out by
``worker/pool.py``: ``take`` gives a task the least-loaded runtime holding its model,
``prepare`` makes room in the pool before a miss.

Models with their own requirements or a memory limit (``Manifest.isolated``) get a
runtime process of their own, started the first time the model is needed: on the
interpreter of a virtual environment built for their requirements (uv, once per
requirements hash), with their memory limit enforced (cgroup v2 where the machine
allows, else a resident-memory watchdog). A crash, hang or memory kill there costs
that model a restart and nobody else anything. An environment that cannot be
built is a deterministic failure: the runtime is ``failed`` and every task for it
is answered with the build error (naming the package) until a retry succeeds.

Suspect work runs on the *quarantine* runtime, a process beside the shared ones that
is no part of their pool or placement: a redelivered task (its worker died), a task the
dead runtime's flight record names (``ipc/flight.py``: it was in a predict that ran),
and for ``worker.quarantine_idle_s`` every task of a model whose code ran in a crash or
whose task crashed a runtime alone (``mark_crashing``). It stands from the worker's
start (``worker.quarantine_standing``; else it is started on the first suspect and
stopped once unused for ``worker.quarantine_idle_s``), at a lower CPU priority
(``worker.quarantine_nice``). Tasks there run one at a time (worker/gate.py), so a crash
there is evidence against the task that caused it, and it costs the healthy models on
the shared runtimes nothing: they are not reloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
from modelfleet.repository import Catalog, ModelStore
from modelfleet.settings import BrokerSettings, Settings
from modelfleet.worker.devices import runtime_device_env
from modelfleet.worker.isolation.environments import (
    EnvironmentBuilder,
    EnvironmentBuildFailed,
    requirements_for,
    venv_process_env,
)
from modelfleet.worker.isolation.limits import (
    LimitHandle,
    MemoryLimiter,
    choose_limiter,
    runtime_env,
)
from modelfleet.worker.pool import BudgetPool, pool_bytes, replica_at
from modelfleet.worker.process_launcher import ProcessLauncher
from modelfleet.worker.spread import RuntimeView, Spread

log = logging.getLogger("modelfleet.worker")
State = Literal["starting", "ready", "down", "failed", "stopped"]
RETRY_FAILED_BUILD_S = 30.0
# A shared runtime's spare starts once the runtime has been up this long with no load in
# flight (see SupervisedRuntime._keep_standby).
STANDBY_DELAY_S = 2.0
# A flight record's marks of a runtime found SIGKILLed this soon after are void.
KILL_NOTICE_S = 5.0
QUARANTINE = "quarantine"


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
        backoff = Backoff(0.2, max(0.2, self._settings.worker.restart_backoff_max_s))
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
            log.warning("runtime %s %s; restarting in %.1fs", self.name, reason, pause)
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
            while True:
                interval = self._settings.runtime.ping_interval_s
                done, _ = await asyncio.wait({exited}, timeout=interval)
                await self._retire_standby_when_quiet()
                if done:
                    return f"exited (code {started.exit_code})"
                try:
                    health = await started.runtime.health(
                        timeout_s=self._settings.runtime.ping_timeout_s)
                    self.loading = list(health.loading)
                    if not self.loading and asyncio.get_running_loop().time() \
                            - self._ready_at >= STANDBY_DELAY_S:
                        # A spare once the reloads are done, with what its models import.
                        await self._refresh_stale_standby()
                        self._keep_standby()
                    # Kept across restarts: a runtime just restarted has imported little.
                    self._frameworks = sorted(set(self._frameworks).union(health.frameworks))
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


class RuntimeSupervisor:
    """All runtime processes of one worker: a shared pool, plus one per isolated model."""

    def __init__(self, settings: Settings, catalog: Catalog | None = None,
                 store: ModelStore | None = None, launcher: Launcher | None = None) -> None:
        self._settings = settings
        self._catalog = catalog
        self._store = store
        self._socket_dir = Path(tempfile.mkdtemp(prefix="modelfleet-"))
        self._launcher = launcher or ProcessLauncher(
            self._socket_dir, settings.runtime.start_timeout_s, settings.runtime.ping_timeout_s)
        self.changed = asyncio.Event()
        share = pool_bytes(settings) // settings.worker.shared_runtimes
        self.shared = [
            SupervisedRuntime(f"runtime-{i}", settings, self._launcher, self._changed,
                              device_budget_bytes=share,
                              eager_standby=settings.worker.standby_eager,
                              device_env=runtime_device_env(
                                  i, settings.worker.gpus, os.environ))
            for i in range(settings.worker.shared_runtimes)
        ]
        # Which shared runtimes hold each model, and one device budget split among them.
        self.spread = Spread(replica_at(settings), settings.worker.replica_keep_s, self._size_of)
        self.pool = BudgetPool(settings, self.spread, time.monotonic)
        self._placing: asyncio.Task[None] | None = None
        self._stopping = False
        self._dedicated: dict[str, SupervisedRuntime] = {}
        self._builder: EnvironmentBuilder | None = None
        self._limiter: MemoryLimiter | None = None
        self._tools_lock = threading.Lock()
        self._quarantine: SupervisedRuntime | None = None
        self._quarantine_tasks = 0  # tasks taken there and not done yet
        self._quarantine_used = 0.0  # monotonic: when a task there last ended
        # model id -> when it was marked crashing, and the runtime whose flight record
        # marked it (None: it crashed one alone); see mark_crashing.
        self._crashing: dict[str, tuple[float, SupervisedRuntime | None]] = {}

    def _changed(self) -> None:
        self.changed.set()
        metrics.RUNTIMES_READY.set(sum(r.ready for r in self.all()))

    def placed(self) -> list[SupervisedRuntime]:
        """The runtimes whose models count as resident here: all but the quarantine."""
        return [*self.shared, *self._dedicated.values()]

    def all(self) -> list[SupervisedRuntime]:
        quarantine = [] if self._quarantine is None else [self._quarantine]
        return [*self.shared, *self._dedicated.values(), *quarantine]

    async def start(self) -> None:
        for runtime in self.shared:
            runtime.start()
        if self._settings.worker.quarantine_standing:
            self._quarantine_runtime()  # ready before the first crash (see _quarantined)
        await asyncio.gather(*(r.wait_started() for r in self.shared))
        self._placing = asyncio.create_task(self._keep_placement(), name="placement")

    def _isolated(self, model_id: str) -> bool:
        return bool(self._catalog and model_id in self._catalog
                    and self._catalog.get(model_id).manifest.isolated)

    def _size_of(self, model_id: str) -> int:
        if self._catalog is None or model_id not in self._catalog:
            return 0
        return self._catalog.get(model_id).manifest.memory_estimate_bytes

    def _views(self) -> list[RuntimeView]:
        ready = {r.name for r in self.shared if r.ready}
        return self.pool.views([r.name for r in self.shared], lambda name: name in ready)

    def _shared_named(self, name: str) -> SupervisedRuntime:
        return next(r for r in self.shared if r.name == name)

    def runtime_for(self, model_id: str) -> SupervisedRuntime:
        """The runtime that holds ``model_id`` first (its home, placed by memory and load,
        ``worker/spread.py``); an isolated model's own is started on first use."""
        if not self._isolated(model_id):
            held = self.spread.holders(model_id)  # asked per candidate per re-score: cheap
            return self._shared_named(held[0] if held else self.spread.home(
                model_id, self._views(), self.pool.pool_bytes))
        return self._own(model_id)

    def take(self, model_id: str, suspect: bool = False) -> SupervisedRuntime:
        """The runtime a task for the model runs on, counted there until ``done``: the
        least-loaded one holding it. A model this makes hot gets one more runtime.

        A ``suspect`` task, or any task of a model marked crashing lately
        (``mark_crashing``), goes to the quarantine runtime instead (an isolated model
        keeps its own: a crash there costs nobody else anything already)."""
        if self._isolated(model_id):
            return self._own(model_id)
        if self.quarantines(model_id, suspect):
            return self._quarantined()
        views = self._views()
        chosen = self._shared_named(self.spread.route(model_id, views, self.pool.pool_bytes))
        self.spread.started(model_id, chosen.name)
        change = self.spread.review(model_id, views, self.pool.pool_bytes, time.monotonic())
        if change is not None:  # an add: the next task routed there loads the copy
            log.info("model %s is hot (%d tasks in flight): also on %s", model_id,
                     self.spread.running(model_id), change.runtime)
        return chosen

    def quarantines(self, model_id: str, suspect: bool) -> bool:
        """Does a task for the model (``suspect`` or not) go to the quarantine runtime?"""
        # The catalog only for those: this is asked per candidate at every re-score.
        return (suspect or self.crashing(model_id)) and not self._isolated(model_id)

    def quarantine_accepting(self) -> bool:
        """Would the quarantine runtime take a task now (it is started on demand)?"""
        runtime = self._quarantine
        return runtime is None or runtime.stopped or runtime.accepting

    def done(self, model_id: str, runtime: SupervisedRuntime) -> None:
        if runtime is self._quarantine:
            self._quarantine_tasks -= 1
            self._quarantine_used = time.monotonic()
        elif runtime in self.shared:
            self.spread.finished(model_id, runtime.name)
            if not self.spread.running_at(model_id, runtime.name):
                self.pool.release(runtime.name, model_id)

    def elsewhere(self, model_id: str, refused: SupervisedRuntime) -> SupervisedRuntime:
        """After a shared runtime's RSS guard refused the model's load: another shared
        runtime that is up, the task counted there instead (``spread.rehome``); the
        refusing one itself when it is the only one up."""
        if refused not in self.shared:
            return refused
        name = self.spread.rehome(model_id, refused.name, self._views(), self.pool.pool_bytes)
        if name is None or name == refused.name:
            return refused
        chosen = self._shared_named(name)
        self.done(model_id, refused)
        self.spread.started(model_id, chosen.name)
        log.info("runtime %s is over its memory line: %s runs on %s instead", refused.name,
                 model_id, chosen.name)
        return chosen

    def refused_for_memory(self, runtime: SupervisedRuntime, model_id: str) -> None:
        """The runtime refused the model's load for memory: the room held for it is
        reckoned afresh at the next ``prepare`` (the budgets have moved since)."""
        if self.is_shared(runtime):
            self.pool.release(runtime.name, model_id)

    async def prepare(self, runtime: SupervisedRuntime, model_id: str) -> None:
        """Before a task runs: if its model is not resident there, the pool's free bytes
        go to that runtime first (the room for a miss is kept once, for the pool)."""
        if runtime in self.shared:
            await self.pool.make_room(self.shared, runtime.name, model_id,
                                      self._size_of(model_id))

    async def _keep_placement(self) -> None:
        """Keep the pool's budgets and the placement book current; drop cooled replicas."""
        while not self._stopping:
            await asyncio.sleep(self._settings.worker.rescore_interval_s)
            try:
                for change in await self.pool.resync(self.shared):
                    if change.action == "add":
                        log.info("model %s is hot (%d tasks in flight): also on %s",
                                 change.model_id, self.spread.running(change.model_id),
                                 change.runtime)
                    else:
                        await self._carry_out(change.model_id,
                                              self._shared_named(change.runtime))
            except Exception:
                log.exception("placement review failed")

    async def _carry_out(self, model_id: str, runtime: SupervisedRuntime) -> None:
        """A replica dropped: unload that copy, so that its bytes go back to the pool."""
        log.info("model %s cooled down: off %s again", model_id, runtime.name)
        self.pool.unloaded(model_id, runtime.name)
        target = runtime.runtime
        if runtime.ready and target is not None:
            try:
                await target.unload(model_id, timeout_s=self._settings.runtime.ping_timeout_s)
            except (ModelfleetError, TimeoutError) as exc:
                if self._stopping:
                    return
                log.info("unloading the replica of %s from %s: %s", model_id, runtime.name, exc)

    def is_quarantine(self, runtime: SupervisedRuntime) -> bool:
        return runtime is self._quarantine

    def is_shared(self, runtime: SupervisedRuntime) -> bool:
        """One of the shared runtimes of the pooled budget (not an isolated model's own, not
        the quarantine)."""
        return any(runtime is shared for shared in self.shared)

    def mark_crashing(self, model_id: str, recorded_on: SupervisedRuntime | None = None
                      ) -> None:
        """A task of the model crashed a runtime alone, or the model's code was running
        when ``recorded_on`` died (its flight record): its tasks go to quarantine a while.

        A runtime killed from outside (SIGKILL: the OOM killer, an operator) names in its
        record whatever happened to be predicting, through no fault of its own: that
        does not send a model's traffic to quarantine, one task at a time (measured:
        ``bench/crash_stall.py`` had iris served from quarantine after each kill). Its
        suspects still run there alone."""
        if recorded_on is not None and self._killed(recorded_on):
            return
        earlier = self._crashing.get(model_id)
        if earlier is not None and earlier[1] is None:
            recorded_on = None  # evidence of its own stays evidence
        self._crashing[model_id] = (time.monotonic(), recorded_on)

    @staticmethod
    def _killed(runtime: SupervisedRuntime) -> bool:
        return time.monotonic() - runtime.killed_at < KILL_NOTICE_S

    def crashing(self, model_id: str) -> bool:
        """Was the model marked crashing (``mark_crashing``) in the last quarantine_idle_s?"""
        mark = self._crashing.get(model_id)
        if mark is None:
            return False
        at, recorded_on = mark
        if recorded_on is not None and self._killed(recorded_on):
            # Marked by a record a moment before its runtime was found killed from outside.
            del self._crashing[model_id]
            return False
        if time.monotonic() - at < self._settings.worker.quarantine_idle_s:
            return True
        del self._crashing[model_id]
        return False

    def _quarantined(self) -> SupervisedRuntime:
        """The quarantine runtime, started on first use unless it stands already; the task
        is counted there. From its first task on it keeps a started spare (a pill's crash
        there is a swap, and the next suspect's wait a fraction of a second).

        ``worker.quarantine_standing`` (on by default) starts it with the worker: the
        first suspects come with a shared runtime's crash, when the cores are busy
        restarting it and reloading its models, and a quarantine runtime started then
        took 2-3 s on two cores, which its model's innocents, queued behind the pills,
        waited out past their deadline. It costs one bare interpreter (~50 MB RSS,
        measured) while nothing crashes, its spare another once something did."""
        runtime = self._quarantine_runtime()
        runtime.keep_spare()
        self._quarantine_tasks += 1
        return runtime

    def _quarantine_runtime(self) -> SupervisedRuntime:
        runtime = self._quarantine
        if runtime is None or runtime.stopped:
            runtime = SupervisedRuntime(QUARANTINE, self._settings, self._launcher,
                                        self._changed,
                                        nice=self._settings.worker.quarantine_nice)
            self._quarantine = runtime
            self._quarantine_used = time.monotonic()
            runtime.start()
        return runtime

    async def retire_quarantine(self) -> bool:
        """Stop the quarantine runtime once nothing ran there for quarantine_idle_s."""
        runtime = self._quarantine
        if runtime is None or self._quarantine_tasks or runtime.loading \
                or self._settings.worker.quarantine_standing:
            return False
        idle = time.monotonic() - self._quarantine_used
        if idle < self._settings.worker.quarantine_idle_s:
            return False
        log.info("stopping the quarantine runtime: idle for %.0fs", idle)
        self._quarantine = None  # a suspect arriving meanwhile starts a new one
        await runtime.stop()
        self._changed()
        return True

    def _own(self, model_id: str) -> SupervisedRuntime:
        runtime = self._dedicated.get(model_id)
        if runtime is None:
            runtime = SupervisedRuntime(f"model-{model_id}", self._settings, self._launcher,
                                        self._changed, lambda: self._isolation_for(model_id))
            self._dedicated[model_id] = runtime
            runtime.start()
        return runtime

    def dedicated(self) -> dict[str, SupervisedRuntime]:
        """Isolated models' own runtimes, by model id."""
        return dict(self._dedicated)

    async def retire(self, model_id: str) -> None:
        """Stop an isolated model's own runtime; its next task starts a new one."""
        runtime = self._dedicated.get(model_id)
        if runtime is not None:
            await runtime.stop()
            self._dedicated.pop(model_id, None)  # only once it is really gone
            self._changed()

    def _isolation_for(self, model_id: str) -> Isolation:
        assert self._catalog is not None
        manifest = self._catalog.get(model_id).manifest
        requirements = tuple(manifest.isolation.requirements)
        if self._store is not None:
            package_dir, _ = self._store.materialize(model_id, manifest.version)
            requirements = requirements_for(package_dir, manifest)
        limit = manifest.memory_limit_bytes or self._settings.runtime.memory_limit_bytes
        with self._tools_lock:  # runs on a thread; one builder and one limiter per worker
            if requirements and self._builder is None:
                venvs = self._settings.runtime.venv_dir or str(self._settings.state_dir / "venvs")
                self._builder = EnvironmentBuilder(Path(venvs))
            if limit and self._limiter is None:
                self._limiter = choose_limiter()
        return Isolation(requirements, limit, self._builder, self._limiter)

    async def stop(self) -> None:
        self._stopping = True
        if self._placing is not None:
            self._placing.cancel()
            await asyncio.wait({self._placing})
        results = await asyncio.gather(*(r.stop() for r in self.all()), return_exceptions=True)
        for runtime, result in zip(self.all(), results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping runtime %s failed: %r", runtime.name, result)
        with contextlib.suppress(OSError):
            for leftover in self._socket_dir.iterdir():
                leftover.unlink()
            self._socket_dir.rmdir()
