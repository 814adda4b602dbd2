"""Why did a task die, and would it die again? A pure function of the death and the task.

A dead letter's *reason* is either RabbitMQ's own (``delivery_limit``, ``expired``,
``maxlen``, ``rejected``) or one a worker wrote as ``<error code>: <message>`` (the
coordinator writes ``runtime_crashed: <what the runtime did>``). From it we derive:

- a **failure signature**: the reason with everything that differs between two
  occurrences of the same failure taken out (request ids, numbers, addresses, URLs,
  paths), so that a thousand dead letters from one bug group into one line;
- a **class**: ``transient`` (the input had nothing to do with it; a controlled
  replay may succeed) or ``deterministic`` (it would fail the same way again; it
  becomes a bug report and is never replayed automatically);
- the **rule** that decided, so that ``modelfleet dlq list`` can say why.

The rules are tried in order (``RULES``); each says why it exists. Anything no
rule recognises is deterministic: replaying what we do not understand is how one
poison input becomes a rolling outage, and a person can still force it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from modelfleet.messages import Task

FailureClass = Literal["transient", "deterministic"]
FAILURE_CLASSES: tuple[FailureClass, ...] = ("transient", "deterministic")

SIGNATURE_MAX_CHARS = 240


@dataclass(frozen=True)
class Classification:
    failure_class: FailureClass
    rule: str  # the name of the rule that decided
    signature: str


@dataclass(frozen=True)
class Rule:
    """Matches a reason whose code is in ``codes`` (any code when empty) and whose
    detail matches ``detail`` (any detail when None)."""

    name: str
    failure_class: FailureClass
    why: str
    codes: frozenset[str] = frozenset()
    detail: re.Pattern[str] | None = None

    def matches(self, code: str, detail: str) -> bool:
        if self.codes and code not in self.codes:
            return False
        return self.detail is None or self.detail.search(detail) is not None


def _codes(*codes: str) -> frozenset[str]:
    return frozenset(codes)


# Rule applied before the table: the task was replayed and died *again*.
DIED_AFTER_REPLAY = Rule(
    "died-after-replay", "deterministic",
    "It was replayed once and died again: whatever kills it travels with it. This is also "
    "what catches a poison input that takes a whole worker down (RabbitMQ reports that "
    "as delivery_limit, indistinguishable at first from a deploy).")

RULES: tuple[Rule, ...] = (
    Rule("consumer-died", "transient",
         "RabbitMQ dead-lettered it because its consumers kept going away without settling "
         "it: workers evicted, restarted, deployed, or their connection dropped. A runtime "
         "that crashes on the input is reported by the coordinator as runtime_crashed "
         "instead, so this reason alone does not point at the input.",
         _codes("delivery_limit")),
    Rule("no-capacity", "transient",
         "It waited too long (message TTL) or its queue overflowed (max length): a capacity "
         "problem, not an input problem.",
         _codes("expired", "maxlen")),
    Rule("runtime-not-ready", "transient",
         "The runtime was down or restarting when the task arrived: the input never reached "
         "it, so the crash was someone else's.",
         _codes("runtime_crashed"), re.compile(r"\bis not ready\b")),
    Rule("runtime-lifecycle", "transient",
         "The runtime failed to start, or its coordinator shut it down (a drain, a deploy): "
         "both happen before or regardless of the input.",
         _codes("runtime_crashed"),
         re.compile(r"did not start within|during start-up|closed by coordinator")),
    Rule("crash-never-alone", "transient",
         "It was in flight on several runtimes that crashed but never alone on one: the "
         "evidence points at its neighbours, not at it.",
         _codes("runtime_crashed"), re.compile(r"\bnever alone\b")),
    Rule("poison-input", "deterministic",
         "A runtime died or hung on this very input, with no other task on it, more times "
         "than the delivery limit (or on the quarantine runtime, where every task runs "
         "alone). Crashes it shared with other tasks were not counted (it "
         "was retried alone), so this is evidence, not bad luck. Replaying it crashes "
         "another one.",
         _codes("runtime_crashed")),
    Rule("rejected", "deterministic",
         "A consumer refused it outright (it could not even be decoded).",
         _codes("rejected")),
    Rule("bad-input", "deterministic",
         "The request itself is wrong (invalid, too large, unsupported type, forbidden URL): "
         "the same bytes get the same answer.",
         _codes("bad_request", "invalid_input", "payload_too_large", "unsupported_content_type",
                "payload_fetch_forbidden")),
    Rule("model-broken", "deterministic",
         "The model failed: its handler raised, its artifact does not load or does not fit, "
         "or it does not exist. Until the model is fixed a replay fails the same way.",
         _codes("model_error", "model_load_failed", "model_too_large", "invalid_manifest",
                "config_error", "model_not_found")),
    Rule("payload-gone", "deterministic",
         "The payload's URL answered 403/404/410: it expired or was freed, and a replay "
         "cannot fetch it either.",
         _codes("payload_unavailable"), re.compile(r"\bHTTP (403|404|410)\b")),
    Rule("dependency", "transient",
         "A dependency timed out or was unreachable (payload host, broker, capacity, "
         "deadline): it may well be back.",
         _codes("payload_unavailable", "deadline_exceeded", "no_capacity", "broker_error",
                "broker_unavailable", "client_disconnected")),
    Rule("connection-or-timeout", "transient",
         "Whatever the code, the message says a connection was reset or refused, or "
         "something timed out: the usual marks of a passing outage.",
         detail=re.compile(r"time[d ]?\s?out|timeout|connection (reset|refused|lost|closed)|"
                           r"broken pipe|econnreset|temporarily unavailable", re.IGNORECASE)),
)

UNRECOGNISED = Rule(
    "unrecognised", "deterministic",
    "No rule knows this reason. Replaying what we do not understand risks turning one bad "
    "input into a fleet outage; inspect it and replay it by hand with --force.")

_CODE = re.compile(r"^([a-z][a-z0-9_]*)\s*(?::\s*(.*))?$", re.DOTALL)


def split_reason(reason: str) -> tuple[str, str]:
    """``'runtime_crashed: runtime x is gone'`` -> ``('runtime_crashed', 'runtime x is gone')``.

    A reason that does not start with a code gives ``('', reason)``.
    """
    found = _CODE.match(reason.strip())
    if found is None:
        return "", reason.strip()
    return found.group(1), (found.group(2) or "").strip()


def classify(reason: str, task: Task, replayed_before: bool = False) -> Classification:
    """Class, deciding rule and signature of a task that died for ``reason``.

    ``replayed_before``: the archive already holds this request and it was replayed since.
    """
    code, detail = split_reason(reason)
    signature = failure_signature(reason, task)
    if replayed_before:
        return Classification(DIED_AFTER_REPLAY.failure_class, DIED_AFTER_REPLAY.name, signature)
    for rule in RULES:
        if rule.matches(code, detail):
            return Classification(rule.failure_class, rule.name, signature)
    return Classification(UNRECOGNISED.failure_class, UNRECOGNISED.name, signature)


# Order matters: whole URLs before the paths and hosts inside them, ids before numbers.
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    # How a crashed runtime's socket went (closed mid-frame, reset, broken pipe) is the
    # operating system's timing, not the cause: one poison input is one signature.
    (re.compile(r"\bconnection (?:closed|lost|reset)\b.*$", re.IGNORECASE | re.DOTALL),
     "connection lost"),
    (re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>()]+", re.IGNORECASE), "<url>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
                re.IGNORECASE), "<id>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.IGNORECASE), "<addr>"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "<ip>"),
    (re.compile(r"\[[0-9a-f:]*:[0-9a-f:]*\](?::\d+)?", re.IGNORECASE), "<ip>"),
    # Paths: /a/b, ~/a, ./a, C:\a. A lone '/' word (e.g. 'and/or') is left alone.
    (re.compile(r"(?:^|(?<=[\s'\"(=:,]))(?:~|\.{1,2})?/[^\s'\"():,]+"), "<path>"),
    (re.compile(r"\b[a-z]:\\[^\s'\"():,]+", re.IGNORECASE), "<path>"),
    # Long hex or mixed tokens (request ids, hashes, container ids) with at least one digit.
    (re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{12,}\b", re.IGNORECASE), "<id>"),
    (re.compile(r"\b(?=[a-z0-9]*\d)(?=[a-z0-9]*[a-z])[a-z0-9]{20,}\b", re.IGNORECASE), "<id>"),
    (re.compile(r"\b\d+(?:\.\d+)?"), "<n>"),  # no trailing \b: 1.5s, 50ms
    (re.compile(r"\s+"), " "),
)


def failure_signature(reason: str, task: Task) -> str:
    """``reason`` with what varies between occurrences of one failure replaced by tokens.

    The task's own request id and payload URL are removed literally first (they may not
    look like ids), then URLs, UUIDs, hex addresses, IPs, paths, long ids and numbers.
    """
    text = reason.strip() or "(no reason given)"
    for literal, token in ((task.payload.url, "<url>"), (task.request_id, "<request-id>")):
        if len(literal) >= 4:
            text = text.replace(literal, token)
    for pattern, token in _NORMALISE:
        text = pattern.sub(token, text)
    text = text.strip()
    if len(text) > SIGNATURE_MAX_CHARS:
        text = text[: SIGNATURE_MAX_CHARS - 1] + "…"
    return text
