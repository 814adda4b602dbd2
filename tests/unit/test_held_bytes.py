"""What a load measures: the buffers a model holds, even while another load imports numpy."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from modelfleet.runtime.device import held_bytes


def test_arrays_and_their_views_count_once_with_the_bytes_beside_them() -> None:
    weights = np.zeros((100, 10), dtype=np.float32)  # 4,000 bytes
    model = {"weights": weights, "view": weights[:10], "again": [weights], "blob": b"x" * 96}
    assert held_bytes(model) == 4_000 + 96


def test_a_numpy_half_imported_by_another_load_is_no_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that finishes while another load's thread is importing numpy sees numpy in
    sys.modules before its types exist (a module half made): measuring it must not fail
    the load (it did: "partially initialized module 'numpy' has no attribute 'ndarray'",
    a pill's runtime answered model_load_failed instead of runtime_crashed)."""
    monkeypatch.setitem(sys.modules, "numpy", types.ModuleType("numpy"))
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert held_bytes({"blob": b"x" * 10, "handler": object()}) == 10
