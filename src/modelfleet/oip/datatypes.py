"""The tensor datatypes of the Open Inference Protocol v2, and their numpy forms.

Every datatype but ``BYTES`` has a fixed element size and a little-endian numpy dtype
(the binary tensor extension sends raw little-endian bytes, row-major). ``BYTES``
elements are byte strings of any length: numpy ``object`` arrays of ``bytes`` here; in
binary form each element is a 4-byte little-endian length followed by its bytes.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from modelfleet.oip import DATATYPES, Datatype

__all__ = ["DATATYPES", "NUMPY_DTYPES", "Datatype", "datatype_of", "element_size"]

# Fixed-size datatypes: the numpy dtype their binary form is read as (little-endian).
NUMPY_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

_BY_KIND: Final[dict[tuple[str, int], str]] = {
    (dtype.kind, dtype.itemsize): name for name, dtype in NUMPY_DTYPES.items()
}


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype of a numpy array (``BYTES`` for bytes, str and object arrays).

    Raises ``TypeError`` for an array no v2 datatype holds (complex, datetime, ...).
    """
    kind = array.dtype.kind
    if kind in "OSU":
        return "BYTES"
    name = _BY_KIND.get((kind, array.dtype.itemsize))
    if name is None:
        raise TypeError(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype")
    return name


def element_size(datatype: str) -> int | None:
    """Bytes per element in binary form; None for ``BYTES`` (variable)."""
    dtype = NUMPY_DTYPES.get(datatype)
    return None if dtype is None else dtype.itemsize
