"""A worker's runtimes: the shared ones, the isolated ones, the quarantine; which one a
task runs on.

Each runtime is a ``SupervisedRuntime`` (``worker/supervised_runtime.py``), started by
a ``Launcher`` (``ipc.protocol``): in
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
import tempfile
import threading
import time
from pathlib import Path

from modelfleet import metrics
from modelfleet.errors import (
    ModelfleetError,
)
from modelfleet.ipc.protocol import (
    Launcher,
)
from modelfleet.repository import Catalog, ModelStore
from modelfleet.settings import Settings
from modelfleet.worker.devices import runtime_device_env
from modelfleet.worker.isolation.environments import (
    EnvironmentBuilder,
    requirements_for,
)
from modelfleet.worker.isolation.limits import (
    MemoryLimiter,
    choose_limiter,
)
from modelfleet.worker.pool import BudgetPool, pool_bytes, replica_at
from modelfleet.worker.process_launcher import ProcessLauncher
from modelfleet.worker.spread import RuntimeView, Spread
from modelfleet.worker.supervised_runtime import Isolation, SupervisedRuntime
from modelfleet.worker.zygote_launcher import ZygoteLauncher

log = logging.getLogger("modelfleet.worker")
# A flight record's marks of a runtime found SIGKILLed this soon after are void.
KILL_NOTICE_S = 5.0
QUARANTINE = "quarantine"


class RuntimeSupervisor:
    """All runtime processes of one worker: a shared pool, plus one per isolated model."""

    def __init__(self, settings: Settings, catalog: Catalog | None = None,
                 store: ModelStore | None = None, launcher: Launcher | None = None) -> None:
        self._settings = settings
        self._catalog = catalog
        self._store = store
        self._socket_dir = Path(tempfile.mkdtemp(prefix="modelfleet-"))
        plain = ProcessLauncher(
            self._socket_dir, settings.runtime.start_timeout_s, settings.runtime.ping_timeout_s)
        # Ours to stop after the runtimes (a launcher passed in is its owner's).
        self._zygote = ZygoteLauncher(plain, settings.state_dir / "zygote-modules.txt") \
            if launcher is None and settings.worker.runtime_zygote else None
        self._launcher: Launcher = launcher or self._zygote or plain
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

    def to_quarantine(self, model_id: str, taken: SupervisedRuntime,
                      suspect: bool) -> SupervisedRuntime:
        """A task taken for a shared runtime before its model was marked crashing (a crash
        of that runtime, the task queued or waiting for the restart meanwhile): the
        quarantine runtime now, the task counted there instead, as ``take`` would choose
        (the model's pills still queued would crash the restarted runtime again);
        ``taken`` where it stays."""
        if taken not in self.shared or not self.quarantines(model_id, suspect):
            return taken
        self.done(model_id, taken)
        log.info("%s was marked crashing while a task of it waited for %s: it runs in "
                 "quarantine", model_id, taken.name)
        return self._quarantined()

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
        if self._zygote is not None:  # after its runtimes: it kills what is left of them
            await self._zygote.close()
        with contextlib.suppress(OSError):
            for leftover in self._socket_dir.iterdir():
                leftover.unlink()
            self._socket_dir.rmdir()
