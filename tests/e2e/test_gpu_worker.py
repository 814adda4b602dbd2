"""A worker declaring two CUDA devices runs one runtime process per device."""

from __future__ import annotations

import time
from pathlib import Path

from tests.procs import worker


def test_each_shared_runtime_process_sees_its_own_device(tmp_path: Path) -> None:
    proc, _ = worker(tmp_path, "memory", {"MODELFLEET_WORKER__GPUS": "2",
                                          "MODELFLEET_WORKER__SHARED_RUNTIMES": "2"}, "gpu-w")
    try:
        deadline = time.monotonic() + 30
        while len(runtimes := proc.runtimes()) < 2:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.1)
        seen = sorted(r.environ().get("CUDA_VISIBLE_DEVICES", "(unset)") for r in runtimes)
        assert seen == ["0", "1"]
    finally:
        proc.stop()
