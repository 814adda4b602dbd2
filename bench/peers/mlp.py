"""The one load-and-predict code every peer serves the catalog with.

A model is a two-layer MLP 64 -> H -> 10 (float32; ReLU) stored as an uncompressed
``.npz`` with ``W1`` (64 x H), ``b1`` (H), ``W2`` (H x 10), ``b2`` (10). The bench copies
this file next to every server it starts (on its ``sys.path`` or into each modelfleet
package), so all peers pay the same load and the same predict.

``load`` appends one line to the file named by ``$BENCH_LOAD_LOG`` (when set): the
bench counts model loads of peers that have no metric for them by counting lines.

Depends on numpy only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

N_IN = 64
N_OUT = 10
LOAD_LOG_ENV = "BENCH_LOAD_LOG"
WEIGHTS = ("W1", "b1", "W2", "b2")


class MLP:
    __slots__ = ("W1", "W2", "b1", "b2", "name", "nbytes")

    def __init__(self, name: str, W1: np.ndarray, b1: np.ndarray, W2: np.ndarray,
                 b2: np.ndarray) -> None:
        self.name = name
        self.W1, self.b1, self.W2, self.b2 = W1, b1, W2, b2
        self.nbytes = int(W1.nbytes + b1.nbytes + W2.nbytes + b2.nbytes)

    @property
    def hidden(self) -> int:
        return int(self.W1.shape[1])


def weight_bytes(hidden: int) -> int:
    """Bytes of the float32 weights of a 64 -> hidden -> 10 MLP."""
    return 4 * (N_IN * hidden + hidden + hidden * N_OUT + N_OUT)


def load(path: str | os.PathLike[str], name: str = "") -> MLP:
    """Read a model's weights from its ``.npz`` into memory (no mmap: a real load)."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: np.ascontiguousarray(data[key], dtype=np.float32) for key in WEIGHTS}
    model = from_arrays(name or path.parent.name, arrays, where=str(path))
    record_load(model)
    return model


def from_arrays(name: str, arrays: dict[str, np.ndarray], where: str = "") -> MLP:
    """An MLP of the four arrays (however they were obtained: read, or mapped), checked."""
    W1, b1, W2, b2 = (arrays[k] for k in WEIGHTS)
    if W1.shape[0] != N_IN or W2.shape != (W1.shape[1], N_OUT) or b1.shape != (W1.shape[1],) \
            or b2.shape != (N_OUT,):
        raise ValueError(f"{where or name}: not a {N_IN} -> H -> {N_OUT} MLP: "
                         f"{[arrays[k].shape for k in WEIGHTS]}")
    return MLP(name, W1, b1, W2, b2)


def record_load(model: MLP) -> None:
    """Append one line (time, pid, name, bytes) to ``$BENCH_LOAD_LOG`` when it is set."""
    log = os.environ.get(LOAD_LOG_ENV)
    if log:
        # One short line per load, appended with O_APPEND: lines from several processes
        # do not interleave.
        line = f"{time.time():.3f} {os.getpid()} {model.name} {model.nbytes}\n".encode()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def predict(model: MLP, x: Any) -> np.ndarray:
    """Logits for a batch: ``x`` is (n, 64) (or one row of 64); the answer is (n, 10)."""
    batch = np.asarray(x, dtype=np.float32)
    if batch.ndim == 1:
        batch = batch[None, :]
    if batch.ndim != 2 or batch.shape[1] != N_IN:
        raise ValueError(f"expected inputs of shape (n, {N_IN}), got {batch.shape}")
    hidden = batch @ model.W1
    hidden += model.b1
    np.maximum(hidden, 0.0, out=hidden)
    out = hidden @ model.W2
    out += model.b2
    return out


def parse_inputs(payload: Any) -> np.ndarray:
    """The 64 floats of a request body ``{"inputs": [64 numbers]}`` as a float32 row."""
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise ValueError('expected {"inputs": [64 numbers]}')
    values = payload["inputs"]
    if len(values) != N_IN:
        raise ValueError(f"'inputs' must hold {N_IN} numbers, got {len(values)}")
    try:
        row = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"'inputs' must be numbers: {exc}") from exc
    if row.shape != (N_IN,) or not np.isfinite(row).all():
        raise ValueError(f"'inputs' must be {N_IN} finite numbers")
    return row
