"""The parts publishing rests on: who may publish, versions written whole and never
replaced (a local folder and an fsspec store), and a refresher that scans at once."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import fsspec
import pytest

from modelfleet.errors import PackageRejected, VersionExists
from modelfleet.publishing.package import Package
from modelfleet.publishing.validate import next_version, resolve
from modelfleet.repository import Catalog, FsspecStore, LocalStore
from modelfleet.repository.refresher import CatalogRefresher
from modelfleet.tenancy.access import Principal
from modelfleet.tenancy.keys import Role
from modelfleet.tenancy.plans import BUILTIN
from modelfleet.tenancy.store import Tenant

MANIFEST = b'name = "acme-m"\nentrypoint = "handler:M"\ntenant = "acme"\n'
FILES = {"model.toml": MANIFEST, "handler.py": b"x = 1\n", "weights/a.bin": b"\1\2"}


def principal(role: Role, tenant: str = "acme") -> Principal:
    return Principal("0123456789ab", role, Tenant(tenant, "free"), BUILTIN["free"])


@pytest.mark.parametrize(("role", "model", "owner", "may"), [
    ("operator", "acme-new", None, True),       # a new model under its prefix
    ("operator", "acmenew", None, False),       # the prefix is the name and a dash
    ("operator", "other-new", None, False),
    ("operator", "banner", "acme", True),       # its tenant's model, whatever its name
    ("operator", "acme-taken", "other", False),  # another tenant's, even under acme-
    ("caller", "acme-new", None, False),
    ("caller", "banner", "acme", False),
    ("admin", "anything", "other", True),
    ("admin", "anything", None, True),
])
def test_who_may_publish(role: Role, model: str, owner: str | None, may: bool) -> None:
    assert principal(role).may_publish(model, owner) is may


def test_the_next_version_follows_the_highest_whole_number() -> None:
    assert next_version([]) == "1"
    assert next_version(["1", "2", "10", "beta"]) == "11"
    assert next_version(["beta"]) == "1"


def test_a_version_that_is_not_one_is_refused_before_anything() -> None:
    with pytest.raises(PackageRejected, match="is not one"):
        resolve(Package(FILES), "acme-m", '1" \n[x]', [])
    with pytest.raises(PackageRejected, match="is not one"):
        resolve(Package(FILES), "acme-m", "../2", [])


def test_a_local_store_adds_a_version_whole_and_never_replaces_one(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.write_package("acme-m", "1", FILES)
    assert store.versions("acme-m") == ["1"]
    assert (tmp_path / "acme-m" / "1" / "weights" / "a.bin").read_bytes() == b"\1\2"
    with pytest.raises(VersionExists):
        store.write_package("acme-m", "1", {**FILES, "handler.py": b"changed"})
    assert (tmp_path / "acme-m" / "1" / "handler.py").read_bytes() == b"x = 1\n"
    # Nothing of a write is left beside the versions (the staging folder was renamed).
    assert sorted(p.name for p in (tmp_path / "acme-m").iterdir()) == ["1"]


def test_an_fsspec_store_adds_a_version_with_its_manifest_and_never_replaces_one(
        tmp_path: Path) -> None:
    url = f"memory://publish-{uuid.uuid4().hex[:8]}"
    store = FsspecStore(url, tmp_path / "cache", 1 << 20)
    assert store.versions("acme-m") == []
    store.write_package("acme-m", "1", FILES)
    store.write_package("acme-m", "2", FILES)
    assert store.versions("acme-m") == ["1", "2"]
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    assert fs.cat_file(f"/{root}/acme-m/2/weights/a.bin") == b"\1\2"
    with pytest.raises(VersionExists):
        store.write_package("acme-m", "2", FILES)
    folder, _ = store.materialize("acme-m", "2")
    assert (folder / "model.toml").read_bytes() == MANIFEST


async def test_refresh_now_returns_once_a_scan_started_after_it_is_installed(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    catalog = Catalog.from_store(store)
    refresher = CatalogRefresher(store, catalog, 3600)
    running = asyncio.create_task(refresher.run())
    try:
        store.write_package("acme-m", "1", {**FILES, "model.toml": b'version = "1"\n'
                                            + MANIFEST})
        change = await refresher.refresh_now()
        assert change.added == ("acme-m",)
        assert "acme-m" in catalog
        # Two callers at once share one scan, which finds nothing new.
        first, second = await asyncio.gather(refresher.refresh_now(), refresher.refresh_now())
        assert not first and not second
    finally:
        running.cancel()


async def test_a_failed_scan_is_the_waiting_callers_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    catalog = Catalog.from_store(store)

    class Unreachable(LocalStore):
        def manifest_stamps(self):  # type: ignore[no-untyped-def]
            raise ConnectionError("the bucket is away")

    refresher = CatalogRefresher(Unreachable(tmp_path), catalog, 3600)
    running = asyncio.create_task(refresher.run())
    try:
        with pytest.raises(ConnectionError, match="the bucket is away"):
            await refresher.refresh_now()
    finally:
        running.cancel()
