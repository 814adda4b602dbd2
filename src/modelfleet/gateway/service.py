"""The gateway's broker side: publish a task, park the request, match the reply.

``GatewayService`` never addresses a worker. It resolves a request once
(``resolve``: the model looked up once, its route computed once, the caller's tenant,
a request id and the deadline, in one ``Resolved`` value), and ``infer`` runs that plan:
it keeps large payloads in its ``PayloadStore``, publishes a small Task to the
model's queue (or, for a model no worker holds or pulls, to the cold lane that every
worker takes from), waits for the Reply that names the request on its own inbox and
returns it as an ``Outcome`` (gateway/resolve.py).
It also announces demand per model on the event channel (that is how workers
discover live queues) and keeps a ``FleetView`` from workers' state events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from modelfleet import metrics
from modelfleet.broker import Broker, Inbox, cold_lane
from modelfleet.control.orders import OrderBook
from modelfleet.errors import (
    BrokerError,
    BrokerUnavailable,
    ClientGone,
    ConfigError,
    DeadlineExceeded,
    NoCapacity,
    RequestRejected,
    UnsupportedContentType,
)
from modelfleet.gateway.control_plane import ControlPlane
from modelfleet.gateway.fleet import FleetView, WorkerRegistry
from modelfleet.gateway.inflight import RequestsInFlight
from modelfleet.gateway.parking import ParkedRequests
from modelfleet.gateway.payloads import PayloadStore
from modelfleet.gateway.resolve import Outcome, Resolved
from modelfleet.gateway.statistics import PUBLISH_INTERVAL_S, InferenceStatistics
from modelfleet.messages import PayloadRef, Reply, Task, now_ms
from modelfleet.repository import Catalog
from modelfleet.repository.manifest import Manifest
from modelfleet.scheduling.demand import DemandPriority
from modelfleet.settings import Settings
from modelfleet.tenancy.access import Principal

log = logging.getLogger("modelfleet.gateway")


def url_payload(body: bytes, content_type: str) -> str | None:
    """The caller's URL if the body is exactly ``{"url": "http(s)://..."}``, else None.

    Raises ``RequestRejected`` for such a body whose URL cannot be parsed.
    """
    if content_type != "application/json" or len(body) > 8192:
        return None
    if b"url" not in body and b"\\u" not in body:
        return None  # cannot be {"url": ...}: the handler is the only one to parse it
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (isinstance(value, dict) and set(value) == {"url"} and isinstance(value["url"], str)
            and value["url"].startswith(("http://", "https://"))):
        return None
    url: str = value["url"]
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsing it is the check)
    except ValueError as exc:
        raise RequestRejected(f"payload URL is malformed: {exc}") from exc
    if not parts.hostname:
        raise RequestRejected(f"payload URL has no host: {url!r}")
    return url


def public_url(settings: Settings, bound_port: int | None = None,
               runtimes_local: bool = False) -> str:
    """How runtimes reach this gateway: ``gateway.public_url``, else the bound address.

    A wildcard bind (0.0.0.0, ::) names no reachable host: with runtimes on this
    machine (``serve``) loopback does; otherwise the gateway needs ``gateway.public_url``
    for large payloads (``ConfigError``).
    """
    gw = settings.gateway
    if gw.public_url:
        return gw.public_url.rstrip("/")
    port = bound_port or gw.port
    if gw.host in ("0.0.0.0", "::", "") and runtimes_local:
        return f"http://{'[::1]' if gw.host == '::' else '127.0.0.1'}:{port}"
    if gw.host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"gateway.host is {gw.host!r}: set gateway.public_url "
                          "(MODELFLEET_GATEWAY__PUBLIC_URL) to the address runtimes should "
                          "use to fetch large payloads from this gateway")
    host = f"[{gw.host}]" if ":" in gw.host else gw.host
    return f"http://{host}:{port}"


class GatewayService:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 bound_port: int | None = None, runtimes_local: bool = False,
                 orders: OrderBook | None = None) -> None:
        # Who else hears the fleet's events through this gateway's one subscription
        # (e.g. the catalog refresher, for another gateway's publish).
        self.event_observers: list[Callable[[dict[str, Any]], None]] = []
        self.settings = settings
        self.broker = broker
        self.catalog = catalog
        self.parked = ParkedRequests()
        self._announcer = uuid.uuid4().hex[:16]  # names this gateway in its announcements
        self.payloads = PayloadStore(settings.gateway.payload_store_bytes, settings.secret)
        # The one registry of workers (one staleness rule: gateway.worker_stale_after_s)
        # under both the fleet's states and the control plane's announcements.
        workers = WorkerRegistry(settings.gateway.worker_stale_after_s)
        self.fleet = FleetView(registry=workers)
        # unloads, pins, the route; the orders kept in ``orders`` (the deployment's db)
        self.control = ControlPlane(settings, broker, catalog, orders=orders, registry=workers)
        self.requests = RequestsInFlight()
        self._cancels: set[asyncio.Task[None]] = set()
        self._inbox: Inbox | None = None
        self._announced: dict[str, float] = {}
        self._in_cold_lane: dict[str, int] = {}  # model id -> its requests sent there, waiting
        # Callers' plan priorities per model, announced with the demand (issue 14).
        self._priority = DemandPriority(settings.gateway.max_timeout_s)
        self._loops: list[asyncio.Task[None]] = []
        self.public_url = public_url(settings, bound_port, runtimes_local)
        # The statistics extension's counts, shared with the other gateways by event.
        self.statistics = InferenceStatistics(uuid.uuid4().hex[:12])

    async def start(self) -> None:
        restored = await self.control.restore()  # before the first request is routed
        if restored:
            log.info("control: %d model(s) have orders kept from before this start", restored)
        self._inbox = await self.broker.open_inbox()
        self._loops = [
            asyncio.create_task(self._receive_replies(self._inbox), name="gateway-replies"),
            asyncio.create_task(self._listen_events(), name="gateway-events"),
            asyncio.create_task(self._announce_waiting(), name="gateway-announce"),
            asyncio.create_task(self._publish_statistics(), name="gateway-statistics"),
        ]

    async def stop(self) -> None:
        if self._cancels:  # cancel events already on their way: a moment to get out
            await asyncio.wait(self._cancels, timeout=self.settings.broker.declare_timeout_s)
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._inbox is not None:
            with contextlib.suppress(BrokerUnavailable):
                await self._inbox.close()

    @property
    def live(self) -> bool:
        return all(not loop.done() for loop in self._loops)

    def resolve(self, model_id: str, version: str | None, timeout_s: float | None,
                caller: Principal | None) -> Resolved:
        """The request's plan, resolved once: the model looked up once, its route
        computed once, the caller's tenant and plan taken (``caller``: the auth layer's
        principal, None with auth off: the model owner's), the deadline fixed (the
        caller's timeout in seconds, else the model's, else the default; capped).
        ``ModelNotFound`` for no such model or version, ``ModelUnavailable`` while an
        operator has it unloaded."""
        manifest = self.control.route_of(self.catalog.get(model_id), version)
        self.control.check(model_id)  # refused while an operator has it unloaded
        tenant, plan = (manifest.tenant, manifest.plan) if caller is None else \
            (caller.tenant.name, caller.plan.name)
        return Resolved(uuid.uuid4().hex, model_id, version, manifest, tenant, plan,
                        0 if caller is None else caller.plan.priority,
                        self._deadline_ms(manifest.timeout_s, timeout_s))

    def with_timeout(self, resolved: Resolved, timeout_s: float | None) -> Resolved:
        """``resolved`` with the deadline of the caller's timeout, where the request's
        body gave one (a v2 ``timeout`` parameter)."""
        if timeout_s is None:
            return resolved
        return replace(resolved, deadline_ms=self._deadline_ms(resolved.manifest.timeout_s,
                                                               timeout_s))

    def _deadline_ms(self, model_timeout_s: float | None, asked_s: float | None) -> int:
        gw = self.settings.gateway
        timeout_s = min(asked_s or model_timeout_s or gw.default_timeout_s, gw.max_timeout_s)
        return now_ms() + int(timeout_s * 1000)

    async def infer(self, resolved: Resolved, body: bytes, content_type: str,
                    params: dict[str, str],
                    disconnected: Callable[[], Awaitable[None]] | None = None) -> Outcome:
        """Run one resolved request through the fleet: the worker's reply, answer or
        failure, as an ``Outcome``; raises a ModelfleetError for a failure decided here
        (no capacity, a content type the model refuses, the deadline, a hang-up)."""
        model_id, manifest, deadline_ms = resolved.model_id, resolved.manifest, \
            resolved.deadline_ms
        if manifest.device == "cuda" and not self.fleet.has_gpu_worker():
            # Queued, it would wait for its deadline: CPU workers never pull it.
            raise NoCapacity(f"model '{model_id}' needs a CUDA device (device = \"cuda\") "
                             "and no live worker has one (a GPU worker declares its devices "
                             "with MODELFLEET_WORKER__GPUS)", retry_after_s=5)
        url = url_payload(body, content_type)
        if url is None and content_type not in manifest.accepts:
            raise UnsupportedContentType(
                f"model '{model_id}' accepts {', '.join(manifest.accepts)}; got "
                f"'{content_type or '(none)'}'")
        if len(self.parked) >= self.settings.gateway.max_parked_requests:
            raise NoCapacity(f"{len(self.parked)} requests are already waiting on this gateway")
        request_id = resolved.request_id
        if url is not None:
            payload = PayloadRef("url", url=url)
        elif len(body) <= self.settings.gateway.inline_threshold_bytes:
            payload = PayloadRef("inline", data=body, size_bytes=len(body))
        else:
            self.payloads.put(request_id, body, content_type, deadline_ms)
            payload = PayloadRef("gateway", size_bytes=len(body), url=self.public_url
                                 + self.payloads.url_path(request_id, deadline_ms))
        assert self._inbox is not None, "start() the gateway service first"
        task = Task(request_id, model_id, manifest.version, deadline_ms, self._inbox.address,
                    payload, content_type, now_ms(), resolved.tenant, resolved.plan, params)
        priority = resolved.priority
        lane = self._lane(model_id, manifest, priority)
        waiting = self.parked.park(request_id, model_id)
        if lane is not None:
            self._in_cold_lane[model_id] = self._in_cold_lane.get(model_id, 0) + 1
            metrics.GATEWAY_COLD_LANE.inc()
        try:
            await self.broker.publish_task(task, lane)
            self._priority.note(model_id, priority, time.monotonic())
            if lane is None:  # a cold-lane task waits in no model queue: nothing to announce
                await self._announce(model_id)
            try:
                reply = await self._wait(waiting, deadline_ms, disconnected)
            except ClientGone:
                self._cancel(task, "client_disconnected")
                raise
            except asyncio.CancelledError:  # cut off by the drain at shutdown
                self._cancel(task, "shutting_down" if self.requests.draining else "cancelled")
                raise
        finally:
            self.parked.unpark(request_id)
            self.payloads.free(request_id)
            if lane is not None:
                left = self._in_cold_lane[model_id] - 1
                if left:
                    self._in_cold_lane[model_id] = left
                else:
                    del self._in_cold_lane[model_id]
        if lane is not None and reply.status == "ok" and reply.worker_id:
            # That worker holds the model now: its next requests go to the model's queue,
            # for the fleet's scoring, without waiting for its next state to say so.
            self.fleet.served(reply.worker_id, model_id)
        return Outcome(resolved, reply)

    def _lane(self, model_id: str, manifest: Manifest, priority: int) -> str | None:
        """The cold lane of the caller's plan priority, or None for the model's own queue.

        The lane when no live worker pulls the model's queue (by the workers' last
        states), none holds it either, and fewer of its requests are in a lane from here
        than ``gateway.cold_lane_per_model`` and its fan-out cap allow (beyond, they wait
        in its queue, announced, where the scoring decides who pulls it). A model held by
        some workers takes its own queue, so that a holder takes it warm (pull affinity).
        In a fleet of one worker, holding and the fan-out cap are no reason: the lane
        reaches that worker, and a burst of one model arrives there together (a poison
        pill's copies then share one crash).
        Isolated and CUDA-only models always take their own queue (only some workers may
        run them)."""
        per_model = self.settings.gateway.cold_lane_per_model
        if per_model == 0 or manifest.isolated or manifest.device == "cuda" \
                or self.fleet.pulled_anywhere(model_id):
            return None
        if not self.fleet.single_worker():  # one worker: caps and affinity are moot
            if self.fleet.held_anywhere(model_id):
                return None
            per_model = min(per_model, self.settings.scheduling.fanout_cap(
                manifest.fanout.max_workers, manifest.plan))
        if self._in_cold_lane.get(model_id, 0) >= per_model:
            return None
        known = self.settings.scheduling.plan_priority.values()
        return cold_lane(priority if priority in known else 0)

    async def _wait(self, waiting: asyncio.Future[Reply], deadline_ms: int,
                    disconnected: Callable[[], Awaitable[None]] | None) -> Reply:
        remaining_s = max(0.0, (deadline_ms - now_ms()) / 1000)
        watchers: set[asyncio.Future[object]] = {waiting}  # type: ignore[arg-type]
        hangup = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        if hangup is not None:
            watchers.add(hangup)  # type: ignore[arg-type]
        try:
            done, _ = await asyncio.wait(watchers, timeout=remaining_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if hangup is not None:
                hangup.cancel()
        if waiting in done:
            return waiting.result()
        if hangup is not None and hangup in done:
            raise ClientGone("the caller hung up while waiting for the answer")
        raise DeadlineExceeded(f"no answer within the deadline "
                               f"({remaining_s:.1f}s); the request may still run once")

    def _cancel(self, task: Task, reason: str) -> None:
        """Tell workers nobody waits for ``task`` any more: an event
        ``{"kind": "cancel", "request_id", "model_id", "reason"}``. Published in the
        background (the caller is gone, or the request is being cut off); best effort."""
        async def publish() -> None:
            with contextlib.suppress(BrokerError):
                await self.broker.publish_event({"kind": "cancel", "request_id": task.request_id,
                                                 "model_id": task.model_id, "reason": reason,
                                                 "at": time.time()})

        pending = asyncio.create_task(publish(), name=f"cancel-{task.request_id}")
        self._cancels.add(pending)
        pending.add_done_callback(self._cancels.discard)

    async def _announce(self, model_id: str) -> None:
        """Tell workers this model has demand (at most once per interval per model)."""
        now = time.monotonic()
        interval = self.settings.gateway.demand_announce_interval_s
        if now - self._announced.get(model_id, -1e9) < interval:
            return
        waiting = self.parked.waiting(model_id) - self._in_cold_lane.get(model_id, 0)
        if waiting <= 0:
            return  # all of them in the cold lane
        self._announced[model_id] = now
        with contextlib.suppress(BrokerUnavailable):
            # ``waiting`` and ``gateway``: workers estimate the queue's backlog from them
            # instead of counting it on the broker (worker/announced.py).
            await self.broker.publish_event({"kind": "demand", "model_id": model_id,
                                             "at": time.time(),
                                             "priority": self._priority.of(model_id, now),
                                             "waiting": waiting,
                                             "gateway": self._announcer})

    async def _announce_waiting(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gateway.demand_announce_interval_s)
            for model_id in self.parked.waiting_models():
                await self._announce(model_id)

    async def _receive_replies(self, inbox: Inbox) -> None:
        async for reply in inbox:
            self.parked.deliver(reply)

    async def _publish_statistics(self) -> None:
        """This gateway's changed counts for the other gateways' /v2 statistics."""
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            event = self.statistics.event()
            if event is not None:
                try:
                    await self.broker.publish_event(event)
                except BrokerUnavailable:
                    self.statistics.unsent(event)

    async def _listen_events(self) -> None:
        while True:
            with contextlib.suppress(BrokerUnavailable):
                async for event in self.broker.events():
                    self.fleet.observe(event)
                    self.control.observe(event)
                    self.statistics.observe(event)
                    for observe in self.event_observers:
                        observe(event)
            await asyncio.sleep(1)
