"""``RuntimePlacement``: the control agent's hands on this worker's runtimes.

Loads one model version on the runtime that holds the model first (unloads and unpins
on every runtime that may hold it: a hot model has copies, ``worker/spread.py``), and
reads which versions are resident from the coordinator's last ``Residency`` refresh
(the runtimes' ``stats`` are asked once per re-score, by the coordinator only: a
second reader would take the load and eviction counts away from the metrics).
"""

from __future__ import annotations

from modelfleet.control.versions import Versions
from modelfleet.errors import RuntimeCrashed
from modelfleet.ipc.protocol import Runtime
from modelfleet.repository import Catalog
from modelfleet.settings import Settings
from modelfleet.worker.residency import Residency
from modelfleet.worker.supervised_runtime import SupervisedRuntime
from modelfleet.worker.supervisor import RuntimeSupervisor


class RuntimePlacement:
    def __init__(self, settings: Settings, catalog: Catalog, supervisor: RuntimeSupervisor,
                 residency: Residency) -> None:
        self._load_timeout_s = settings.runtime.load_timeout_s
        self._start_timeout_s = settings.runtime.start_timeout_s
        self._catalog = catalog
        self._supervisor = supervisor
        self._residency = residency

    def versions(self) -> tuple[Versions, Versions, Versions]:
        return self._residency.versions()

    async def load(self, model_id: str, version: str, pinned: bool) -> None:
        runtime = self._supervisor.runtime_for(model_id)  # starts an isolated model's own
        target = await self._up(runtime)
        await self._supervisor.prepare(runtime, model_id)  # the pool's free bytes go there
        await target.load(model_id, version, pinned=pinned, timeout_s=self._load_timeout_s)

    async def unload(self, model_id: str, version: str | None) -> None:
        self._supervisor.pool.unloaded(model_id)
        for runtime in self._existing(model_id):
            if runtime.ready and runtime.runtime is not None:
                await runtime.runtime.unload(model_id, version=version)

    async def unpin(self, model_id: str, version: str) -> None:
        for runtime in self._existing(model_id):
            if runtime.ready and runtime.runtime is not None:
                await runtime.runtime.unpin(model_id, version)

    def _existing(self, model_id: str) -> list[SupervisedRuntime]:
        """Every runtime that may hold the model, without starting an isolated model's own.

        A shared model may have been on any shared runtime (a replica, or a home placed
        again after it was evicted): each is asked; one that does not hold it says so.
        """
        if model_id in self._catalog and self._catalog.get(model_id).manifest.isolated:
            own = self._supervisor.dedicated().get(model_id)
            return [] if own is None else [own]
        return list(self._supervisor.shared)

    async def _up(self, runtime: SupervisedRuntime) -> Runtime:
        await runtime.wait_settled(self._start_timeout_s)
        if runtime.failure is not None and not runtime.ready:
            raise runtime.failure
        target = runtime.runtime
        if not runtime.ready or target is None:
            raise RuntimeCrashed(f"runtime {runtime.name} is not up; try again shortly")
        return target
