"""What a runtime reports its models imported (``RuntimeHealth.frameworks``): the zygote
imports those for the next restart, and their memory is the runtime's overhead."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.procs import write_package

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter: this test process has imported torch long ago.
LOAD_ONE = textwrap.dedent('''
    import asyncio, json, sys
    from pathlib import Path
    from modelfleet.repository import LocalStore
    from modelfleet.runtime.host import ModelHost
    from modelfleet.settings import RuntimeSettings

    async def main():
        assert "torch" not in sys.modules
        host = ModelHost(RuntimeSettings(), LocalStore(Path(sys.argv[1])))
        loaded, _ = await host.ensure("wants-cuda", "1")
        print(json.dumps({"device": loaded.device, "frameworks": sorted(host.frameworks)}))
        await host.close()

    asyncio.run(main())
''')


def test_a_cuda_models_torch_import_counts_among_its_frameworks(tmp_path: Path) -> None:
    """Asking whether CUDA is there imports torch before the handler's own imports: that
    import is the model's, and the zygote must import torch for the restart (it did not:
    on a GPU, a restarted runtime imported torch afresh, seconds)."""
    write_package(tmp_path / "repo", "wants-cuda", '''
        name = "wants-cuda"
        version = "1"
        entrypoint = "handler:Plain"
        accepts = ["text/plain"]
        device = "cuda"
    ''', '''
        from modelfleet import Model

        class Plain(Model):
            def predict(self, batch):
                return batch
    ''')
    out = subprocess.run([sys.executable, "-c", LOAD_ONE, str(tmp_path / "repo")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" in seen["frameworks"]
    assert seen["device"] in ("cuda", "cpu")  # cpu where there is no CUDA device
