"""Which code each process loads: the import directions README's layout table promises.

Each check imports one side in a fresh interpreter and lists what came with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import ROOT


def loaded_with(module: str, block: str = "") -> set[str]:
    """The modelfleet modules (and numpy, if it came) that importing ``module`` loads."""
    code = f"""
import json, sys
class Block:
    def find_spec(self, name, path, target=None):
        if {block!r} and (name == {block!r} or name.startswith({block!r} + ".")):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import {module}
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("modelfleet", "numpy")))))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def test_the_worker_loads_no_runtime_model_host_or_cache() -> None:
    loaded = loaded_with("modelfleet.worker.coordinator")
    assert "modelfleet.ipc.protocol" in loaded and "modelfleet.ipc.socket_runtime" in loaded
    assert not {m for m in loaded if m.startswith(("modelfleet.runtime", "modelfleet.cache"))}


def test_the_gateway_loads_no_worker_runtime_or_cache() -> None:
    loaded = loaded_with("modelfleet.gateway.app")
    assert not {m for m in loaded
                if m.startswith(("modelfleet.worker", "modelfleet.runtime", "modelfleet.cache"))}


@pytest.mark.parametrize("module", ["modelfleet", "modelfleet.runtime.server"])
def test_a_runtime_without_numpy_starts(module: str) -> None:
    """An isolated model's environment holds what it pins, and numpy need not be there."""
    assert "numpy" not in loaded_with(module, block="numpy")


def test_the_model_api_imports_no_web_framework_broker_or_runtime() -> None:
    code = ("import sys, modelfleet.model; print(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn', 'aio_pika') "
            "or m.startswith(('modelfleet.runtime', 'modelfleet.broker'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
