"""Array artifacts mapped into memory instead of copied: ``.npy`` and safetensors files.

A mapped array's bytes are the file's pages in the OS page cache: a load reads no
byte until the model touches it, costs no anonymous (private, unswappable) memory,
and several runtimes that map the same artifact share one copy of its pages. When
the model is evicted and its arrays are garbage collected, the mapping goes with
them and the pages leave the process.

- ``map_npy``: one ``.npy`` array, ``np.load(mmap_mode="r")``;
- ``map_safetensors``: every tensor of a safetensors file, read-only numpy arrays
  over one ``mmap`` of it (the format is an 8-byte little-endian header length, a
  JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw bytes, so a
  tensor is a slice of the file). ``safetensors.numpy.load_file`` copies every
  tensor; this does not.

Arrays are read-only: a write raises ``ValueError`` instead of changing the artifact
(copy one first to change it: ``array.copy()``). The file must stay where it is and
must not be rewritten in place while mapped; replacing it with ``os.replace`` (as the
repository's disk cache does) or deleting it is safe on Linux: the mapping keeps the
old file's pages until it is closed.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from modelfleet.errors import ModelLoadFailed

_HEADER_LIMIT = 100 * 1024 * 1024  # the reference implementation's own bound

_DTYPES: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


def map_npy(path: Path) -> np.ndarray:
    """The array in a ``.npy`` file, mapped read-only (a ``np.memmap``)."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as exc:
        raise ModelLoadFailed(f"artifact {path} does not exist") from exc
    except (ValueError, OSError, EOFError) as exc:
        raise ModelLoadFailed(f"artifact {path} is not a readable .npy array: {exc}") from exc
    if not isinstance(array, np.memmap):
        # An .npz archive: np.load ignores mmap_mode and reads every member whole.
        if hasattr(array, "close"):
            array.close()
        raise ModelLoadFailed(
            f"artifact {path} is an .npz archive, which cannot be mapped (numpy reads "
            "it whole); save each array with np.save, or all of them as one safetensors "
            "file, and map that")
    return array


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file by name, as read-only arrays over one mapping."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ModelLoadFailed(f"artifact {path} is not a safetensors file: "
                                      f"{size} bytes, shorter than its header length")
            view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError as exc:
        raise ModelLoadFailed(f"artifact {path} does not exist") from exc
    except OSError as exc:
        raise ModelLoadFailed(f"artifact {path} cannot be mapped: {exc}") from exc
    try:
        return _tensors(path, view, size)
    except BaseException:
        view.close()
        raise


def _tensors(path: Path, view: mmap.mmap, size: int) -> dict[str, np.ndarray]:
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > min(_HEADER_LIMIT, size - 8):
        raise ModelLoadFailed(f"artifact {path} is not a safetensors file: its header claims "
                              f"{header_len} bytes of a {size}-byte file")
    try:
        header: Any = json.loads(view[8:8 + header_len])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadFailed(f"artifact {path} is not a safetensors file: "
                              f"its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadFailed(f"artifact {path}: safetensors header is not a JSON object")
    start_of_data = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(path, view, name, info, start_of_data, size)
    return tensors


def _tensor(path: Path, view: mmap.mmap, name: str, info: Any, start_of_data: int,
            size: int) -> np.ndarray:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int)
                and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise TypeError("offsets and shape must be non-negative integers")
    except (TypeError, KeyError, ValueError) as exc:
        raise ModelLoadFailed(f"artifact {path}: tensor {name!r} has a malformed entry "
                              f"{info!r} ({exc})") from exc
    dtype_code = _DTYPES.get(dtype_name)
    if dtype_code is None:
        hint = " (numpy has no bfloat16: load it with TorchModel.load_tensors)" \
            if dtype_name == "BF16" else ""
        raise ModelLoadFailed(f"artifact {path}: tensor {name!r} has dtype {dtype_name}, "
                              f"which numpy cannot map{hint}")
    dtype = np.dtype(dtype_code)
    count = math.prod(shape)
    if not 0 <= begin <= end or end - begin != count * dtype.itemsize \
            or start_of_data + end > size:
        raise ModelLoadFailed(f"artifact {path}: tensor {name!r} ({dtype_name} {shape}) does "
                              f"not match its bytes {begin}..{end} of {size - start_of_data}")
    return np.frombuffer(view, dtype=dtype, count=count,
                         offset=start_of_data + begin).reshape(shape)
