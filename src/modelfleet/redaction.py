"""No secret in the logs, at any level: signed URLs, passwords in URLs, keys.

A signed payload URL is a bearer credential while its request is in flight: whoever reads
it can fetch the payload. ``secure_logging`` (once per process, after logging is
configured) does two things:

- holds the loggers of libraries that log what they send at WARNING or INFO, whatever
  level was asked for: httpx logs every request's full URL at INFO, httpcore traces each
  connection at DEBUG, aiormq and aio-pika dump whole AMQP frames (tasks, with their
  payload URLs and inline payloads) at DEBUG;
- adds a ``RedactingFilter`` to every root handler: in each record's text (message,
  traceback, stack), the query of every URL, the password of every URL, ``key=value``
  pairs whose key names a secret, the secret part of API keys (``mfk_<id>_***``), and
  each literal secret given become ``***``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import quote

# Libraries that log what they send, and the level each is held at.
QUIET_LOGGERS = {"httpx": logging.WARNING, "httpcore": logging.WARNING,
                 "aiormq": logging.INFO, "aio_pika": logging.INFO}

_STOP = r"\s'\"\\<>"  # a URL in a message, or in the repr of bytes, ends at one of these
_URL_QUERY = re.compile(rf"((?:https?|wss?)://[^{_STOP}?#]+)\?[^{_STOP}#]*")
_URL_PASSWORD = re.compile(rf"([a-zA-Z][a-zA-Z0-9+.-]*://[^{_STOP}/?#@:]*):[^{_STOP}/?#@]+@")
_SECRET_PAIR = re.compile(
    rf"\b(sig|signature|token|access_token|password|passwd|secret|api[_-]?key|"
    rf"x-amz-signature|x-amz-credential|x-goog-signature|x-goog-credential)=[^{_STOP}&,;]+",
    re.IGNORECASE)
# An API key (modelfleet.tenancy.keys): its id may show, its secret never.
_API_KEY = re.compile(r"\b(mfk_[0-9a-f]{12})_[A-Za-z0-9_-]{8,}")
_FORMATTER = logging.Formatter()


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every secret it shows replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(r"\1:***@", text)
    text = _URL_QUERY.sub(r"\1?***", text)
    text = _API_KEY.sub(r"\1_***", text)
    return _SECRET_PAIR.sub(r"\1=***", text)


def redact_url(url: str) -> str:
    """A URL fit for a message or a log line: its password and its query as ``***``
    (``amqp://guest:***@host/``, ``postgresql://me:***@db/x``); the user and host stay, so
    that the reader knows which server is meant. The one function that does it."""
    url = _URL_PASSWORD.sub(r"\1:***@", url)
    base, query, _ = url.partition("?")
    return f"{base}?***" if query and "://" in base else url


class RedactingFilter(logging.Filter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        # Also as they appear inside a URL (percent-encoded); short ones would hide words.
        known = {s for s in secrets if len(s) >= 4}
        self._secrets = sorted(known | {quote(s, safe="") for s in known}, key=len,
                               reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging reports it itself
            return True
        clean = redact(message, self._secrets)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = _FORMATTER.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self._secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self._secrets)
        return True


def secure_logging(secrets: Iterable[str] = ()) -> None:
    """Quiet the chatty libraries and redact every root handler's records (idempotent)."""
    for name, level in QUIET_LOGGERS.items():
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), level))
    redacting = RedactingFilter(secrets)
    for handler in logging.getLogger().handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, RedactingFilter)]
        handler.addFilter(redacting)
