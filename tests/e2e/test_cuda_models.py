"""A CUDA-only model on a CPU-only ``modelfleet serve``: a clear 503, not a silent CPU run."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.procs import serve, write_package


def test_a_cuda_model_on_a_cpu_fleet_is_answered_503(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_package(repo, "gpu-echo", '''
        name = "gpu-echo"
        version = "1"
        entrypoint = "handler:Echo"
        accepts = ["text/plain"]
        device = "cuda"
    ''', '''
        from modelfleet import Model, Request

        class Echo(Model):
            async def preprocess(self, request: Request) -> str:
                return request.text()

            def predict(self, batch):
                return [{"echo": text} for text in batch]
    ''')
    proc, base = serve(tmp_path, repo=repo)
    try:
        response = httpx.post(f"{base}/v1/models/gpu-echo/infer", content=b"hi",
                              headers={"content-type": "text/plain"}, timeout=30)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "no_capacity"
        assert "needs a CUDA device" in error["message"]
        assert "MODELFLEET_WORKER__GPUS" in error["message"]
        assert response.headers["retry-after"] == "5"
    finally:
        proc.stop()
