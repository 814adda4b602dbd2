"""TorchModel through the runtime's ModelHost: demote to host, promote back, same outputs."""

from __future__ import annotations

import textwrap
from pathlib import Path

from modelfleet.model import Request
from modelfleet.model.pipeline import handle_request
from modelfleet.repository import LocalStore
from modelfleet.runtime.host import ModelHost
from modelfleet.settings import MiB, RuntimeSettings

HANDLER = '''
import torch
from modelfleet.model import TorchModel

class Net(TorchModel):
    def load(self, ctx):
        super().load(ctx)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                       torch.nn.Linear(512, 4)).to(self.device).eval()
        # 40 MiB of weights it holds on its device: measured the same on a GPU (tensors
        # on CUDA) as on a CPU (at least the package's bytes, padding.bin)
        self.ballast = torch.nn.Linear(2560, 4096, bias=False).to(self.device)

    async def preprocess(self, request):
        return torch.tensor(request.json()["x"], dtype=torch.float32)

    def predict(self, batch):
        with torch.no_grad():
            return self.net(torch.stack(batch).to(self.device)).cpu().tolist()
'''


def package(root: Path, name: str) -> None:
    folder = root / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(textwrap.dedent(f'''
        name = "{name}"
        entrypoint = "handler:Net"
        device = "cuda"
        memory_estimate_mb = 40
    '''))
    (folder / "handler.py").write_text(HANDLER)
    (folder / "padding.bin").write_bytes(b"\0" * 40 * MiB)  # measured size on a CPU


async def infer(host: ModelHost, name: str) -> list[float]:
    loaded, _ = await host.ensure(name, "1")
    result, _ = await handle_request(loaded.handler, loaded.batcher,
                                     Request(b'{"x": ' + str([0.1] * 512).encode() + b"}",
                                             "application/json"))
    return list(result)


async def test_demote_promote_round_trip_keeps_outputs(tmp_path: Path) -> None:
    package(tmp_path, "a")
    package(tmp_path, "b")
    # Room for one model on the "device" (the first load also pays torch's lazy set-up).
    host = ModelHost(RuntimeSettings(device_budget_bytes=70 * MiB, host_budget_bytes=200 * MiB),
                     LocalStore(tmp_path))
    before = await infer(host, "a")
    await infer(host, "b")
    assert host.tier_of("a", "1") == "host"
    loaded = host.loaded("a", "1")
    assert loaded is not None  # the same object, demoted: no reload happened
    assert all(p.device.type == "cpu" for p in loaded.handler.net.parameters())
    assert await infer(host, "a") == before
    import torch  # here, not at the top: ~2 s of every test collection

    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert loaded.handler.device == expected_device
    assert [load.source for load in host.stats().loads] == ["repository", "repository", "host"]
    await host.close()
