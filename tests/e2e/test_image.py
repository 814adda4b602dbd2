"""The image: built here from Debian's and PyPI's packages (deploy/image/build.sh), run
with podman (or, where no OCI runtime may start a container here, its own file system,
user and entrypoint in a chroot), answering a request as a non-root user, its
healthcheck passing.

Skipped only where mmdebstrap and podman cannot be installed (the script exits 3).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.procs import EXAMPLES, ROOT, free_port
from tests.waiting import eventually_blocking

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
    chrooted: subprocess.Popen[bytes] | None = None
    mounted: list[Path] = []
    try:
        if started.returncode != 0 and "OCI permission denied" in started.stderr:
            # This machine is itself a container that may not set rlimits, which every
            # OCI runtime does (crun, runc): run the image's own file system, entrypoint
            # and user instead, in a chroot of a container podman made from the image.
            podman("rm", "--force", name)
            assert podman("create", "--name", name, IMAGE).returncode == 0
            root = Path(podman("mount", name).stdout.strip())
            shutil.copytree(EXAMPLES / "banner", root / "models" / "banner")
            for fs, where in (("proc", "proc"), ("tmpfs", "dev/shm"), ("tmpfs", "tmp")):
                (root / where).mkdir(parents=True, exist_ok=True)
                subprocess.run(["mount", "-t", fs, fs, str(root / where)], check=True)
                mounted.append(root / where)
            image = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
            config = image["Config"]
            assert config["User"] == "10001:10001" and config["Entrypoint"] == ["modelfleet"]
            env = [*config["Env"], "HOME=/home/modelfleet",
                   f"MODELFLEET_HEALTHCHECK_URL={base}/livez"]
            inside = ["chroot", "--userspec", config["User"], str(root), "/usr/bin/env", "-i",
                      *env]
            chrooted = subprocess.Popen([*inside, *config["Entrypoint"], "serve", "--repo",
                                         "/models", "--port", str(port)])
            run_inside = inside
            health_cmd = image["Healthcheck"]["Test"][1:]  # ["CMD", ...]
        else:
            assert started.returncode == 0, started.stderr
            run_inside = ["podman", "exec", name]
            health_cmd = []
        def ready() -> bool:
            try:
                return httpx.get(f"{base}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        eventually_blocking(ready, 90, what="the container ready", every_s=0.5,
                            state=lambda: podman("logs", name).stdout)
        answer = httpx.post(f"{base}/v1/models/banner/infer", content=b"from the image",
                            headers={"content-type": "text/plain"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert "< from the image >" in answer.text

        def inside_run(*cmd: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*run_inside, *cmd], capture_output=True, text=True,
                                  timeout=60, check=False)

        assert inside_run("id", "-u").stdout.strip() == "10001"  # not root
        assert inside_run("uv", "--version").stdout.startswith("uv ")
        if health_cmd:
            health = inside_run(*health_cmd)
        else:
            health = podman("healthcheck", "run", name)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        if chrooted is not None:
            chrooted.terminate()
            chrooted.wait(30)
        for where in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(where)], check=False)
        podman("rm", "--force", name)
