"""A worker declaring two CUDA devices runs one runtime process per device."""

from __future__ import annotations

from pathlib import Path

import psutil

from tests.procs import worker
from tests.waiting import eventually_blocking


def test_each_shared_runtime_process_sees_its_own_device(tmp_path: Path) -> None:
    proc, _ = worker(tmp_path, "memory", {"MODELFLEET_WORKER__GPUS": "2",
                                          "MODELFLEET_WORKER__SHARED_RUNTIMES": "2"}, "gpu-w")
    try:
        def two_runtimes() -> list[psutil.Process] | None:
            runtimes = proc.runtimes()
            return runtimes if len(runtimes) >= 2 else None

        runtimes = eventually_blocking(two_runtimes, 30, what="two runtime processes",
                                       every_s=0.1, state=proc.log)
        seen = sorted(r.environ().get("CUDA_VISIBLE_DEVICES", "(unset)") for r in runtimes)
        assert seen == ["0", "1"]
    finally:
        proc.stop()
