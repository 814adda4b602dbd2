"""A real ``modelfleet serve`` over a repository of 3,000 packages (embedded broker):
a cold model among them answers, ``/v1/models`` pages through every one of them, and
the fleet summary and the repository index stay bounded while the catalog is large."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from modelfleet.gateway.pages import DEFAULT_LIMIT
from tests.procs import EXAMPLES, Proc, serve

COUNT = 3000
BANNER = EXAMPLES / "banner" / "1"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str, Path]]:
    root = tmp_path_factory.mktemp("catalog")
    repo = root / "repo"
    manifest = (BANNER / "model.toml").read_text()
    for i in range(COUNT):
        folder = repo / f"m{i:05d}" / "1"
        folder.mkdir(parents=True)
        (folder / "model.toml").write_text(manifest.replace('name = "banner"',
                                                            f'name = "m{i:05d}"'))
        (folder / "handler.py").symlink_to(BANNER / "handler.py")
    proc, base = serve(root, repo=repo, env={"MODELFLEET_REPO_REFRESH_S": "1",
                                             "MODELFLEET_GATEWAY__FLEET_SUMMARY_MODELS": "5"})
    try:
        yield proc, base, repo
    finally:
        proc.stop()


def test_a_cold_model_deep_in_the_catalog_is_served(served: tuple[Proc, str, Path]) -> None:
    _, base, _ = served
    response = httpx.post(f"{base}/v1/models/m02718/infer", content=b"deep in the tail",
                          headers={"content-type": "text/plain"}, timeout=60)
    assert response.status_code == 200, response.text
    assert "deep in the tail" in response.text and response.headers["x-model-cold"] == "1"


def test_v1_models_pages_through_all_of_them(served: tuple[Proc, str, Path]) -> None:
    _, base, _ = served
    first = httpx.get(f"{base}/v1/models", timeout=30).json()
    assert len(first["models"]) == DEFAULT_LIMIT and first["next_cursor"]
    names: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
        body = httpx.get(f"{base}/v1/models", params=params, timeout=30).json()
        names += [m["name"] for m in body["models"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and names == [f"m{i:05d}" for i in range(COUNT)]
    bad = httpx.get(f"{base}/v1/models", params={"cursor": "nonsense"}, timeout=30)
    assert bad.status_code == 400 and "cursor" in bad.json()["error"]["message"]


def test_the_summary_and_the_index_stay_bounded(served: tuple[Proc, str, Path]) -> None:
    _, base, _ = served
    for i in range(0, 40, 4):  # ten more models warm and in demand
        response = httpx.post(f"{base}/v1/models/m{i:05d}/infer", content=b"hi",
                              headers={"content-type": "text/plain"}, timeout=60)
        assert response.status_code == 200, response.text
    for _ in range(100):  # the worker's state event comes every second or so
        summary = httpx.get(f"{base}/v1/fleet/summary", timeout=30).json()
        (worker,) = summary["workers"]
        if worker["counts"]["device"] >= 8:
            break
        time.sleep(0.2)
    assert len(worker["resident"]["device"]) == 5 and worker["counts"]["device"] >= 8
    assert len(summary["queues"]) <= 5
    assert summary["queues_omitted"]["queues"] >= 3  # the tail, as counts
    assert len(json.dumps(summary)) < 64 * 1024
    index = httpx.post(f"{base}/v2/repository/index", timeout=30)
    assert len(index.json()) == DEFAULT_LIMIT and index.headers["x-next-cursor"]


def test_a_package_added_to_the_large_repository_is_picked_up(
        served: tuple[Proc, str, Path]) -> None:
    proc, base, repo = served
    folder = repo / "zz-new" / "1"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text((BANNER / "model.toml").read_text().replace(
        'name = "banner"', 'name = "zz-new"'))
    (folder / "handler.py").symlink_to(BANNER / "handler.py")
    # Refreshes are spaced by 50x the CPU the last one cost (3,000 manifests: seconds on a
    # loaded machine), and a file younger than 2 s is read again at the next one: allow
    # for two spaced refreshes, not a fixed count of polls.
    response = None
    until = time.monotonic() + 120
    while time.monotonic() < until:
        response = httpx.post(f"{base}/v1/models/zz-new/infer", content=b"new",
                              headers={"content-type": "text/plain"}, timeout=60)
        if response.status_code != 404:
            break
        time.sleep(0.2)
    assert response is not None and response.status_code == 200, response.text
    assert "1 added (zz-new)" in proc.log()
