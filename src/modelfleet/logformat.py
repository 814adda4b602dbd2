"""Log output: human text (the default) or one JSON object per line (``--log-format json``).

JSON lines carry the usual ``ts``, ``level``, ``logger`` and ``message``, plus the
structured fields a record was given with ``extra={"fields": {...}}``: the gateway's
one line per request and the worker's one line per task (see ``gateway/observe.py``
and ``worker/tasklog.py``) put the request id, model, version, worker, status and
phase timings there, never a payload. Redaction (``modelfleet.redaction``) runs on
every record before it is formatted, and again here on each string field.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from modelfleet.redaction import redact

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (``static`` fields on every line)."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self._static,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                line.setdefault(key, redact(value) if isinstance(value, str) else value)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, default=str, separators=(",", ":"))


def configure_logging(level: str, log_format: LogFormat, text_format: str = TEXT_FORMAT,
                      static: dict[str, Any] | None = None) -> None:
    """The root logger's one handler (stderr), in the chosen format; ``static`` fields
    go on every JSON line (a runtime names itself)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(static) if log_format == "json"
                         else logging.Formatter(text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
