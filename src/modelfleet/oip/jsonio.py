"""JSON for v2 bodies: orjson where it is exact, Python's json where it is not.

orjson parses about 4x and writes numpy arrays about 15x faster than ``json`` (a
million FP32 values: 0.22 s against 0.83 s to read, 0.13 s against 2 s to write), but
it refuses ``NaN``/``Infinity`` tokens and numbers past a double, reads integers past
64 bits as floats, and writes non-finite floats as ``null``. So a document orjson
refuses is read again by ``json`` (which accepts those tokens, and gives the error
message), and a document with a non-finite float is written by ``json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson


def loads(raw: bytes | memoryview) -> Any:
    """Parse; raises ``ValueError`` (``UnicodeDecodeError`` included) or ``RecursionError``
    as ``json.loads`` does."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(bytes(raw))


def _as_list(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(doc: Any, arrays: Sequence[np.ndarray] = ()) -> bytes:
    """``doc`` as compact JSON; ``arrays`` are the numpy arrays it holds (written as lists)."""
    if all(a.dtype.kind != "f" or bool(np.isfinite(a).all()) for a in arrays):
        try:
            return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError:  # an array orjson does not take (non-native order)
            pass
    return json.dumps(doc, default=_as_list, separators=(",", ":"), allow_nan=True).encode()
