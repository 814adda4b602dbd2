"""Serving from an S3 API store: moto's S3 server on loopback, the real s3fs client.

``modelfleet serve --repo s3://bucket/models`` reads the catalog from the bucket and the
runtimes copy each package into the bounded local disk cache. The endpoint is the
standard ``AWS_ENDPOINT_URL_S3`` variable that botocore (under s3fs) reads itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import s3fs
from moto import server as moto_server

from tests.procs import EXAMPLES, serve
from tests.waiting import eventually_blocking

BUCKET = "fleet-models"


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A moto S3 server on a free loopback port; the environment that points s3fs at it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        yield env
    finally:
        server.stop()


def _upload(local: Path, remote: str) -> None:
    fs = s3fs.S3FileSystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    fs.put(str(local) + "/", remote, recursive=True)


def _banner(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/models/banner/infer", content=b"from the bucket",
                      headers={"content-type": "text/plain"}, timeout=30)


def _cached_versions(cache: Path) -> set[str]:
    return {p.parent.name for p in cache.glob("banner/*/.modelfleet-complete")}


def test_serves_from_s3_picks_up_a_new_version_and_bounds_the_disk_cache(
        tmp_path: Path, s3_env: dict[str, str]) -> None:
    _upload(EXAMPLES / "banner" / "1", f"{BUCKET}/models/banner/1")
    cache = tmp_path / "disk-cache"
    proc, base = serve(tmp_path, repo=f"s3://{BUCKET}/models", env={
        **s3_env, "MODELFLEET_REPO_REFRESH_S": "0.5",
        "MODELFLEET_RUNTIME__DISK_CACHE_DIR": str(cache),
        # Smaller than two packages: the newest stays, the one before it is evicted.
        "MODELFLEET_RUNTIME__DISK_CACHE_BYTES": "1"})
    try:
        first = _banner(base)
        assert first.status_code == 200, first.text
        assert "< from the bucket >" in first.text and "[o_o]" in first.text
        assert _cached_versions(cache) == {"1"}

        # Version 2, published by writing it to the bucket: served after a refresh.
        v2 = tmp_path / "banner-2"
        v2.mkdir()
        (v2 / "model.toml").write_text((EXAMPLES / "banner" / "1" / "model.toml").read_text()
                                       .replace('version = "1"', 'version = "2"'))
        (v2 / "handler.py").write_text((EXAMPLES / "banner" / "1" / "handler.py").read_text()
                                       .replace("[o_o]", "[^_^]"))
        _upload(v2, f"{BUCKET}/models/banner/2")
        def version_2() -> httpx.Response | None:
            answer = _banner(base)
            assert answer.status_code == 200, answer.text
            return answer if "[^_^]" in answer.text else None

        answer = eventually_blocking(version_2, 30, what="version 2 served", every_s=0.3,
                                     state=lambda: f"the log:\n{proc.log()}")
        assert answer.status_code == 200
        assert "< from the bucket >" in answer.text
        # The disk cache holds what its byte budget allows: version 1 went for version 2.
        assert _cached_versions(cache) == {"2"}
    finally:
        proc.stop()

