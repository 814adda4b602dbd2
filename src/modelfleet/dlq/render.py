"""How ``modelfleet dlq`` prints records, groups and outcomes: tables for people, JSON lines
for scripts. Nothing here talks to a broker or a database."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from modelfleet.dlq.records import DeadLetterRecord, SignatureCount
from modelfleet.dlq.replay import ReplayOutcome

SIGNATURE_COLUMN_CHARS = 70


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in [headers, *rows]]
    return "\n".join(lines)


def record_json(record: DeadLetterRecord) -> dict[str, Any]:
    """Every field but the raw bytes (the task, the inline payload): their sizes instead."""
    data = asdict(record)
    data.pop("task_bytes")
    data["payload_inline_bytes"] = len(data.pop("payload_inline"))
    return data


def records_table(records: list[DeadLetterRecord]) -> str:
    return table(
        ["REQUEST_ID", "MODEL", "CLASS", "RULE", "DELIVERIES", "FIRST_SEEN", "REPLAYS",
         "SIGNATURE"],
        [[r.request_id, f"{r.model_id}@{r.version}", r.failure_class, r.rule,
          str(r.delivery_count), when(r.first_seen_ms), str(r.replay_count),
          _clip(r.signature, SIGNATURE_COLUMN_CHARS)] for r in records])


def counts_table(counts: list[SignatureCount]) -> str:
    return table(
        ["COUNT", "CLASS", "RULE", "MODEL", "LAST_SEEN", "SIGNATURE"],
        [[str(c.count), c.failure_class, c.rule, c.model_id, when(c.last_seen_ms),
          _clip(c.signature, SIGNATURE_COLUMN_CHARS)] for c in counts])


def json_line(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, ensure_ascii=False)


def outcome_line(outcome: ReplayOutcome) -> str:
    if outcome.status == "ok":
        return (f"ok        {outcome.request_id}  {outcome.model_id}  "
                f"{outcome.elapsed_ms} ms  worker {outcome.worker_id or '?'}")
    if outcome.status == "error":
        return (f"error     {outcome.request_id}  {outcome.model_id}  {outcome.error_code}: "
                f"{_clip(outcome.error_message, 200)}")
    if outcome.status == "sent":
        return f"sent      {outcome.request_id}  {outcome.model_id}  (not waiting for a reply)"
    return f"no reply  {outcome.request_id}  {outcome.model_id}  (deadline passed)"
