"""What a gateway's start-up imports: the launcher leaves the worker's parts and httpx
to the processes that use them (a gateway over 100,000 models starts in seconds, and
each import is CPU before it is ready)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_gateway_launcher_imports_no_worker_and_no_http_client() -> None:
    probe = ("import json, sys; import modelfleet.cli; from modelfleet import launch; "
             "print(json.dumps(sorted(m for m in sys.modules if m == 'httpx' "
             "or m.startswith('modelfleet.worker.'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == []
