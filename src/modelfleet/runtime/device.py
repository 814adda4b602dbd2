"""Measuring what a load costs on its device, and moving a model between tiers.

``measure_load`` wraps a handler's ``load``: on CUDA (torch present and available)
it is the device-memory delta; on CPU it is the larger of the artifact bytes and the
process's resident-memory delta. Tier moves call the handler's optional
``to_host()`` / ``to_device()`` hooks (``TorchModel`` implements them with
``module.to("cpu")`` into pinned memory and back); a plain CPU model has nothing to
move, and the cache still accounts its bytes the same way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(requested: str) -> str:
    """The device a model will really use: 'cuda' falls back to 'cpu' without one."""
    return "cuda" if requested == "cuda" and cuda_available() else "cpu"


def package_bytes(package_dir: Path) -> int:
    return sum(f.stat().st_size for f in package_dir.rglob("*") if f.is_file())


@dataclass(frozen=True)
class LoadMeasurement:
    size_bytes: int
    seconds: float


def measure_load(device: str, package_dir: Path, prepare: Callable[[], None],
                 load: Callable[[], None]) -> LoadMeasurement:
    """Run ``prepare`` (importing the handler) then ``load``; measure what the load took.

    Time covers both: importing a framework is part of what a cold model costs. Bytes
    cover ``load`` only, since a framework's import stays resident when the model goes.
    """
    artifact = package_bytes(package_dir)
    started = time.perf_counter()
    prepare()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        load()
        torch.cuda.synchronize()
        size = torch.cuda.memory_allocated() - before
        return LoadMeasurement(max(size, 1), time.perf_counter() - started)
    process = psutil.Process()
    before = process.memory_info().rss
    load()
    delta = process.memory_info().rss - before
    return LoadMeasurement(max(delta, artifact, 1), time.perf_counter() - started)


def move(handler: Any, tier: str) -> None:
    """Call the handler's tier hook (``to_host`` or ``to_device``), if it has one."""
    hook = getattr(handler, "to_host" if tier == "host" else "to_device", None)
    if callable(hook):
        hook()


def release_device_memory(device: str) -> None:
    if device == "cuda":
        with contextlib.suppress(ImportError):
            import torch

            torch.cuda.empty_cache()
