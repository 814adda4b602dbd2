"""Repository tiers: a remote fsspec repository behind a bounded local disk cache."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from modelfleet.errors import ConfigError, ManifestError, ModelNotFound
from modelfleet.repository import Catalog, FsspecStore, LocalStore, open_store
from modelfleet.runtime.host import ModelHost
from modelfleet.settings import RuntimeSettings
from tests.procs import EXAMPLES


def remote_repo(*models: str) -> str:
    """A repository in fsspec's in-memory filesystem, standing in for s3:// or gs://."""
    fs = fsspec.filesystem("memory")
    root = f"/repo-{uuid.uuid4().hex[:8]}"
    for model in models:
        for path in (EXAMPLES / model / "1").rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                fs.pipe(f"{root}/{model}/1/{path.relative_to(EXAMPLES / model / '1')}",
                        path.read_bytes())
    return f"memory://{root}"


def test_remote_packages_are_fetched_once_then_served_from_disk(tmp_path: Path) -> None:
    store = FsspecStore(remote_repo("banner", "iris"), tmp_path / "cache", 10 * 2**20)
    catalog = Catalog.from_store(store)
    assert {e.model_id for e in catalog} == {"banner", "iris"}
    first, source = store.materialize("banner", "1")
    assert source == "repository" and (first / "model.toml").is_file()
    again, source = store.materialize("banner", "1")
    assert (again, source) == (first, "disk")
    with pytest.raises(ModelNotFound):
        store.materialize("nope", "1")


def test_disk_cache_is_bounded(tmp_path: Path) -> None:
    url = remote_repo("banner", "iris")
    banner_bytes = sum(p.stat().st_size for p in (EXAMPLES / "banner" / "1").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    store = FsspecStore(url, tmp_path / "cache", banner_bytes + 100)
    store.materialize("banner", "1")
    store.materialize("iris", "1")  # does not fit beside banner: banner goes
    assert not (tmp_path / "cache" / "banner" / "1").exists()
    assert (tmp_path / "cache" / "iris" / "1" / "model.toml").exists()
    assert store.materialize("banner", "1")[1] == "repository"


async def test_loads_record_their_source(tmp_path: Path) -> None:
    store = FsspecStore(remote_repo("banner"), tmp_path / "cache", 10 * 2**20)
    host = ModelHost(RuntimeSettings(), store)
    await host.ensure("banner", "1")
    await host.evict("banner")
    await host.ensure("banner", "1")
    assert [load.source for load in host.stats().loads] == ["repository", "disk"]
    await host.close()


def test_open_store_and_errors(tmp_path: Path) -> None:
    assert isinstance(open_store(str(EXAMPLES), tmp_path, 1), LocalStore)
    assert isinstance(open_store("memory://x", tmp_path, 1), FsspecStore)
    with pytest.raises(ConfigError, match="not a folder"):
        open_store(str(tmp_path / "missing"), tmp_path, 1)
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "iris", repo / "other")
    with pytest.raises(ManifestError, match="must match its folder"):
        Catalog.from_store(LocalStore(repo))


def test_a_refresh_reports_invalid_manifests_and_keeps_the_rest(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "iris", repo / "iris")
    catalog = Catalog.from_store(LocalStore(repo))
    shutil.copytree(EXAMPLES / "banner", repo / "banner")
    (repo / "bad" / "1").mkdir(parents=True)
    (repo / "bad" / "1" / "model.toml").write_text('name = "bad"\nentrypoint = "x"\n')
    with pytest.raises(ManifestError):
        Catalog.from_store(LocalStore(repo))  # strict: start-up refuses
    reported: list[ManifestError] = []
    fresh = Catalog.from_store(LocalStore(repo), on_invalid=reported.append)
    assert [e.field for e in reported] == ["entrypoint"]
    shutil.rmtree(repo / "iris")
    fresh = Catalog.from_store(LocalStore(repo), on_invalid=reported.append)
    assert catalog.replace_with(fresh) == (["banner"], ["iris"])
    assert [e.model_id for e in catalog] == ["banner"]


def test_a_model_whose_manifest_an_edit_broke_keeps_serving(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "iris", repo / "iris")
    catalog = Catalog.from_store(LocalStore(repo))
    manifest = repo / "iris" / "1" / "model.toml"
    manifest.write_text(manifest.read_text().replace("tenant =", "tenant_typo ="))
    broken: list[ManifestError] = []
    fresh = Catalog.from_store(LocalStore(repo), on_invalid=broken.append)
    assert [e.field for e in broken] == ["tenant_typo"]
    from modelfleet.repository.catalog import model_of_location

    keep = frozenset(model_of_location(e.path) for e in broken)
    assert catalog.replace_with(fresh, keep=keep) == ([], [])
    assert catalog.get("iris").manifest.tenant == "examples"
