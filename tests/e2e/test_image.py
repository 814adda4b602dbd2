"""The image: built here from Debian's and PyPI's packages (deploy/image/build.sh), run
with podman, answering a request as a non-root user, its healthcheck passing.

Skipped only where mmdebstrap and podman cannot be installed (the script exits 3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.procs import EXAMPLES, ROOT, free_port

IMAGE = "localhost/modelfleet:test"


def podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


@pytest.mark.timeout(1800)
def test_the_image_builds_and_serves_a_request_as_non_root() -> None:
    built = subprocess.run(["bash", str(ROOT / "deploy" / "image" / "build.sh")],
                           env={**os.environ, "INSTALL": "1", "IMAGE": IMAGE,
                                "PYTHON": sys.executable},
                           capture_output=True, text=True, timeout=1700, check=False)
    if built.returncode == 3:
        pytest.skip(f"no mmdebstrap/podman here: {built.stderr.strip()}")
    assert built.returncode == 0, f"build failed:\n{built.stdout}\n{built.stderr}"

    name, port = f"modelfleet-test-{uuid.uuid4().hex[:8]}", free_port()
    base = f"http://127.0.0.1:{port}"
    started = podman("run", "--detach", "--name", name, "--network", "host",
                     "--env", f"MODELFLEET_HEALTHCHECK_URL={base}/livez",
                     "--volume", f"{EXAMPLES / 'banner'}:/models/banner:ro",
                     IMAGE, "serve", "--repo", "/models", "--port", str(port))
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, podman("logs", name).stdout
            time.sleep(0.5)
        answer = httpx.post(f"{base}/v1/models/banner/infer", content=b"from the image",
                            headers={"content-type": "text/plain"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert "< from the image >" in answer.text
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"  # not root
        assert podman("exec", name, "uv", "--version").stdout.startswith("uv ")
        health = podman("healthcheck", "run", name)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        podman("rm", "--force", name)
