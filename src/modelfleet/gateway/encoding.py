"""Request bodies sent compressed (``Content-Encoding: gzip`` or ``deflate``), inflated
under the same byte limit as an uncompressed body, so a small bomb is refused (413)
before it is inflated whole."""

from __future__ import annotations

import zlib

from modelfleet.errors import PayloadTooLarge, RequestRejected

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate: zlib-wrapped


def inflate(body: bytes, content_encoding: str, limit: int) -> bytes:
    """The body as sent before compression; ``body`` itself when not compressed."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise RequestRejected(f"Content-Encoding {encoding!r} is not supported: send the body "
                              f"as gzip, deflate or uncompressed")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise RequestRejected(f"the body is not valid {encoding} data: {exc}") from exc
    if len(data) > limit:
        raise PayloadTooLarge(f"the {encoding} body inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise RequestRejected(f"the {encoding} body is truncated")
    if inflater.unused_data:
        raise RequestRejected(f"{len(inflater.unused_data)} bytes follow the end of the "
                              f"{encoding} data")
    return data
