"""One inference request's exchange at the gateway, whichever API it came by (/v1, /v2).

What both APIs share: the request is tracked for the drain, resolved once (``Ticket``
holds the ``Resolved`` value the handler made: the version the task names is the
version logged, counted and metered), its outcome is counted
(``modelfleet_gateway_requests_total``, latency by bounded model label), logged once
(``RequestObserver``) and, with auth on, metered for the caller's tenant (usage rows:
the phase timings come from the reply itself, the bytes from the body read and the
answer written); a caller that hung up is counted as such, a body that came too slowly
is counted as a read timeout, and a bug of ours is still answered (and logged).
Each API supplies what differs: how it resolves, reads and sends the request (``run``),
how it writes an answer (``respond``) and an error (``error``, ``internal``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from modelfleet import metrics
from modelfleet.errors import ClientGone, ModelfleetError
from modelfleet.gateway.inflight import RequestGuard, RequestTimeout
from modelfleet.gateway.observe import RequestObserver, RequestRecord
from modelfleet.gateway.resolve import Outcome, Resolved
from modelfleet.gateway.service import GatewayService
from modelfleet.messages import Reply
from modelfleet.tenancy.access import CALLER, Principal
from modelfleet.tenancy.usage import UsageMeter, outcome_of

log = logging.getLogger("modelfleet.gateway")


@dataclass
class Ticket:
    """One exchange's request as far as it went: its caller (the auth layer's principal,
    None with auth off), its plan once resolved (None before, or when it could not be),
    the worker's reply once one came (answer or failure), and the body bytes read."""

    caller: Principal | None
    resolved: Resolved | None = None
    reply: Reply | None = None
    bytes_in: int = 0


async def exchange(service: GatewayService, observer: RequestObserver, model: str,
                   version: str | None, what: str,
                   run: Callable[[RequestGuard, Ticket], Awaitable[Outcome]],
                   respond: Callable[[Outcome], Response],
                   error: Callable[[ModelfleetError], Response],
                   internal: Callable[[str], Response],
                   meter: UsageMeter | None = None) -> Response:
    """``run`` resolves the request (``ticket.resolved = service.resolve(...)``) and
    sends it; its ``Outcome`` is answered with ``respond``, or with ``error`` for the
    worker's failure."""
    started = time.perf_counter()
    status, code = 500, "internal_error"
    ticket = Ticket(CALLER.get())
    response: Response | None = None
    try:
        async with service.requests.track() as guard:
            outcome = await run(guard, ticket)
        ticket.resolved, ticket.reply = outcome.resolved, outcome.reply
        failure = outcome.error
        if failure is None:
            status, code = 200, "ok"
            response = respond(outcome)
        else:
            response = error(failure)
            status, code = response.status_code, failure.code
        return response
    except ClientGone as exc:  # nobody reads the answer; counted, not an error of ours
        metrics.CLIENT_DISCONNECTS.inc()
        response = error(exc)
        status, code = response.status_code, exc.code
        log.info("%s for %s: %s", what, model, exc.message)
        return response
    except ModelfleetError as exc:
        response = error(exc)
        status, code = response.status_code, exc.code
        if isinstance(exc, RequestTimeout):
            metrics.READ_TIMEOUTS.labels("body").inc()
        return response
    except Exception as exc:  # a bug of ours: still an error the caller can read, and logged
        log.exception("%s for %s failed", what, model)
        response = internal(f"internal error: {type(exc).__name__}")
        return response
    finally:
        resolved = ticket.resolved
        known = resolved is not None or model in service.catalog
        record_exchange(service, observer, model if known else "(unknown)",
                        resolved.version if resolved is not None else version or "",
                        status, code, ticket.reply, started,
                        resolved.batch_size if resolved is not None else 1,
                        resolved.request_id if resolved is not None else "")
        if meter is not None and ticket.caller is not None and known:
            # Usage rows for real models only; never answered (cut off): cancelled.
            sent = response.status_code if response is not None else 499
            timings = ticket.reply.timings_ms if ticket.reply is not None and \
                status == 200 else {}  # a failure's phases are not billed
            meter.record(ticket.caller.tenant.name, model, outcome_of(sent),
                         timings.get("predict", 0.0) / 1000,
                         timings.get("model_load", 0.0) / 1000, ticket.bytes_in,
                         len(response.body) if response is not None else 0)


def answer_headers(outcome: Outcome) -> dict[str, str]:
    """What every answer tells its caller: who answered, whether it was cold, the phases."""
    return {"X-Worker-Id": outcome.worker_id, "X-Model-Cold": "1" if outcome.cold else "0",
            "Server-Timing": ", ".join(f"{k};dur={v:.2f}"
                                       for k, v in outcome.timings_ms.items())}


def record_exchange(service: GatewayService, observer: RequestObserver, model: str,
                    version: str, status: int, outcome: str, reply: Reply | None,
                    started: float, batch_size: int = 1, request_id: str = "") -> None:
    """Count and log one exchange; ``model`` is "(unknown)" for one the catalog lacks."""
    label = observer.label(model)  # the first N models, then "other"
    seconds = time.perf_counter() - started
    metrics.REQUESTS.labels(label, str(status)).inc()
    metrics.REQUEST_SECONDS.labels(label).observe(seconds)
    if model != "(unknown)" and version:  # the statistics extension: models the catalog has
        service.statistics.record(model, version, status == 200, seconds,
                                  dict(reply.timings_ms) if reply is not None else {},
                                  batch_size)
    observer.record(RequestRecord(request_id, model, version, status, outcome,
                                  seconds, reply))
