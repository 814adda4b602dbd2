"""Compressed request bodies at the gateway: inflated under the body limit, or refused."""

from __future__ import annotations

import gzip
import zlib

import pytest

from modelfleet.errors import PayloadTooLarge, RequestRejected
from modelfleet.gateway.encoding import inflate

BODY = b'{"inputs": []}' * 100


@pytest.mark.parametrize(("encoding", "packed"), [
    # mtime=0: the same bytes, so the same test ids, in every test process that collects
    ("gzip", gzip.compress(BODY, mtime=0)), ("deflate", zlib.compress(BODY)),
    ("GZip ", gzip.compress(BODY, mtime=0)),
    ("identity", BODY), ("", BODY),
])
def test_bodies_inflate(encoding: str, packed: bytes) -> None:
    assert inflate(packed, encoding, 10_000) == BODY


def test_a_bomb_is_refused_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * 50_000_000)  # 50 MB of zeros in about 50 KB
    assert len(bomb) < 100_000
    with pytest.raises(PayloadTooLarge, match="inflates past the limit of 1000000 bytes"):
        inflate(bomb, "gzip", 1_000_000)


def test_exactly_the_limit_is_fine() -> None:
    assert len(inflate(gzip.compress(b"x" * 1000), "gzip", 1000)) == 1000


@pytest.mark.parametrize(("packed", "encoding", "match"), [
    (b"not gzip at all", "gzip", "not valid gzip data"),
    (gzip.compress(BODY, mtime=0)[:-12], "gzip", "truncated"),
    (gzip.compress(BODY, mtime=0) + b"junk", "gzip", "4 bytes follow the end"),
    (gzip.compress(BODY, mtime=0), "deflate", "not valid deflate data"),
    (BODY, "br", "'br' is not supported"),
    (BODY, "gzip, deflate", "not supported"),
])
def test_bad_compressed_bodies(packed: bytes, encoding: str, match: str) -> None:
    with pytest.raises(RequestRejected, match=match):
        inflate(packed, encoding, 10_000)
