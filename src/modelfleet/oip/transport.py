"""How a v2 answer's framing travels back from the runtime to the gateway.

The runtime answers a v2 request with the encoded response as the reply body. A body
with binary outputs has the content type ``OIP_CONTENT_TYPE; header-length=N``; the
gateway answers it as ``application/octet-stream`` with ``Inference-Header-Content-Length:
N``. A JSON-only body is plain ``application/json``.
"""

from __future__ import annotations

from modelfleet.oip import OIP_CONTENT_TYPE


def response_content_type(header_length: int | None) -> str:
    if header_length is None:
        return "application/json"
    return f"{OIP_CONTENT_TYPE}; header-length={header_length}"


def header_length_of(content_type: str) -> int | None:
    """N of ``OIP_CONTENT_TYPE; header-length=N``; None for any other content type."""
    kind, _, rest = content_type.partition(";")
    if kind.strip() != OIP_CONTENT_TYPE:
        return None
    name, _, value = rest.strip().partition("=")
    if name != "header-length" or not value.isdigit():
        return None
    return int(value)
