"""API keys: ``mfk_<key id>_<secret>``, shown once when made, kept only as a digest.

The key id (12 hex digits) is not secret: it names the key in ``modelfleet keys list``
and is how the store finds its row. The secret is 256 random bits; the store keeps a
per-key random salt and HMAC-SHA256(salt, secret). A slow password hash (scrypt)
buys nothing against guessing 256 random bits and would cost every request (or a
cache of plain keys in memory); a keyed digest with a per-key salt means a copy of
the table neither reveals a key nor lets one precomputed table attack them all.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Literal, get_args

from modelfleet.tenancy import Unauthenticated

Role = Literal["caller", "operator", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
RANK: dict[str, int] = {role: rank for rank, role in enumerate(ROLES)}
PREFIX = "mfk_"
_FORM = re.compile(r"mfk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
# What a key looks like anywhere in text (for log redaction).
PATTERN = re.compile(r"mfk_[0-9a-f]{12}_[A-Za-z0-9_-]{8,}")


@dataclass(frozen=True)
class NewKey:
    """A key just made: ``token`` goes to its owner once; the rest is stored."""

    key_id: str
    token: str
    salt: bytes
    digest: bytes


def generate() -> NewKey:
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)  # 43 characters
    salt = secrets.token_bytes(16)
    return NewKey(key_id, f"{PREFIX}{key_id}_{secret}", salt, digest(salt, secret))


def parse(token: str) -> tuple[str, str]:
    """``(key id, secret)`` of a well-formed key; Unauthenticated otherwise."""
    match = _FORM.fullmatch(token.strip())
    if match is None:
        raise Unauthenticated("the API key is malformed (expected mfk_<12 hex>_<43 chars>, "
                              "as printed by 'modelfleet keys create')")
    return match.group(1), match.group(2)


def digest(salt: bytes, secret: str) -> bytes:
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


def matches(salt: bytes, stored: bytes, secret: str) -> bool:
    """Does ``secret`` hash to ``stored``? (constant time)"""
    return hmac.compare_digest(digest(salt, secret), stored)


def prefix_of(key_id: str) -> str:
    """How a key is shown after it was made: its id, never its secret."""
    return f"{PREFIX}{key_id}_…"
