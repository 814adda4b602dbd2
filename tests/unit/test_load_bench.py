"""The load-throughput benchmark still runs end to end (1 MB; no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load_throughput.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("load_throughput_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_json_has_every_method_for_every_size_and_cache(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    assert bench.main(["--sizes-mb", "1", "--repeats", "1", "--cache", "cold,warm",
                       "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    methods = ["raw read", "np.load copy", "map .npy", "map safetensors", "torch.load",
               "safetensors.torch"]
    assert [(r["cache"], r["method"]) for r in rows] == [
        (cache, method) for cache in ("cold", "warm") for method in methods]
    for row in rows:
        assert row["nbytes"] == 1 << 20 and row["load_s"] > 0 and row["load_touch_s"] > 0


def test_every_method_loads_the_same_bytes(tmp_path: Path) -> None:
    bench = load_bench()
    bench.write_artifacts(tmp_path, 1, torch_available=True)
    expected = np.load(tmp_path / "w.npy")
    for name, (_, load) in bench.methods(tmp_path, torch_available=True).items():
        loaded = load()
        as_array = (np.frombuffer(loaded, dtype=np.float32)[-expected.size:]
                    if isinstance(loaded, bytearray) else np.asarray(loaded))
        assert np.array_equal(as_array, expected), name
        assert bench.touch_pages(loaded) >= 0


def test_bench_refuses_nonsense_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--cache", "lukewarm"])
    assert "--cache" in capsys.readouterr().err
