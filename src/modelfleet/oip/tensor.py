"""One tensor's data, both ways: JSON ``data`` or binary bytes <-> a numpy array (pure).

``decode_tensor`` reads an input as its header describes it (element types, counts,
ranges and binary sizes checked: ``RequestRejected`` naming the tensor for each
mismatch); ``as_output_array`` casts what a handler returned to an output's datatype;
``binary_of`` and ``json_data`` write an array in the two forms.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelfleet.errors import RequestRejected
from modelfleet.oip.datatypes import NUMPY_DTYPES

_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix in binary form
_INT_RANGES: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dtype.str).min), int(np.iinfo(dtype.str).max))
    for name, dtype in NUMPY_DTYPES.items() if dtype.kind in "iu"
}


@dataclass(frozen=True)
class TensorHeader:
    """One input of a request as its JSON header describes it (data not converted)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    parameters: Mapping[str, Any] = field(default_factory=dict)
    data: Any = None               # the JSON ``data``; None for a binary tensor
    binary_size: int | None = None  # bytes of this tensor in the binary part

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)


def decode_tensor(tensor: TensorHeader, binary: memoryview | None = None) -> np.ndarray:
    """The tensor as a numpy array of its shape (``BYTES``: an object array of bytes)."""
    if tensor.binary_size is not None:
        if binary is None:
            raise RequestRejected(f"input '{tensor.name}': its binary data is missing")
        return _from_binary(tensor, binary)
    return _from_json(tensor)


def _from_binary(tensor: TensorHeader, chunk: memoryview) -> np.ndarray:
    count = tensor.element_count
    where = f"input '{tensor.name}'"
    if tensor.datatype == "BYTES":
        return _bytes_elements(chunk, count, where).reshape(tensor.shape)
    dtype = NUMPY_DTYPES[tensor.datatype]
    expected = count * dtype.itemsize
    if len(chunk) != expected:
        raise RequestRejected(
            f"{where}: shape {list(tensor.shape)} of {tensor.datatype} takes {expected} bytes, "
            f"binary_data_size is {len(chunk)}")
    if tensor.datatype == "BOOL":
        raw = np.frombuffer(chunk, dtype=np.uint8)
        if raw.size and int(raw.max()) > 1:
            raise RequestRejected(f"{where}: a BOOL element is a byte 0 or 1")
    # A copy: the handler gets a writable array that does not pin the request body.
    return np.frombuffer(chunk, dtype=dtype).reshape(tensor.shape).copy()


def _bytes_elements(chunk: memoryview, count: int, where: str) -> np.ndarray:
    if count * _LENGTH.size > len(chunk):  # checked before allocating ``count`` elements
        raise RequestRejected(
            f"{where}: {count} BYTES elements need at least {count * _LENGTH.size} bytes "
            f"(a 4-byte length each); binary_data_size is {len(chunk)}")
    out = np.empty(count, dtype=object)
    at = 0
    for index in range(count):
        if at + 4 > len(chunk):
            raise RequestRejected(
                f"{where}: BYTES element {index} of {count} has no 4-byte length prefix "
                f"(the binary data ends at byte {len(chunk)})")
        (length,) = _LENGTH.unpack_from(chunk, at)
        at += 4
        if at + length > len(chunk):
            raise RequestRejected(
                f"{where}: BYTES element {index} says it has {length} bytes but only "
                f"{len(chunk) - at} remain")
        out[index] = bytes(chunk[at:at + length])
        at += length
    if at != len(chunk):
        raise RequestRejected(f"{where}: {len(chunk) - at} bytes remain after its {count} "
                              f"BYTES elements (the shape says {count})")
    return out


def _flatten(data: Any, shape: tuple[int, ...], where: str) -> list[Any]:
    """Row-major elements of ``data``: flat, or nested exactly as ``shape``."""
    if not isinstance(data, list):
        raise RequestRejected(f"{where}: 'data' must be a list")
    if not data or not isinstance(data[0], list):
        return data  # flat (a list further in is caught by the element type check)
    flat: list[Any] = []

    def walk(value: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(value, list):
                raise RequestRejected(f"{where}: 'data' is nested deeper than its shape "
                                      f"{list(shape)}")
            flat.append(value)
            return
        if not isinstance(value, list) or len(value) != shape[depth]:
            raise RequestRejected(
                f"{where}: nested 'data' does not match shape {list(shape)} at depth {depth}")
        for item in value:
            walk(item, depth + 1)

    walk(data, 0)
    return flat


_JSON_TYPES: dict[str, tuple[type, ...]] = {"BOOL": (bool,), "BYTES": (str,)}
_JSON_KIND = {"BOOL": "true or false", "BYTES": "strings"}


def _check_elements(flat: list[Any], datatype: str, where: str) -> None:
    """Every element's JSON type fits the datatype (and integers its range).

    Checked by the set of the elements' types and by ``min``/``max`` (loops in C): a
    per-element Python loop cost a second per million values.
    """
    integer = datatype in _INT_RANGES
    allowed = _JSON_TYPES.get(datatype, (int,) if integer else (int, float))
    if not set(map(type, flat)) <= set(allowed):
        index, bad = next((i, v) for i, v in enumerate(flat) if type(v) not in allowed)
        if integer and isinstance(bad, float) and bad.is_integer() and abs(bad) >= 2**63:
            # A JSON parser may read an integer past 64 bits as a float.
            raise RequestRejected(f"{where}: element {index} ({bad:g}) is out of the range "
                                  f"of {datatype}")
        kind = _JSON_KIND.get(datatype, "integers" if integer else "numbers")
        raise RequestRejected(f"{where}: {datatype} elements in JSON are {kind}, element "
                              f"{index} is {str(bad)[:50]!r} ({type(bad).__name__})")
    if integer and flat:
        low, high = _INT_RANGES[datatype]
        for value in (min(flat), max(flat)):
            if not low <= value <= high:
                raise RequestRejected(f"{where}: {value} is out of the range of {datatype}")


def _from_json(tensor: TensorHeader) -> np.ndarray:
    where = f"input '{tensor.name}'"
    flat = _flatten(tensor.data, tensor.shape, where)
    count = tensor.element_count
    if len(flat) != count:
        raise RequestRejected(f"{where}: shape {list(tensor.shape)} has {count} elements, "
                              f"'data' has {len(flat)}")
    datatype = tensor.datatype
    _check_elements(flat, datatype, where)
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        try:
            out[:] = [value.encode("utf-8") for value in flat]
        except UnicodeEncodeError as exc:  # JSON may spell a lone surrogate: "\ud800"
            raise RequestRejected(f"{where}: a BYTES element is not valid Unicode text: "
                                  f"{exc.reason}") from exc
        return out.reshape(tensor.shape)
    target = NUMPY_DTYPES[datatype]
    if target.kind != "f":
        return np.asarray(flat, dtype=target).reshape(tensor.shape)
    try:
        wide = np.asarray(flat, dtype=np.float64)
    except OverflowError:  # an integer literal past any float: 1e400 written out
        raise RequestRejected(f"{where}: a number is out of the range of {datatype}") from None
    too_big = np.isfinite(wide) & (np.abs(wide) > float(np.finfo(target.str).max))
    if too_big.any():
        raise RequestRejected(f"{where}: {wide[too_big][0]:g} is out of the range of "
                              f"{datatype}")
    return wide.astype(target).reshape(tensor.shape)


def as_output_array(value: Any, datatype: str, name: str) -> np.ndarray:
    """What a handler returned for one output, as an array of ``datatype``.

    Casts within a kind (float64 to FP32, int64 to INT32, bool to INT8...), never
    across one that loses meaning (a float to an integer type): that is ``TypeError``.
    """
    if datatype == "BYTES":
        array = np.asarray(value, dtype=object)
        flat = array.reshape(-1)
        for index, item in enumerate(flat):
            if isinstance(item, str):
                flat[index] = item.encode("utf-8")
            elif isinstance(item, np.bytes_ | bytes):
                flat[index] = bytes(item)
            else:
                raise TypeError(f"output '{name}' is BYTES but element {index} is "
                                f"{type(item).__name__}")
        return flat.reshape(array.shape)
    array = np.asarray(value)
    if array.dtype.kind in "OSU":
        raise TypeError(f"output '{name}' is {datatype} but holds {array.dtype} values")
    target = NUMPY_DTYPES[datatype]
    if array.size and not np.can_cast(array.dtype, target, casting="same_kind"):
        raise TypeError(f"output '{name}' is declared {datatype}; the handler returned "
                        f"{array.dtype} values, which do not cast to it without loss of kind")
    return array.astype(target, copy=False)


def binary_of(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(_LENGTH.pack(len(item)) + item for item in array.reshape(-1))
    return np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype]).tobytes()


def json_data(array: np.ndarray, datatype: str, name: str) -> np.ndarray | list[str]:
    """The array's elements, flat: a numpy array to write as a JSON list of numbers
    (``jsonio.dumps``), or the ``BYTES`` elements as strings."""
    if datatype != "BYTES":
        return np.ascontiguousarray(array.reshape(-1), dtype=NUMPY_DTYPES[datatype])
    out = []
    for item in array.reshape(-1):
        try:
            out.append(item.decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestRejected(
                f"output '{name}' holds bytes that are not UTF-8 text, which JSON cannot "
                f"carry: ask for it in binary (parameters.binary_data = true)") from None
    return out
