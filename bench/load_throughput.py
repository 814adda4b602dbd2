"""A model load's throughput: copying, mapping and a raw read of the same bytes.

For each artifact size (float32 weights of 1, 16, 64 and 256 MB by default) the same
array is written as ``.npy``, as safetensors and (torch installed) as a ``torch.save``
file, then loaded again and again by each method:

- ``raw read``: ``readinto`` a buffer allocated (and faulted in) once: the file's bytes
  into memory and nothing else, the bound a loader's copy can reach;
- ``np.load copy``: ``np.load``, the usual load: read and copied into a new array;
- ``map .npy``: ``ctx.map_array`` (``np.load(mmap_mode="r")``);
- ``map safetensors``: ``ctx.map_tensors`` (modelfleet's read-only mapping);
- ``torch.load``: the default PyTorch path (``torch.load(weights_only=True)``);
- ``safetensors.torch``: ``safetensors.torch.load_file(device="cpu")``, what
  ``TorchModel.load_tensors`` does.

A mapped load is lazy: it reads nothing until the model touches its weights. So each
method is timed twice: the load alone, and the load plus a first touch of every page
(one byte read per 4 KiB page, the least a first predict that uses every weight does).
The second is the honest comparison; the first is what the load call alone costs.

``--cache cold`` drops the file's pages from the OS page cache before every load
(``posix_fadvise(DONTNEED)``), so bytes come from the disk; ``warm`` leaves them
cached (a model reloaded soon after its eviction, or one that another runtime maps).
Each figure is the median of ``--repeats`` loads; GB/s is 10^9 bytes per second.

Anchor: ServerlessLLM (Fu et al., OSDI 2024) loads checkpoints 3.6-8.2x faster than
the default PyTorch path; the last column is each method's speed over ``torch.load``.

    .venv/bin/python bench/load_throughput.py [--sizes-mb 1,16,64,256] [--repeats 5]
        [--cache cold,warm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from modelfleet.model.mapped import map_npy, map_safetensors

_MB = 1 << 20
_PAGE = 4096
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Row:
    size_mb: int
    method: str
    cache: str
    load_s: float
    load_touch_s: float
    nbytes: int

    @property
    def load_gbps(self) -> float:
        return self.nbytes / self.load_s / 1e9

    @property
    def load_touch_gbps(self) -> float:
        return self.nbytes / self.load_touch_s / 1e9


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped: write them out first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def touch_pages(buffer: Any) -> int:
    """Read one byte of every page of an array, tensor or buffer (the first predict's
    page faults, without its arithmetic)."""
    if hasattr(buffer, "numpy"):  # a torch tensor on the CPU
        buffer = buffer.numpy()
    flat = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) \
        else buffer.reshape(-1).view(np.uint8)
    return int(flat[::_PAGE].sum())


class RawReader:
    """``readinto`` one buffer allocated once per file: the bytes from the file into
    memory and nothing else (no allocation, no page faults of a fresh buffer, no format)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buffer = bytearray(path.stat().st_size)
        self.buffer[::_PAGE] = b"\x01" * len(self.buffer[::_PAGE])  # fault it in now

    def __call__(self) -> bytearray:
        view = memoryview(self.buffer)
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = f.readinto(view[done: done + _CHUNK])
                if not n:
                    break
                done += n
        return self.buffer


def methods(folder: Path, torch_available: bool) -> dict[str, tuple[Path, Callable[[], Any]]]:
    """Method name -> (the file it reads, a load returning what to touch)."""
    npy, st, pt = folder / "w.npy", folder / "w.safetensors", folder / "w.pt"
    table: dict[str, tuple[Path, Callable[[], Any]]] = {
        "raw read": (npy, RawReader(npy)),
        "np.load copy": (npy, lambda: np.load(npy, allow_pickle=False)),
        "map .npy": (npy, lambda: map_npy(npy)),
        "map safetensors": (st, lambda: map_safetensors(st)["w"]),
    }
    if torch_available:
        import torch
        from safetensors.torch import load_file

        table["torch.load"] = (pt, lambda: torch.load(pt, weights_only=True)["w"])
        table["safetensors.torch"] = (st, lambda: load_file(st, device="cpu")["w"])
    return table


def write_artifacts(folder: Path, size_mb: int, torch_available: bool) -> int:
    array = np.random.default_rng(size_mb).standard_normal(size_mb * _MB // 4,
                                                           dtype=np.float32)
    np.save(folder / "w.npy", array)
    save_file({"w": array}, str(folder / "w.safetensors"))
    if torch_available:
        import torch

        torch.save({"w": torch.from_numpy(array)}, folder / "w.pt")
    return int(array.nbytes)


def measure(path: Path, load: Callable[[], Any], cache: str, repeats: int
            ) -> tuple[float, float]:
    """Median seconds of (load alone, load + first touch of every page)."""
    alone: list[float] = []
    touched: list[float] = []
    for _ in range(repeats):
        for times, touch in ((alone, False), (touched, True)):
            if cache == "cold":
                drop_page_cache(path)
            else:
                touch_pages(load())  # warm: the file's pages are in the page cache
            started = time.perf_counter()
            result = load()
            if touch:
                touch_pages(result)
            times.append(time.perf_counter() - started)
            del result
    return statistics.median(alone), statistics.median(touched)


def run(sizes_mb: Sequence[int], caches: Sequence[str], repeats: int) -> list[Row]:
    try:
        import torch  # noqa: F401
        torch_available = True
    except ImportError:
        torch_available = False
    rows: list[Row] = []
    for size_mb in sizes_mb:
        with tempfile.TemporaryDirectory(prefix="modelfleet-bench-load-") as tmp:
            folder = Path(tmp)
            nbytes = write_artifacts(folder, size_mb, torch_available)
            for cache in caches:
                for name, (path, load) in methods(folder, torch_available).items():
                    alone, touched = measure(path, load, cache, repeats)
                    rows.append(Row(size_mb, name, cache, alone, touched, nbytes))
    return rows


def print_table(rows: list[Row], repeats: int) -> None:
    print(f"median of {repeats} loads; GB/s = 10^9 B/s of float32 weights; 'touch' = one "
          "byte read per 4 KiB page after the load")
    print("cold: page cache dropped before each load (bytes from disk); warm: file cached")
    print()
    header = (f"{'size':>6} {'cache':<5} {'method':<18} {'load ms':>9} {'load GB/s':>9} "
              f"{'+touch ms':>9} {'+touch GB/s':>11} {'vs torch.load':>13} {'vs raw':>6}")
    print(header)
    print("-" * len(header))
    for row in rows:
        peers = {r.method: r for r in rows if (r.size_mb, r.cache) == (row.size_mb, row.cache)}
        torch_row, raw = peers.get("torch.load"), peers["raw read"]
        vs_torch = (f"{torch_row.load_touch_s / row.load_touch_s:>12.1f}x"
                    if torch_row is not None else f"{'':>13}")
        print(f"{row.size_mb:>4}MB {row.cache:<5} {row.method:<18} {row.load_s * 1e3:>9.2f} "
              f"{row.load_gbps:>9.2f} {row.load_touch_s * 1e3:>9.2f} "
              f"{row.load_touch_gbps:>11.2f} {vs_torch} "
              f"{raw.load_touch_s / row.load_touch_s:>5.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", default="cold,warm", help="cold, warm or both")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        parser.error("--sizes-mb: comma-separated whole megabytes")
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not sizes or any(s < 1 for s in sizes):
        parser.error("--sizes-mb: comma-separated whole megabytes, each >= 1")
    if not caches or set(caches) - {"cold", "warm"}:
        parser.error("--cache: cold, warm or cold,warm")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    rows = run(sizes, caches, args.repeats)
    if args.json:
        json.dump([{**asdict(r), "load_gbps": r.load_gbps,
                    "load_touch_gbps": r.load_touch_gbps} for r in rows], sys.stdout, indent=2)
        print()
    else:
        print_table(rows, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
