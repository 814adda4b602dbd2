"""Host-to-device promotion vs the physical copy limit vs a full reload, on a CUDA GPU.

For each model size: a ``TorchModel`` holding a stack of Linear layers (fp16) is
  1. reloaded from scratch: ``torch.load`` of its state dict from disk (page cache
     dropped first) into a fresh module, then moved to the device: what a miss costs;
  2. promoted: demoted to pinned host memory with ``to_host()``, then ``to_device()``:
     what the cache's host tier costs;
  3. copied as one plain pinned tensor of the same bytes to the device: the physical
     limit of the link.
The table reports GB/s for each and the ratios promotion/limit and reload/promotion.

    .venv/bin/python bench/gpu_tiers.py [--sizes-mb 256,1024,4096] [--repeats 3] [--json]

Needs torch with CUDA; without one it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="256,1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_tiers: torch is not installed (pip install 'modelfleet[torch]')",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_tiers: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2

    from modelfleet.model import TorchModel

    class Stack(TorchModel):
        def __init__(self, size_bytes: int) -> None:
            width = 4096
            layers = max(1, size_bytes // (width * width * 2))
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                             for _ in range(layers)]).half()
            self.device = "cuda"

    rows = []
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        size = size_mb * 2**20
        model = Stack(size)
        nbytes = sum(p.numel() * p.element_size() for p in model.net.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "weights.pt"
            torch.save(model.net.state_dict(), path)
            model.to_device()
            reload_s, promote_s, copy_s = [], [], []
            for _ in range(args.repeats):
                # 1. full reload from disk
                _drop_page_cache(path)
                del model
                torch.cuda.empty_cache()
                started = time.perf_counter()
                model = Stack.__new__(Stack)
                model.device = "cuda"
                model.net = torch.nn.Sequential(*[
                    torch.nn.Linear(4096, 4096, bias=False, device="meta")
                    for _ in range(max(1, size // (4096 * 4096 * 2)))]).half()
                model.net.load_state_dict(torch.load(path, map_location="cpu"), assign=True)
                model.net.to("cuda")
                torch.cuda.synchronize()
                reload_s.append(time.perf_counter() - started)
                # 2. demote to pinned host memory, then promote (timed)
                model.to_host()
                started = time.perf_counter()
                model.to_device()
                promote_s.append(time.perf_counter() - started)
                # 3. the physical limit: one pinned buffer of the same bytes
                buffer = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
                torch.cuda.synchronize()
                started = time.perf_counter()
                buffer.to("cuda", non_blocking=True)
                torch.cuda.synchronize()
                copy_s.append(time.perf_counter() - started)
                del buffer
        gb = nbytes / 1e9
        row = {"size_mb": round(nbytes / 2**20), "reload_s": statistics.median(reload_s),
               "promote_s": statistics.median(promote_s), "copy_s": statistics.median(copy_s)}
        row.update({"reload_gbps": gb / row["reload_s"], "promote_gbps": gb / row["promote_s"],
                    "copy_gbps": gb / row["copy_s"],
                    "promote_vs_limit": row["copy_s"] / row["promote_s"],
                    "reload_over_promote": row["reload_s"] / row["promote_s"]})
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"device: {torch.cuda.get_device_name()}  (median of {args.repeats})")
    print(f"{'size MB':>8} {'reload GB/s':>12} {'promote GB/s':>13} {'copy GB/s':>10} "
          f"{'promote/limit':>14} {'reload/promote':>15}")
    for r in rows:
        print(f"{r['size_mb']:>8} {r['reload_gbps']:>12.2f} {r['promote_gbps']:>13.2f} "
              f"{r['copy_gbps']:>10.2f} {r['promote_vs_limit']:>13.0%} "
              f"{r['reload_over_promote']:>14.1f}x")
    return 0


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
