"""What the gateway records of each inference request: phase histograms and a log line.

Every request is observed once, whatever its outcome: ``modelfleet_phase_seconds``
gets ``phase="total"`` (received to answered, at the gateway) and, when a worker's
reply came back (answered or failed), each phase the worker timed; ``outcome`` is
"ok" or the error code the caller got. With ``log_format="json"`` each request also
leaves one log line (logger ``modelfleet.requests``) with its id, model, version,
worker, status, outcome and phase timings; never its payload or its URLs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from modelfleet import metrics
from modelfleet.labels import ModelLabels
from modelfleet.messages import Reply

log = logging.getLogger("modelfleet.requests")


@dataclass
class RequestRecord:
    request_id: str
    model: str  # as the caller named it; "(unknown)" when not in the catalog
    version: str
    status: int
    outcome: str  # "ok" or an error code
    total_s: float
    reply: Reply | None = None


class RequestObserver:
    def __init__(self, log_format: str, model_labels: ModelLabels | None = None) -> None:
        # Per-request lines at INFO only when asked for JSON logs: text logs stay quiet.
        self._level = logging.INFO if log_format == "json" else logging.DEBUG
        self._label = model_labels if model_labels is not None else ModelLabels()

    def label(self, model_id: str) -> str:
        """The bounded ``model`` label value for ``model_id``."""
        return self._label(model_id)

    def record(self, rec: RequestRecord) -> None:
        model = self._label(rec.model)
        timings = dict(rec.reply.timings_ms) if rec.reply is not None else {}
        for phase, ms in timings.items():
            metrics.PHASE_SECONDS.labels(model, phase, rec.outcome).observe(ms / 1000)
        metrics.PHASE_SECONDS.labels(model, "total", rec.outcome).observe(rec.total_s)
        if not log.isEnabledFor(self._level):
            return
        fields = {
            "event": "request",
            "request_id": rec.request_id,
            "model": rec.model,
            "version": rec.version,
            "worker": rec.reply.worker_id if rec.reply is not None else "",
            "status": rec.status,
            "outcome": rec.outcome,
            "cold": rec.reply.cold if rec.reply is not None else None,
            "timings_ms": {**{k: round(v, 3) for k, v in timings.items()},
                           "total": round(rec.total_s * 1000, 3)},
        }
        log.log(self._level, "request %s %s v%s -> %d %s in %.1f ms", rec.request_id or "-",
                rec.model, rec.version or "?", rec.status, rec.outcome, rec.total_s * 1000,
                extra={"fields": fields})
