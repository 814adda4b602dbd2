"""Payload bytes held by the gateway for runtimes to fetch, at signed, expiring URLs.

The store is bounded by total bytes; when full, new large requests get 503 (with
Retry-After) rather than pushing the gateway out of memory. An entry is freed when
its reply arrives, when its deadline passes, or when its caller hangs up.
URLs are signed with HMAC-SHA256 over (request id, expiry) with the fleet's shared
secret; an unsigned, tampered or expired fetch gets 403.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from modelfleet import metrics
from modelfleet.errors import NoCapacity


@dataclass(frozen=True)
class _Entry:
    data: bytes
    content_type: str
    expires_ms: int


class PayloadStore:
    def __init__(self, capacity_bytes: int, secret: str) -> None:
        self._capacity = capacity_bytes
        self._secret = secret.encode()
        self._entries: dict[str, _Entry] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, request_id: str, data: bytes, content_type: str, expires_ms: int) -> None:
        if self._used + len(data) > self._capacity:
            raise NoCapacity(
                f"the gateway holds {self._used} payload bytes of its {self._capacity} "
                f"limit; a {len(data)}-byte payload does not fit now", retry_after_s=1)
        self._entries[request_id] = _Entry(data, content_type, expires_ms)
        self._used += len(data)
        metrics.PAYLOAD_STORE_BYTES.set(self._used)

    def free(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._used -= len(entry.data)
            metrics.PAYLOAD_STORE_BYTES.set(self._used)

    def sign(self, request_id: str, expires_ms: int) -> str:
        message = f"{request_id}:{expires_ms}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def url_path(self, request_id: str, expires_ms: int) -> str:
        return (f"/v1/payloads/{request_id}?expires={expires_ms}"
                f"&sig={self.sign(request_id, expires_ms)}")

    def fetch(self, request_id: str, expires: str, signature: str) -> _Entry | None:
        """The entry if the signature is valid and unexpired; raises PermissionError if not."""
        try:
            expires_ms = int(expires)
        except ValueError:
            raise PermissionError("malformed expiry") from None
        if not hmac.compare_digest(self.sign(request_id, expires_ms), signature):
            raise PermissionError("bad signature")
        if expires_ms < int(time.time() * 1000):
            raise PermissionError("URL expired")
        return self._entries.get(request_id)
