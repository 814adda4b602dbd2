"""Measuring what a load costs on its device, and moving a model between tiers.

``measure_load`` wraps a handler's ``load`` and sizes what *this model* holds, never a
process-wide delta: loads run two at a time and requests run beside them, so the
process's resident memory (or CUDA's allocated total) grows by what they all allocate
(measured: a 33 MB model counted as 68 MB, then refused as too large). The size is,
in order of preference: what the handler declares (``memory_bytes()``, for memory
held outside Python objects, such as a C++ inference session); else the buffers
reachable from the handler (numpy arrays, torch tensors, bytes), each counted once,
and on CPU at least the artifact bytes. Tier moves call the handler's optional
``to_host()`` / ``to_device()`` hooks (``TorchModel`` implements them with
``module.to("cpu")`` into pinned memory and back); a plain CPU model has nothing to
move, and the cache still accounts its bytes the same way.

``device_memory`` reads what the CUDA caching allocator holds (reserved and allocated
bytes): the runtime holds its device tier to the budget by that, the memory the device
really gave this process, not by the bytes of the tensors reachable from handlers
(``runtime.memory``).
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfleet.model.importer import import_framework
from modelfleet.model.tiers import SizedModel, TierMovable


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; imports torch (seconds) if it is not yet."""
    try:
        torch = import_framework("torch")
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(requested: str) -> str:
    """The device a model will really use: 'cuda' falls back to 'cpu' without one."""
    return "cuda" if requested == "cuda" and cuda_available() else "cpu"


def package_bytes(package_dir: Path) -> int:
    """The package's files, less the bytecode Python caches beside its modules: importing
    the handler writes that (``__pycache__``) during the very load being measured, which
    then measured bigger than it had reserved and, with no room for the difference, was
    unloaded again and refused."""
    return sum(f.stat().st_size for f in package_dir.rglob("*")
               if f.is_file() and "__pycache__" not in f.relative_to(package_dir).parts)


@dataclass(frozen=True)
class LoadMeasurement:
    size_bytes: int
    seconds: float


def measure_load(device: str, package_dir: Path, prepare: Callable[[], Any],
                 load: Callable[[], None]) -> LoadMeasurement:
    """Run ``prepare`` (importing the handler; returns it) then ``load``; size the model.

    Time covers both: importing a framework is part of what a cold model costs. Bytes
    are what the loaded handler holds (see the module's docstring), not what the
    import left resident.
    """
    started = time.perf_counter()
    handler = prepare()
    load()
    seconds = time.perf_counter() - started
    if isinstance(handler, SizedModel):
        return LoadMeasurement(max(int(handler.memory_bytes()), 1), seconds)
    held = held_bytes(handler, cuda_only=device == "cuda")
    if device == "cuda":
        return LoadMeasurement(max(held, 1), seconds)
    return LoadMeasurement(max(held, package_bytes(package_dir), 1), seconds)


_MAX_OBJECTS = 200_000  # a bound on the walk, for handlers that hold huge object graphs


def _type_in(module_name: str, type_name: str) -> Any:
    """``module.type`` if that module is imported and has it by now, else None."""
    found = getattr(sys.modules.get(module_name), type_name, None)
    return found if isinstance(found, type) else None


def held_bytes(root: Any, cuda_only: bool = False) -> int:
    """Bytes of the buffers reachable from ``root``: numpy arrays, torch tensors, bytes.

    A buffer shared by several arrays or tensors (views, tied weights) counts once.
    Modules (and classes, functions) are not followed: what they hold is shared by
    every model. ``cuda_only``: count only tensors on a CUDA device.
    """
    # Only libraries a model imported can hold its buffers (an isolated runtime's venv
    # may have neither): look them up, never import them here. A type that is not there
    # yet is a library another load is still importing (a module half made, in
    # sys.modules before its types): nothing of this model's can be of that type.
    ndarray = _type_in("numpy", "ndarray")
    tensor = _type_in("torch", "Tensor")
    seen_objects: set[int] = set()
    seen_buffers: set[int] = set()
    total = 0
    stack = [root]
    while stack and len(seen_objects) < _MAX_OBJECTS:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen_objects.add(id(obj))
        if ndarray is not None and isinstance(obj, ndarray):
            base = obj
            while isinstance(base.base, ndarray):
                base = base.base
            if not cuda_only and id(base) not in seen_buffers:
                seen_buffers.add(id(base))
                total += base.nbytes
            continue
        if tensor is not None and isinstance(obj, tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_buffers and (obj.is_cuda or not cuda_only):
                seen_buffers.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if isinstance(obj, (bytes, bytearray, memoryview)):
            total += 0 if cuda_only else len(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(_attributes(obj))
    return total


_NOT_FOLLOWED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                 types.MethodType, str, int, float, complex, bool, type(None))


def _attributes(obj: Any) -> list[Any]:
    values: list[Any] = []
    with contextlib.suppress(TypeError):
        values.extend(vars(obj).values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                values.append(getattr(obj, name))
    return values


def move(handler: Any, tier: str) -> None:
    """Move a ``TierMovable`` handler's weights to ``tier``; other handlers stay where they are."""
    if not isinstance(handler, TierMovable):
        return
    if tier == "host":
        handler.to_host()
    else:
        handler.to_device()


@dataclass(frozen=True)
class DeviceMemory:
    """The CUDA caching allocator's bytes: reserved (what the device gives this process)
    and allocated (what live tensors use). Zero without torch or CUDA."""

    reserved_bytes: int = 0
    allocated_bytes: int = 0


def device_memory() -> DeviceMemory:
    """What the CUDA allocator holds in this process, where a model imported torch and
    CUDA is initialised; never imports torch or initialises CUDA itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return DeviceMemory()
    try:
        if not torch.cuda.is_initialized():
            return DeviceMemory()
        devices = range(torch.cuda.device_count())
        return DeviceMemory(sum(int(torch.cuda.memory_reserved(i)) for i in devices),
                            sum(int(torch.cuda.memory_allocated(i)) for i in devices))
    except (AttributeError, RuntimeError):
        return DeviceMemory()


def release_device_memory(device: str) -> None:
    if device == "cuda":
        with contextlib.suppress(ImportError):
            import torch

            torch.cuda.empty_cache()
