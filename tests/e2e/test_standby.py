"""After a crash, a shared runtime keeps a started spare: the next crash is a swap.

Measured with ``bench/crash_stall.py``: every model on a crashed runtime stalled ~2.5-3 s
per crash (an interpreter start, then its models' framework imports); with the
standby, later crashes stall them for tens of milliseconds.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil

from tests.procs import Proc, metric_sum, runtime_name, serve
from tests.waiting import eventually_blocking

IRIS = {"features": [5.1, 3.5, 1.4, 0.2]}


def runtime_pids(proc: Proc) -> set[int]:
    """Live shared runtime processes of ``proc`` (serving or standing by; not the
    quarantine runtime, which stands beside them)."""
    pids = set()
    for process in proc.descendants():
        try:
            live = process.status() != psutil.STATUS_ZOMBIE
            if live and (runtime_name(process) or "").startswith("runtime-"):
                pids.add(process.pid)
        except psutil.Error:  # exited between the listing and the look
            continue
    return pids


def test_a_second_crash_is_taken_over_by_the_standby_which_retires_when_quiet(
        tmp_path: Path) -> None:
    # Kept 30 s after a crash: the spare starts once the restarted runtime has been up 2 s
    # with no load, and its imports and the test's iris reload take ~6 s on a busy box
    # (at 15 s, with the other test process busy, the spare had retired before the second
    # kill found it).
    proc, base = serve(tmp_path, env={"MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.3",
                                      "MODELFLEET_WORKER__STANDBY_KEEP_S": "30"})
    try:
        assert httpx.post(f"{base}/v1/models/iris/infer", json=IRIS, timeout=30) \
            .status_code == 200
        [first] = runtime_pids(proc)  # no spare is kept before a crash
        time.sleep(1)  # a health ping (every 0.3 s) reports what iris's load imported
        os.kill(first, signal.SIGKILL)
        eventually_blocking(lambda: len(runtime_pids(proc)) == 2)  # restarted, then a spare started
        eventually_blocking(lambda: "standby.sock (pid" in proc.log())  # the spare is up, listening
        assert httpx.post(f"{base}/v1/models/iris/infer", json=IRIS, timeout=30) \
            .status_code == 200
        before = runtime_pids(proc)
        log_before = proc.log()
        # The spare is started once the restarted runtime is up: the older one serves.
        primary = min(before, key=lambda pid: psutil.Process(pid).create_time())
        os.kill(primary, signal.SIGKILL)
        [spare] = before - {primary}
        eventually_blocking(lambda: "its standby takes over" in proc.log()[len(log_before):])
        assert httpx.post(f"{base}/v1/models/iris/infer", json=IRIS, timeout=30) \
            .status_code == 200
        assert spare in runtime_pids(proc)  # the spare now serves; a new spare follows
        assert metric_sum(base, "modelfleet_runtime_restarts_total") == 2
        # The spare had imported iris's framework (sklearn) before it was needed.
        assert "preloaded" in proc.log()
        # No crash for standby_keep_s: the spare is stopped.
        eventually_blocking(lambda: runtime_pids(proc) == {spare}, timeout_s=60)
    finally:
        proc.stop()
