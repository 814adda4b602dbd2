"""A hot model on two runtime processes, and back on one when its load stops.

``modelfleet serve`` with two shared runtimes; the model answers with the id of the
process that ran it, so the replies say which runtime served them. Under a load of
more tasks than one runtime is given (``worker.replica_at_tasks``), both runtime
processes serve it; once the load stops, after ``worker.replica_keep_s``, the second
copy is dropped and one process serves it alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.procs import metric_sum, serve, write_package
from tests.waiting import eventually_blocking


def write_repo(root: Path) -> Path:
    write_package(root, "hot", '''
        name = "hot"
        entrypoint = "handler:Pid"
        accepts = ["application/json"]
        memory_estimate_mb = 1
        [batching]
        max_batch_size = 1
    ''', '''
        import os
        import time

        from modelfleet import Model

        class Pid(Model):
            def load(self, ctx):
                self.blob = bytes(1024 * 1024)

            async def preprocess(self, request):
                return request.json()["sleep_s"]

            def predict(self, batch):
                out = []
                for sleep_s in batch:
                    time.sleep(sleep_s)
                    out.append({"pid": os.getpid()})
                return out
    ''')
    return root


def test_a_hot_model_runs_on_both_runtime_processes_then_on_one(tmp_path: Path) -> None:
    repo = write_repo(tmp_path / "repo")
    proc, base = serve(tmp_path, repo=repo, env={
        "MODELFLEET_WORKER__SHARED_RUNTIMES": "2",
        "MODELFLEET_WORKER__REPLICA_AT_TASKS": "2",
        "MODELFLEET_WORKER__REPLICA_KEEP_S": "1",
        "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.2",
    })
    url = f"{base}/v1/models/hot/infer"
    try:
        assert httpx.post(url, json={"sleep_s": 0}, timeout=30).status_code == 200

        async def rounds(count: int) -> set[int]:
            pids = set()
            async with httpx.AsyncClient(timeout=30) as client:
                for _ in range(count):
                    replies = await asyncio.gather(*(
                        client.post(url, json={"sleep_s": 0.1}) for _ in range(12)))
                    assert all(r.status_code == 200 for r in replies), replies[0].text
                    pids |= {r.json()["pid"] for r in replies}
            return pids

        busy = asyncio.run(rounds(6))
        assert len(busy) == 2, f"served by {busy} under load"
        assert len(proc.runtimes()) == 2
        assert busy == {p.pid for p in proc.runtimes()}  # the two runtime processes
        eventually_blocking(lambda: metric_sum(base, "modelfleet_worker_model_replicas") <= 0,
                            20, what="the second copy dropped", every_s=0.2)
        alone = {httpx.post(url, json={"sleep_s": 0}, timeout=30).json()["pid"]
                 for _ in range(5)}  # one at a time: light load
        assert len(alone) == 1 and alone <= busy
    finally:
        proc.stop()
