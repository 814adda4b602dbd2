"""What a reply looks like on the wire to RabbitMQ: compressed when large.

Compression belongs to the hop that crosses a network: a reply's bytes are encoded
once by the runtime and passed on as they are; only here, on their way through
RabbitMQ, are those above ``broker.compress_threshold_bytes`` compressed (zstd,
marked by the message's ``content_encoding``), and the inbox gives them back as they
were. The embedded broker, in one process, never compresses.
"""

from __future__ import annotations

import zstandard

from modelfleet.errors import BrokerError

ZSTD = "zstd"
_compressor = zstandard.ZstdCompressor(level=3)
_decompressor = zstandard.ZstdDecompressor()


def pack(data: bytes, threshold_bytes: int) -> tuple[bytes, str | None]:
    """The body to publish and its content encoding (None: as is)."""
    if len(data) <= threshold_bytes:
        return data, None
    return _compressor.compress(data), ZSTD


def unpack(body: bytes, content_encoding: str | None) -> bytes:
    if not content_encoding:
        return body
    if content_encoding != ZSTD:
        raise BrokerError(f"a reply came with content encoding {content_encoding!r}; "
                          f"only {ZSTD!r} is known")
    return _decompressor.decompress(body)
