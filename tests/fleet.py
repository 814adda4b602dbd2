"""One worker (and, if asked, one gateway) in the test's own process: the in-process fleet.

``in_process_fleet`` assembles what the unit tests of the worker run against: the
embedded broker, the repository opened from the settings, a ``RuntimeSupervisor`` with
an ``InProcessLauncher`` (the runtime's own server code, no process), a ``Coordinator``,
optionally a ``GatewayService`` on the same broker, and an inbox whose replies land in a
queue. It starts them in order and stops them in the reverse order, whatever the test
did, one step's failure not skipping the next.

Start-up, step by step (``start="all"``):

1. the broker (unless the test shares one between fleets: then it is used as it is);
2. the event listener (``hear_events=True``): subscribed before anything publishes;
3. the inbox and its collector: ``replies`` gets every reply sent to ``inbox_address``;
4. the gateway service (``gateway=True``);
5. the coordinator, which starts the supervisor and with it the runtimes.

``start="runtimes"`` starts only the supervisor in step 5, for tests that drive the
coordinator by hand (``_rescore``, ``_observe``). Shutdown: the coordinator (stop
pulling, drain, stop the runtimes), the launcher (the runtimes release their models),
the gateway, the inbox, the listener, the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from modelfleet.broker import Inbox
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.gateway.service import GatewayService
from modelfleet.launch import open_repository
from modelfleet.messages import Reply
from modelfleet.repository import Catalog, ModelStore
from modelfleet.runtime.inprocess import InProcessLauncher
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from modelfleet.worker.supervisor import RuntimeSupervisor
from tests.waiting import eventually

StartMode = Literal["all", "runtimes"]
CatalogFactory = Callable[[ModelStore, Catalog], Catalog]


@dataclass
class InProcessFleet:
    """The parts of a started in-process fleet, for a test to drive and observe."""

    settings: Settings
    broker: MemoryBroker
    store: ModelStore
    catalog: Catalog  # the worker's
    launcher: InProcessLauncher
    supervisor: RuntimeSupervisor
    coordinator: Coordinator
    gateway: GatewayService | None
    inbox_address: str
    replies: asyncio.Queue[Reply]
    # Every event published on the broker while the fleet runs (``hear_events=True``).
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def service(self) -> GatewayService:
        """The gateway service; only for a fleet started with ``gateway=True``."""
        assert self.gateway is not None, "this fleet was started without a gateway"
        return self.gateway

    async def gateway_heard_of_the_worker(self, timeout_s: float = 10) -> None:
        """Wait for the worker's first state event to reach the gateway's fleet view."""
        await eventually(lambda: self.service.fleet.workers(), timeout_s,
                         what="the gateway hearing of the worker")


@contextlib.asynccontextmanager
async def in_process_fleet(
        settings: Settings, *, gateway: bool = False, start: StartMode = "all",
        catalog: Catalog | CatalogFactory | None = None,
        gateway_catalog: Catalog | CatalogFactory | None = None,
        store: ModelStore | None = None,
        broker: MemoryBroker | None = None, broker_type: type[MemoryBroker] = MemoryBroker,
        clock: Callable[[], float] = time.time,
        refresh_catalog: Callable[[], Awaitable[object]] | None = None,
        hear_events: bool = False) -> AsyncIterator[InProcessFleet]:
    """Start a worker (and a gateway) in this process; stop them on the way out.

    ``store``: the repository's store, where the test opened it itself (a catalog
    refresher needs it before the coordinator exists); else opened from ``settings``.
    ``catalog``: the worker's catalog (an instrumented one), given or built from the
    store and the catalog read from it; by default the one read. ``gateway_catalog``:
    the gateway's, likewise; by default the worker's. ``broker``: an already connected
    broker shared with other fleets, neither connected nor closed here; else one of
    ``broker_type`` (an instrumented subclass) is opened for this fleet alone.
    ``clock`` and ``refresh_catalog`` go to the coordinator as they are.
    """
    if store is None:
        store, read = open_repository(settings)
    elif isinstance(catalog, Catalog):
        read = catalog  # the test's own, from its store: not read again
    else:
        read = Catalog.from_store(store)
    worker_catalog = _chosen(catalog, store, read)
    async with contextlib.AsyncExitStack() as stack:
        if broker is None:
            broker = broker_type(settings.broker)
            await broker.connect()
            stack.push_async_callback(broker.close)
        events: list[dict[str, Any]] = []
        if hear_events:
            stack.push_async_callback(_cancelled, asyncio.create_task(
                _listen(broker, events), name="fleet-events"))
            # The memory broker registers a listener at its generator's first step,
            # which the new task takes before this coroutine resumes.
            await asyncio.sleep(0)
        inbox = await broker.open_inbox()
        replies: asyncio.Queue[Reply] = asyncio.Queue()
        collector = asyncio.create_task(_collect(inbox, replies), name="fleet-replies")
        stack.push_async_callback(_finish, collector)  # ends once the inbox is closed
        stack.push_async_callback(inbox.close)
        service = None
        if gateway:
            service = GatewayService(settings, broker, _chosen(gateway_catalog, store,
                                                               worker_catalog),
                                     runtimes_local=True)
            stack.push_async_callback(service.stop)
            await service.start()
        launcher = InProcessLauncher()
        supervisor = RuntimeSupervisor(settings, worker_catalog, store, launcher=launcher)
        coordinator = Coordinator(settings, broker, worker_catalog, supervisor,
                                  clock, refresh_catalog)
        stack.push_async_callback(launcher.close)
        # Stopped even after a start that failed half-way: it stops the supervisor too,
        # and the consumers a test's hand-driven re-scores took.
        stack.push_async_callback(coordinator.stop)
        if start == "all":
            await coordinator.start()
        else:
            await supervisor.start()
        yield InProcessFleet(settings, broker, store, worker_catalog, launcher, supervisor,
                             coordinator, service, inbox.address, replies, events)


def _chosen(given: Catalog | CatalogFactory | None, store: ModelStore,
            default: Catalog) -> Catalog:
    if given is None:
        return default
    if isinstance(given, Catalog):
        return given
    return given(store, default)


async def _listen(broker: MemoryBroker, events: list[dict[str, Any]]) -> None:
    async for event in broker.events():
        events.append(event)


async def _collect(inbox: Inbox, replies: asyncio.Queue[Reply]) -> None:
    async for reply in inbox:
        replies.put_nowait(reply)


async def _finish(task: asyncio.Task[None]) -> None:
    # Bounded: an inbox whose close failed never ends its iteration.
    await asyncio.wait({task}, timeout=5)
    await _cancelled(task)


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # re-raises what the task died of, if not cancelled
