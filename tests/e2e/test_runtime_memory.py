"""A runtime's memory is its budget: real runtime processes loading and evicting real arrays.

Each test starts ``python -m modelfleet.runtime`` the way the worker does
(``ProcessLauncher``) over packages whose handlers read real numpy arrays of 5-30 MB.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from modelfleet.errors import ConfigError
from modelfleet.ipc.protocol import SETTINGS_ENV, RuntimeStats
from modelfleet.ipc.socket_runtime import SocketRuntime
from modelfleet.settings import MiB, Settings
from modelfleet.worker.process_launcher import ProcessLauncher
from tests.procs import free_port, metric_sum, running, write_package
from tests.waiting import eventually_blocking

SIZES_MB = {"m5": 5, "m30": 30, "m12": 12, "m25": 25, "m8": 8, "m20": 20, "m15": 15, "m28": 28}
# 20 loads through a 60 MB budget: most of them evict something.
ORDER = ["m5", "m30", "m12", "m25", "m8", "m20", "m15", "m28", "m30", "m25", "m20", "m28",
         "m5", "m12", "m8", "m15", "m30", "m20", "m25", "m28"]
BUDGET = 60 * MiB

MANIFEST = '''
    name = "{name}"
    entrypoint = "handler:{cls}"
    memory_estimate_mb = {mb}
'''
BLOB = '''
    import numpy as np
    from modelfleet import Model

    class Blob(Model):
        def load(self, ctx):
            self.w = np.fromfile(ctx.artifact("weights.bin"), dtype=np.float32)

        async def preprocess(self, request):
            return 0

        def predict(self, batch):
            return [float(self.w[0]) for _ in batch]
'''
# Its books say 1 MiB (memory_bytes), but it holds 90 MB: RSS goes over the budget.
HOG = '''
    import numpy as np
    from modelfleet import Model

    class Hog(Model):
        def load(self, ctx):
            self.w = np.ones(90 * 1024 * 1024 // 4, dtype=np.float32)

        def memory_bytes(self):
            return 1024 * 1024

        async def preprocess(self, request):
            return 0

        def predict(self, batch):
            return [0.0 for _ in batch]
'''


def blob_repo(root: Path) -> Path:
    for name, mb in SIZES_MB.items():
        folder = write_package(root, name, MANIFEST.format(name=name, mb=mb, cls="Blob"), BLOB)
        np.full(mb * MiB // 4, 1.0, dtype=np.float32).tofile(folder / "weights.bin")
    return root


def runtime_settings(tmp_path: Path, repo: Path, **runtime: object) -> Settings:
    return Settings(repo=str(repo), state_dir=str(tmp_path / "state"), log_level="warning",
                    # No floor under the slack: these tests hold the tight rule, 1.25 x budget.
                    runtime={"device_budget_bytes": BUDGET, "host_budget_bytes": 0,
                             "rss_margin_floor_bytes": 0, **runtime})


@asynccontextmanager
async def runtime_process(tmp_path: Path, settings: Settings) -> AsyncIterator[SocketRuntime]:
    env = {**os.environ, SETTINGS_ENV: settings.model_dump_json()}
    started = await ProcessLauncher(tmp_path, 60, 10).launch("mem", sys.executable, env)
    try:
        yield started.runtime
    finally:
        await started.kill()


def within_limit(stats: RuntimeStats) -> bool:
    return stats.rss_bytes <= stats.rss_overhead_bytes + 1.25 * stats.memory_budget_bytes


async def test_evictions_give_the_memory_back(tmp_path: Path) -> None:
    repo = blob_repo(tmp_path / "repo")
    async with runtime_process(tmp_path, runtime_settings(tmp_path, repo)) as runtime:
        first = await runtime.stats()
        assert first.rss_startup_bytes > 0 and first.memory_budget_bytes == BUDGET
        assert first.rss_limit_bytes == first.rss_overhead_bytes + int(1.25 * BUDGET)
        for name in ORDER:
            await runtime.load(name, "1", timeout_s=60)
            stats = await runtime.stats()
            assert stats.device_used_bytes <= BUDGET
            assert within_limit(stats), (name, stats.rss_bytes, stats.rss_overhead_bytes)
            assert stats.loads_refused == 0 and not stats.over_memory_budget
        for name in SIZES_MB:
            await runtime.unload(name, timeout_s=30)
        emptied = await runtime.stats()
        # Every model gone: the RSS is back near the overhead, far below one budget.
        assert emptied.rss_bytes <= emptied.rss_overhead_bytes + BUDGET // 4


async def test_over_the_budget_a_load_waits_until_models_are_shed(tmp_path: Path) -> None:
    repo = blob_repo(tmp_path / "repo")
    write_package(repo, "hog", MANIFEST.format(name="hog", mb=1, cls="Hog"), HOG)
    async with runtime_process(tmp_path, runtime_settings(tmp_path, repo)) as runtime:
        await runtime.load("m5", "1", timeout_s=60)  # numpy's I/O imported: overhead settled
        await runtime.load("hog", "1", timeout_s=60)  # admitted under the line, then over it
        await runtime.load("m12", "1", timeout_s=60)  # the hog is shed first, then m12 loads
        stats = await runtime.stats()
        assert "m12" in stats.device and "hog" not in stats.device
        assert stats.loads_refused == 0 and not stats.over_memory_budget
        assert within_limit(stats)


async def test_the_budget_changes_at_run_time(tmp_path: Path) -> None:
    repo = blob_repo(tmp_path / "repo")
    async with runtime_process(tmp_path, runtime_settings(tmp_path, repo)) as runtime:
        for name in ("m5", "m12", "m30"):
            await runtime.load(name, "1", timeout_s=60)
        await runtime.set_budgets(20 * MiB, timeout_s=30)
        stats = await runtime.stats()
        assert stats.device_budget_bytes == stats.memory_budget_bytes == 20 * MiB
        assert stats.device_used_bytes <= 20 * MiB and "m30" not in stats.device
        assert stats.rss_limit_bytes == stats.rss_overhead_bytes + int(1.25 * 20 * MiB)
        assert within_limit(stats)  # the evicted models' memory went back to the system
        with pytest.raises(ConfigError, match="budgets must be >= 0"):
            await runtime.set_budgets(-1, timeout_s=30)
        assert (await runtime.stats()).device_budget_bytes == 20 * MiB  # unchanged


def test_each_runtime_reports_its_rss_next_to_its_budget(tmp_path: Path) -> None:
    repo = blob_repo(tmp_path / "repo")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES": str(BUDGET),
           "MODELFLEET_RUNTIME__HOST_BUDGET_BYTES": "0",
           "MODELFLEET_DLQ_DB": str(tmp_path / "dlq.sqlite3")}
    with running(["serve", "--repo", str(repo), "--port", str(port)], tmp_path, "serve",
                 f"{base}/readyz", env):
        response = httpx.post(f"{base}/v1/models/m12/infer", json={}, timeout=60)
        assert response.status_code == 200, response.text
        eventually_blocking(lambda: metric_sum(base, "modelfleet_runtime_rss_bytes") != 0, 20,
                            what="a runtime's RSS on /metrics", every_s=0.2)
        text = httpx.get(f"{base}/metrics").text
        runtimes = {line.split('runtime="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("modelfleet_runtime_rss_bytes{")}
        assert runtimes, text
        for name in runtimes:
            budget = metric_sum(base, "modelfleet_runtime_budget_bytes", runtime=name)
            startup = metric_sum(base, "modelfleet_runtime_rss_startup_bytes", runtime=name)
            assert budget == BUDGET and startup > 0
            assert metric_sum(base, "modelfleet_runtime_rss_limit_bytes", runtime=name) > budget
        assert metric_sum(base, "modelfleet_runtime_over_memory_budget") == 0


# Its predict keeps what it allocates, after the model is unloaded too (a module-level
# list, as a leaky model's cache would): its runtime's RSS stays over the line whatever
# that runtime sheds.
LEAKER = '''
    import numpy as np
    from modelfleet import Model

    KEPT = []

    class Leaker(Model):
        def load(self, ctx):
            self.w = np.ones(16, dtype=np.float32)

        async def preprocess(self, request):
            return 0

        def predict(self, batch):
            KEPT.append(np.ones(150 * 1024 * 1024 // 4, dtype=np.float32))
            return [0.0 for _ in batch]
'''


def test_a_load_refused_by_one_runtimes_memory_guard_is_served_by_another(
        tmp_path: Path) -> None:
    """A runtime whose RSS stays over its line refuses every load (``no_capacity``) until
    it has shed back under, which here is never. A miss placed there is not failed after
    the memory retries (it used to be a 503 after 3.6 s): it moves to the other shared
    runtime and is answered."""
    repo = tmp_path / "repo"
    write_package(repo, "leaker", MANIFEST.format(name="leaker", mb=1, cls="Leaker"), LEAKER)
    for name, mb in (("filler", 8), ("small", 5)):
        folder = write_package(repo, name, MANIFEST.format(name=name, mb=mb, cls="Blob"), BLOB)
        np.full(mb * MiB // 4, 1.0, dtype=np.float32).tofile(folder / "weights.bin")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"MODELFLEET_WORKER__SHARED_RUNTIMES": "2",
           "MODELFLEET_WORKER__DEVICE_BUDGET_BYTES": str(BUDGET),
           "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.2",
           "MODELFLEET_RUNTIME__HOST_BUDGET_BYTES": "0",
           "MODELFLEET_DLQ_DB": str(tmp_path / "dlq.sqlite3")}
    with running(["serve", "--repo", str(repo), "--port", str(port)], tmp_path, "serve",
                 f"{base}/readyz", env):
        answer = httpx.post(f"{base}/v1/models/leaker/infer", json={}, timeout=60)
        assert answer.status_code == 200, answer.text
        eventually_blocking(
            lambda: metric_sum(base, "modelfleet_runtime_over_memory_budget") >= 1, 30,
            what="the leaker's runtime going over its line", every_s=0.2)
        # The leaker's runtime shed what it could and holds nothing now, so the next
        # misses are placed there: each is refused, and moves to the other runtime.
        answer = httpx.post(f"{base}/v1/models/filler/infer", json={}, timeout=60)
        assert answer.status_code == 200, answer.text
        refused = metric_sum(base, "modelfleet_worker_memory_retries_total", code="no_capacity")
        answer = httpx.post(f"{base}/v1/models/small/infer", json={}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert metric_sum(base, "modelfleet_worker_memory_retries_total",
                          code="no_capacity") > refused, "the miss was not placed on the " \
            "runtime over its line: this test did not exercise the refusal"
        assert metric_sum(base, "modelfleet_runtime_over_memory_budget") == 1
