"""The gateway's own parts: payload store, parked requests, URL bodies, deadlines."""

from __future__ import annotations

import time

import pytest

from modelfleet.errors import NoCapacity
from modelfleet.gateway.parking import ParkedRequests
from modelfleet.gateway.payloads import PayloadStore
from modelfleet.gateway.service import url_payload
from modelfleet.messages import Reply


def test_payload_store_is_bounded_and_frees() -> None:
    store = PayloadStore(100, "secret")
    far = int(time.time() * 1000) + 60_000
    store.put("a", b"x" * 60, "image/png", far)
    with pytest.raises(NoCapacity) as full:
        store.put("b", b"y" * 60, "image/png", far)
    assert full.value.retry_after_s == 1
    store.free("a")
    store.put("b", b"y" * 60, "image/png", far)
    assert store.used_bytes == 60


def test_payload_urls_are_signed_and_expire() -> None:
    store = PayloadStore(100, "secret")
    far = int(time.time() * 1000) + 60_000
    store.put("a", b"data", "image/png", far)
    entry = store.fetch("a", str(far), store.sign("a", far))
    assert entry is not None and entry.data == b"data"
    with pytest.raises(PermissionError, match="signature"):
        store.fetch("a", str(far), PayloadStore(100, "other").sign("a", far))
    with pytest.raises(PermissionError, match="signature"):
        store.fetch("a", str(far + 1), store.sign("a", far))  # expiry tampered with
    past = int(time.time() * 1000) - 1
    with pytest.raises(PermissionError, match="expired"):
        store.fetch("a", str(past), store.sign("a", past))
    with pytest.raises(PermissionError, match="malformed"):
        store.fetch("a", "soon", "00")
    assert store.fetch("gone", str(far), store.sign("gone", far)) is None


async def test_late_and_duplicate_replies_are_dropped() -> None:
    parked = ParkedRequests()
    waiting = parked.park("r1", "iris")
    assert parked.waiting_models() == ["iris"]
    assert parked.deliver(Reply("r1", "ok")) is True
    assert parked.deliver(Reply("r1", "ok")) is False  # duplicate after a redelivery
    assert (await waiting).request_id == "r1"
    parked.unpark("r1")
    assert parked.deliver(Reply("r1", "ok")) is False  # after the request left
    assert parked.waiting_models() == [] and len(parked) == 0


@pytest.mark.parametrize(("body", "ctype", "expected"), [
    (b'{"url": "https://example.com/a.png"}', "application/json", "https://example.com/a.png"),
    (b'{"url": "ftp://example.com/a.png"}', "application/json", None),
    (b'{"url": "https://x", "more": 1}', "application/json", None),
    (b'{"url": "https://x"}', "text/plain", None),
    (b'{"features": [1, 2]}', "application/json", None),
    (b"not json", "application/json", None),
    (b"[" * 4000 + b"]" * 4000, "application/json", None),
    # The key spelled with a JSON escape is still "url".
    (b'{"\\u0075rl": "https://example.com/a.png"}', "application/json",
     "https://example.com/a.png"),
])
def test_url_bodies(body: bytes, ctype: str, expected: str | None) -> None:
    assert url_payload(body, ctype) == expected


def test_malformed_payload_urls_are_rejected() -> None:
    from modelfleet.errors import RequestRejected

    for body in (b'{"url": "http://x:99999/"}', b'{"url": "http://[::1/"}', b'{"url": "http://"}'):
        with pytest.raises(RequestRejected):
            url_payload(body, "application/json")


def test_public_url() -> None:
    from modelfleet.errors import ConfigError
    from modelfleet.gateway.service import public_url
    from modelfleet.settings import GatewaySettings, Settings

    def settings(**gw: object) -> Settings:
        return Settings(gateway=GatewaySettings(**gw))  # type: ignore[arg-type]

    assert public_url(settings(host="127.0.0.1", port=0), bound_port=4321) == \
        "http://127.0.0.1:4321"
    assert public_url(settings(host="::1", port=80)) == "http://[::1]:80"
    assert public_url(settings(host="0.0.0.0", port=80), runtimes_local=True) == \
        "http://127.0.0.1:80"
    assert public_url(settings(host="0.0.0.0", public_url="http://gw-3:8000/")) == \
        "http://gw-3:8000"
    with pytest.raises(ConfigError, match="public_url"):
        public_url(settings(host="0.0.0.0", port=80))
