"""Paging the catalog listings (``GET /v1/models``, ``POST /v2/repository/index``).

A page is at most ``limit`` models in id order (``DEFAULT_LIMIT`` when the caller
names none, at most ``MAX_LIMIT``); the answer names the cursor of the next page, or
null after the last. A cursor is opaque to callers: it encodes the last model id of
the page it came with, so paging stays correct while models come and go (a model
added behind the cursor is not seen on this pass; none is seen twice). A cursor that
this gateway did not make is refused with a 400 ``bad_request`` that says so.
"""

from __future__ import annotations

import base64
import binascii

from modelfleet.errors import RequestRejected

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_PREFIX = "after:"


def page_limit(value: object, default: int = DEFAULT_LIMIT) -> int:
    """The ``limit`` a caller asked for (a query string or a JSON number), checked."""
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise RequestRejected(f"'limit' must be a whole number from 1 to {MAX_LIMIT}, "
                              f"got {value!r}")
    return value


def encode_cursor(after: str | None) -> str | None:
    if after is None:
        return None
    return base64.urlsafe_b64encode((_PREFIX + after).encode()).decode().rstrip("=")


def decode_cursor(cursor: object) -> str | None:
    """The model id a cursor continues after; None for no cursor."""
    if cursor is None or cursor == "":
        return None
    if isinstance(cursor, str):
        try:
            text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        except (binascii.Error, ValueError):
            text = ""
        if text.startswith(_PREFIX) and len(text) > len(_PREFIX):
            return text[len(_PREFIX):]
    raise RequestRejected(f"'cursor' {cursor!r} is not one this API gave: pass the "
                          "'next_cursor' of the previous page, or none to start over")
