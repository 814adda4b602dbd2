"""The worker's one log line per task (logger ``modelfleet.tasks``), with ``--log-format json``.

Fields: request id, model, version, worker, status ("ok", "error", or "dropped" for a
task nobody waits for any more, "handed_back" after a runtime crash), the error code,
and the phase timings the runtime measured (queue wait, payload fetch, model load,
preprocess, predict, postprocess). Never the payload, the reply body or a URL.

The reply crosses the coordinator as the bytes the runtime encoded; reading its timings
means decoding it, which happens only when the line will be written (JSON logs on):
text logs cost the task path nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from modelfleet.messages import EncodedReply, Task

log = logging.getLogger("modelfleet.tasks")


class TaskLog:
    def __init__(self, worker_id: str, log_format: str) -> None:
        self._worker_id = worker_id
        self._level = logging.INFO if log_format == "json" else logging.DEBUG

    @property
    def enabled(self) -> bool:
        return log.isEnabledFor(self._level)

    def settled(self, task: Task, reply: EncodedReply) -> None:
        """The task was answered (with a result or an error) and acked."""
        if not self.enabled:
            return
        decoded = reply.decode()
        self._write(task, decoded.status, decoded.error_code,
                    {k: round(v, 3) for k, v in decoded.timings_ms.items()}, decoded.cold)

    def dropped(self, task: Task, why: str) -> None:
        """Acked unrun, or abandoned: its deadline passed or its caller hung up."""
        if self.enabled:
            self._write(task, "dropped", why, {}, None)

    def handed_back(self, task: Task, why: str) -> None:
        """Its runtime crashed under it: back to the broker, or to the dead letters."""
        if self.enabled:
            self._write(task, "handed_back", why, {}, None)

    def _write(self, task: Task, status: str, error_code: str, timings_ms: dict[str, float],
               cold: bool | None) -> None:
        fields: dict[str, Any] = {
            "event": "task", "request_id": task.request_id, "model": task.model_id,
            "version": task.version, "worker": self._worker_id, "status": status,
            "error_code": error_code, "delivery": task.delivery_count, "cold": cold,
            "timings_ms": timings_ms,
        }
        log.log(self._level, "task %s %s v%s: %s%s", task.request_id, task.model_id,
                task.version, status, f" ({error_code})" if error_code else "",
                extra={"fields": fields})
