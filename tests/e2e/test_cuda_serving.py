"""A CUDA model served for real by ``modelfleet serve`` on a GPU worker, and again after its
runtime is killed: the replacement is forked from the zygote, which had imported torch by
then, and CUDA must still start in it.

Needs a CUDA device; CI's machines have none, so there it is skipped, and it runs on a
GPU machine with the device checks (README "Host-to-device promotion (GPU)")."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.procs import serve, write_package
from tests.waiting import eventually_blocking


def cuda_device() -> bool:
    try:
        import torch  # at the test, not at collection (~2 s)
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def write_repo(root: Path) -> Path:
    write_package(root, "cuda-net", '''
        name = "cuda-net"
        version = "1"
        entrypoint = "handler:Net"
        accepts = ["application/json"]
        device = "cuda"
        memory_estimate_mb = 8
    ''', '''
        import torch
        from modelfleet.model import TorchModel

        class Net(TorchModel):
            def load(self, ctx):
                super().load(ctx)
                torch.manual_seed(0)
                self.net = torch.nn.Linear(16, 2).to(self.device).eval()

            async def preprocess(self, request):
                return torch.tensor(request.json()["x"], dtype=torch.float32)

            def predict(self, batch):
                with torch.no_grad():
                    out = self.net(torch.stack(batch).to(self.device))
                where = str(next(self.net.parameters()).device)
                return [{"device": where, "y": row} for row in out.cpu().tolist()]
    ''')
    return root


def test_a_cuda_model_is_served_on_the_gpu_and_again_after_its_runtime_is_killed(
        tmp_path: Path) -> None:
    if not cuda_device():
        pytest.skip("needs a CUDA device")
    repo = write_repo(tmp_path / "repo")
    proc, base = serve(tmp_path, {"MODELFLEET_WORKER__GPUS": "1",
                                  "MODELFLEET_WORKER__SHARED_RUNTIMES": "1"}, repo=repo)
    body = {"x": [0.5] * 16}
    try:
        first = httpx.post(f"{base}/v1/models/cuda-net/infer", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert first.json()["device"] == "cuda:0"
        [runtime] = proc.runtimes()
        assert runtime.environ().get("CUDA_VISIBLE_DEVICES") == "0"
        # The zygote imports what the runtime's models imported (torch among them) once the
        # runtime has been quiet a while: the restart below is forked after that.
        known = tmp_path / "state" / "zygote-modules.txt"
        eventually_blocking(lambda: known.is_file() and "torch" in known.read_text().split(),
                            60, what="torch among the zygote's modules", every_s=0.5,
                            state=proc.log)
        eventually_blocking(lambda: re.search(r"zygote \d+ imported \d+ module", proc.log()),
                            120, what="the zygote's preload done", every_s=0.5, state=proc.log)
        runtime.kill()
        runtime.wait(10)

        def answered_again() -> httpx.Response | None:
            response = httpx.post(f"{base}/v1/models/cuda-net/infer", json=body, timeout=120)
            return response if response.status_code == 200 else None

        again = eventually_blocking(answered_again, 120, what="cuda-net answered again",
                                    every_s=0.5, state=proc.log)
        assert again.json() == first.json()  # same seed, same device, same numbers
        assert [r.pid for r in proc.runtimes()] != [runtime.pid]
    finally:
        proc.stop()
