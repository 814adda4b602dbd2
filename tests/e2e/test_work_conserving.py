"""A worker with free permits never leaves a task it could run waiting for its next tick.

The periodic re-score is set to a minute here, so everything this test sees comes from
the event-driven path: a demand announcement for a queue the worker does not consume
wakes it, it claims starved queues one per free load slot, and a load or task that ends
while work waits wakes it again. Before work-conserving pulling, 24 cold models took one
claim per re-score: minutes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.procs import metric_sum, serve, write_package
from tests.waiting import eventually_blocking

MODELS = [f"tail-{i:02d}" for i in range(24)]


def write_repo(root: Path) -> Path:
    for model_id in MODELS:
        write_package(root, model_id, f'''
            name = "{model_id}"
            entrypoint = "handler:Affine"
            accepts = ["application/json"]
            memory_estimate_mb = 1
        ''', f'''
            import time
            import numpy as np
            from modelfleet import Model

            class Affine(Model):
                def load(self, ctx):
                    time.sleep(0.05)  # a cold load costs something
                    self.w = np.full(1000, {MODELS.index(model_id)}, dtype=np.float64)

                async def preprocess(self, request):
                    return request.json()["x"]

                def predict(self, batch):
                    return [{{"model": "{model_id}", "y": float(self.w[0]) * x}}
                            for x in batch]
        ''')
    return root


def test_cold_models_are_served_without_waiting_for_the_rescore_tick(tmp_path: Path) -> None:
    repo = write_repo(tmp_path / "repo")
    proc, base = serve(tmp_path, repo=repo, env={
        "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "60",
        "MODELFLEET_WORKER__SHARED_RUNTIMES": "2",
    })
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=20) as client:
                return await asyncio.gather(*(
                    client.post(f"{base}/v1/models/{model_id}/infer", json={"x": 2},
                                headers={"X-Request-Timeout": "15"})
                    for model_id in MODELS))

        # Wait out the first (full) re-score at start-up: from here on, only events act.
        time.sleep(1.0)
        started = time.monotonic()
        responses = asyncio.run(burst())
        elapsed = time.monotonic() - started
        for model_id, response in zip(MODELS, responses, strict=True):
            assert response.status_code == 200, (model_id, response.text)
            assert response.json() == {"model": model_id, "y": 2.0 * MODELS.index(model_id)}
        assert elapsed < 15, elapsed  # every one answered well before a single tick
        idle = metric_sum(base, "modelfleet_worker_idle_permit_seconds_while_backlog_total")
        total = metric_sum(base, "modelfleet_worker_permit_seconds_total")
        assert total > 0 and idle < total
    finally:
        proc.stop()


def test_backlog_gauge_of_a_queue_no_longer_considered_is_removed(tmp_path: Path) -> None:
    """A gauge nobody updates any more would show a stale backlog forever."""
    repo = write_repo(tmp_path / "repo")
    write_package(repo, "fails", '''
        name = "fails"
        entrypoint = "handler:F"
        accepts = ["application/json"]
    ''', '''
        from modelfleet import Model

        class F(Model):
            def load(self, ctx):
                raise RuntimeError("no weights")
    ''')
    proc, base = serve(tmp_path, repo=repo, env={
        # Demand counts for a second, and an idle subscription is kept for a second.
        "MODELFLEET_WORKER__DEMAND_WINDOW_S": "1",
        "MODELFLEET_SCHEDULING__STICKINESS_WINDOW_S": "1",
        "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.2",
        # Through its own queue (the gauge is a model queue's), not the cold lane.
        "MODELFLEET_GATEWAY__COLD_LANE_PER_MODEL": "0",
    })
    gauge = 'modelfleet_queue_backlog{model="fails"}'
    try:
        response = httpx.post(f"{base}/v1/models/fails/infer", json={"x": 1}, timeout=20)
        assert response.status_code == 500 and "no weights" in response.text
        assert gauge in httpx.get(f"{base}/metrics").text  # in demand: considered
        eventually_blocking(lambda: gauge not in httpx.get(f"{base}/metrics").text, 10,
                            what="the gauge gone with the queue's demand")
    finally:
        proc.stop()
