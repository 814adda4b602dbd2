"""Assembling processes from their parts, with ordered start-up and shutdown.

``serve`` = broker + worker (coordinator and runtimes) + gateway in one process;
``gateway`` and ``worker`` are the distributed halves. Shutdown, on SIGINT or
SIGTERM, runs in this order:

1. the gateway drains (``RequestsInFlight.drain``): readiness says 503 and new
   requests get 503 shutting_down at once, while the listener stays open (runtimes
   still fetch the payloads of requests in flight from it); requests in flight get
   ``gateway.drain_timeout_s`` to be answered, then a JSON 503 shutting_down. A second
   signal cuts the wait short;
2. the HTTP server stops accepting and closes its connections once their answers are
   written (their answers needed the worker, so it stops after);
3. the worker stops pulling, drains in-flight tasks, stops its runtimes;
4. the gateway's reply and event loops stop;
5. the broker connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any
from urllib.parse import unquote, urlsplit

import uvicorn

from modelfleet import metrics
from modelfleet.broker import Broker, create_broker
from modelfleet.control.orders import OrderStore
from modelfleet.database import default_location
from modelfleet.errors import ConfigError
from modelfleet.gateway.app import create_app
from modelfleet.gateway.auth import guarded, tenant_gate
from modelfleet.gateway.edge import EdgeApp, EdgeLimits, edge_protocol
from modelfleet.gateway.grpc_api.server import grpc_server
from modelfleet.gateway.service import GatewayService
from modelfleet.libc import trim
from modelfleet.publishing.announce import is_foreign_change
from modelfleet.publishing.publisher import Publisher
from modelfleet.redaction import redact_url, secure_logging
from modelfleet.repository import Catalog, LocalStore, ModelStore, open_store
from modelfleet.repository.parse_cache import ManifestCache
from modelfleet.repository.refresher import CatalogRefresher
from modelfleet.repository.store import PackageWriter, store_folders
from modelfleet.settings import Settings
from modelfleet.tenancy.plans import with_plans_file
from modelfleet.tenancy.store import store_location

log = logging.getLogger("modelfleet")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher owns shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def manifest_cache(settings: Settings) -> ManifestCache:
    """The deployment's parsed manifests, kept in ``state_dir`` across starts."""
    return ManifestCache(settings.state_dir / "catalog", settings.repo)


def open_repository(settings: Settings, cache: ManifestCache | None = None
                    ) -> tuple[ModelStore, Catalog]:
    """The repository and its catalog, every manifest validated. Given ``cache``, those
    an earlier start parsed at the stamps they have now are taken from it
    (``repository.parse_cache``), and it is brought up to date if this start parsed any."""
    store = open_store(settings.repo, settings.disk_cache_path,
                       settings.runtime.disk_cache_bytes)
    known, folders = cache.load_with_folders() if cache is not None else ({}, {})
    if folders and isinstance(store, LocalStore):
        # The model folders whose stamp is the same are not listed again (a restart's
        # 100,000 listings were ~1 s of its CPU, measured).
        store.seed_folders(folders)
    del folders
    # What start-up made lives for the process: out of the cyclic GC's passes, which
    # would otherwise walk a large catalog's millions of objects again and again (also
    # while the cache is written below: 0.5 s of full collections at 100,000, measured).
    # Frozen before the collector is back on: from_store pauses it, and the first
    # collection after would walk everything the catalog made once more (0.3-0.5 s of
    # a first start at 100,000, measured), to find no garbage.
    enabled = gc.isenabled()
    gc.disable()
    try:
        catalog = Catalog.from_store(store, known=known)
        del known
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    if cache is not None and catalog.parses:
        cache.save(catalog.known(), store_folders(store))
    _return_freed_memory()
    return store, catalog


def _return_freed_memory() -> None:
    """Give the C heap's free pages back to the OS (``libc.trim``). Start-up's large
    temporaries (the manifest cache's bytes and tables, the manifests it offered) are
    freed below objects that live on, where ``free`` cannot return them: 22 MB of RSS
    after a cached start at 100,000 manifests (measured)."""
    trim()


# After the gateway's drain, how long the HTTP server waits for answers being written
# before it cancels what is left (each cancelled request still gets a JSON 503).
_CLOSE_GRACE_S = 5
Drain = Callable[[asyncio.Event], Awaitable[None]]


def _http_server(app: Any, settings: Settings, edge: bool = False) -> _Server:
    """uvicorn over a socket bound already (``_listen``); with ``edge``, the gateway's
    connection limits and read timeouts (``modelfleet.gateway.edge``)."""
    gw = settings.gateway
    options: dict[str, Any] = {}
    if edge:
        app = EdgeApp(app, gw.max_header_bytes, gw.max_headers)
        options["http"] = edge_protocol(EdgeLimits(gw.header_read_timeout_s,
                                                   gw.body_read_timeout_s, gw.max_connections,
                                                   gw.max_body_bytes))
    # log_config=None: uvicorn's records go through our root handlers (and their redaction).
    config = uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None,
                            timeout_graceful_shutdown=_CLOSE_GRACE_S, access_log=False,
                            timeout_keep_alive=max(1, round(gw.keep_alive_timeout_s)),
                            h11_max_incomplete_event_size=gw.max_header_bytes, **options)
    return _Server(config)


def _secure_logs(settings: Settings) -> None:
    password = urlsplit(settings.broker.url).password if "://" in settings.broker.url else None
    # As written in the URL (percent-encoded) and as the client sends it (decoded).
    secure_logging([settings.secret, *([settings.publish.secret] if settings.publish.secret
                                       else []),
                    *({password, unquote(password)} if password else ())])


def _draining(service: GatewayService, settings: Settings) -> Drain:
    async def drain(hurry: asyncio.Event) -> None:
        timeout_s = settings.gateway.drain_timeout_s
        in_flight = len(service.requests)
        log.info("draining: readiness says 503; %d request(s) in flight get up to %gs",
                 in_flight, timeout_s)
        cut = await service.requests.drain(timeout_s, hurry)
        if cut:
            log.warning("drain: %d request(s) still waiting answered 503 shutting_down", cut)

    return drain


def _listen(host: str, port: int) -> socket.socket:
    """Bind the HTTP port first, so a port in use fails start-up at once, clearly.

    The socket is made with ``IPPROTO_TCP`` explicitly: asyncio sets ``TCP_NODELAY`` on
    accepted connections only when the listener's protocol says TCP, and without it a
    kept-alive response's header and body segments wait on the client's delayed ACK
    (about 40 ms a request, measured).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _until_signalled(server: _Server, listener: socket.socket,
                           drain: Drain | None = None) -> None:
    # Everything start-up built lives as long as the process: out of the cyclic
    # collector's sight, so that a full collection under load walks only what requests
    # made (unfrozen, one took ~60 ms of the event loop in a loaded serve process).
    gc.freeze()
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # The first signal stops; a second one cuts the drain short.
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    serving = asyncio.create_task(server.serve(sockets=[listener]), name="http")
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    if drain is not None and not serving.done():
        await drain(hurry)  # still accepting: readiness 503, new work refused
    server.should_exit = True  # stop accepting; answers being written finish
    await serving
    stopping.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def _refreshing(refresher: CatalogRefresher,
                      observers: list[Callable[[dict[str, Any]], None]], origin: str
                      ) -> AsyncIterator[None]:
    """Re-read the repository every ``repo_refresh_s`` (``CatalogRefresher``), and at once
    when another process announces that it published a version (``publishing.announce``;
    heard through the process's one events subscription, its ``observers``): models come
    and go, no restart, and a published one is servable everywhere within a scan."""
    def follow(event: dict[str, Any]) -> None:
        if is_foreign_change(event, origin):
            refresher.request()

    observers.append(follow)
    task = asyncio.create_task(refresher.run(), name="catalog-refresh")
    try:
        yield
    finally:
        observers.remove(follow)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _publisher(settings: Settings, store: ModelStore, catalog: Catalog,
               refresher: CatalogRefresher, broker: Broker, origin: str) -> Publisher | None:
    """What publishes packages through this gateway, if its repository takes writes."""
    if not isinstance(store, PackageWriter):
        return None
    return Publisher(settings.publish, store, catalog, refresher.refresh_now,
                     broker.publish_event, origin)


async def _connect(settings: Settings) -> Broker:
    broker = create_broker(settings.broker)
    await broker.connect()
    return broker


def _dead_letters_archived(broker: Broker, settings: Settings
                           ) -> contextlib.AbstractAsyncContextManager[None]:
    """On the embedded broker, serve archives its own dead letters (nobody else can)."""
    if settings.broker.url != "memory":
        return contextlib.nullcontext()
    from modelfleet.dlq.embedded import archiving

    return archiving(broker, default_location(settings.state_dir))


@contextlib.contextmanager
def _kept_orders(settings: Settings) -> Generator[OrderStore, None, None]:
    """The control orders' table in the deployment's database (``tenancy.db``, else the
    default location in ``state_dir``): what an operator ordered outlives every process."""
    orders = OrderStore(store_location(settings.tenancy.db, settings.state_dir))
    log.info("control: orders kept in %s", orders.location)
    try:
        yield orders
    finally:
        orders.close()


async def serve(settings: Settings) -> None:
    settings = with_plans_file(settings)  # a plans file's fan-out and priorities
    _secure_logs(settings)
    metrics.bound_models(settings.metrics_models)
    # The worker's parts here, not at import: the gateway alone does without them.
    from modelfleet.worker.coordinator import Coordinator
    from modelfleet.worker.supervisor import RuntimeSupervisor

    cache = manifest_cache(settings)
    store, catalog = open_repository(settings, cache)
    with _listen(settings.gateway.host, settings.gateway.port) as listener, \
            _kept_orders(settings) as orders:
        broker = await _connect(settings)
        try:
            service = GatewayService(settings, broker, catalog, listener.getsockname()[1],
                                     runtimes_local=True, orders=orders)
            refresher = CatalogRefresher(store, catalog, settings.repo_refresh_s, cache)
            origin = uuid.uuid4().hex[:16]
            coordinator = Coordinator(settings, broker, catalog,
                                      RuntimeSupervisor(settings, catalog, store),
                                      refresh_catalog=refresher.refresh_now)
            await service.start()
            try:
                await coordinator.start()
                try:
                    publisher = _publisher(settings, store, catalog, refresher, broker,
                                           origin)
                    gw = settings.gateway
                    log.info("modelfleet serving %d models from %s on http://%s:%d "
                             "(broker: %s)", len(catalog), settings.repo, gw.host,
                             listener.getsockname()[1], redact_url(settings.broker.url))
                    async with _refreshing(refresher, service.event_observers, origin), \
                            _dead_letters_archived(broker, settings), \
                            tenant_gate(settings, catalog, embedded=True) as gate, \
                            grpc_server(service, gate, [lambda: (coordinator.ready,
                                                                 "worker not ready")],
                                        [lambda: coordinator.live], publisher):
                        app = create_app(service, readiness=[
                            lambda: (coordinator.ready, "worker not ready")],
                            liveness=[lambda: coordinator.live], publisher=publisher,
                            meter=gate.meter if gate is not None else None)
                        await _until_signalled(_http_server(guarded(app, gate), settings,
                                                            edge=True),
                                               listener, _draining(service, settings))
                finally:
                    await coordinator.stop()
            finally:
                await service.stop()
        finally:
            await broker.close()
    log.info("stopped")


async def gateway(settings: Settings) -> None:
    _secure_logs(settings)
    cache = manifest_cache(settings)
    store, catalog = open_repository(settings, cache)
    with _listen(settings.gateway.host, settings.gateway.port) as listener, \
            _kept_orders(settings) as orders:
        broker = await _connect(settings)
        try:
            service = GatewayService(settings, broker, catalog, listener.getsockname()[1],
                                     orders=orders)
            refresher = CatalogRefresher(store, catalog, settings.repo_refresh_s, cache)
            origin = uuid.uuid4().hex[:16]
            publisher = _publisher(settings, store, catalog, refresher, broker, origin)
            await service.start()
            try:
                log.info("modelfleet gateway on http://%s:%d (broker: %s)",
                         settings.gateway.host, listener.getsockname()[1],
                         redact_url(settings.broker.url))
                async with _refreshing(refresher, service.event_observers, origin), \
                        tenant_gate(settings, catalog, embedded=False) as gate, \
                        grpc_server(service, gate, publisher=publisher):
                    app = create_app(service, publisher=publisher,
                                     meter=gate.meter if gate is not None else None)
                    await _until_signalled(_http_server(guarded(app, gate), settings,
                                                        edge=True),
                                           listener, _draining(service, settings))
            finally:
                await service.stop()
        finally:
            await broker.close()


async def worker(settings: Settings, host: str, port: int) -> None:
    settings = with_plans_file(settings)  # a plans file's fan-out and priorities
    _secure_logs(settings)
    metrics.bound_models(settings.metrics_models)
    from modelfleet.worker.coordinator import Coordinator
    from modelfleet.worker.health import create_health_app
    from modelfleet.worker.supervisor import RuntimeSupervisor

    cache = manifest_cache(settings)
    store, catalog = open_repository(settings, cache)
    with _listen(host, port) as listener:
        broker = await _connect(settings)
        try:
            refresher = CatalogRefresher(store, catalog, settings.repo_refresh_s, cache)
            coordinator = Coordinator(settings, broker, catalog,
                                      RuntimeSupervisor(settings, catalog, store),
                                      refresh_catalog=refresher.refresh_now)
            await coordinator.start()
            try:
                log.info("modelfleet worker %s serving %d models (probes on http://%s:%d)",
                         coordinator.worker_id, len(catalog), host, listener.getsockname()[1])
                async with _refreshing(refresher, coordinator.event_observers,
                                       uuid.uuid4().hex[:16]):
                    await _until_signalled(
                        _http_server(create_health_app(coordinator), settings), listener)
            finally:
                await coordinator.stop()
        finally:
            await broker.close()


