"""The manifest cache: a start parses only the manifests no earlier start parsed at the
stamps they have now, never serves one a file no longer says, and shrugs off a damaged
cache file."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
import time
from pathlib import Path

import pytest

from modelfleet.errors import ManifestError
from modelfleet.launch import manifest_cache, open_repository
from modelfleet.repository import Catalog, LocalStore, parse_cache
from modelfleet.repository.parse_cache import ManifestCache
from modelfleet.repository.refresher import CatalogRefresher
from modelfleet.repository.store import SETTLE_S
from modelfleet.settings import Settings
from tests.unit.test_catalog_refresh import BANNER, CountingStore, package, settle

MODELS = 2000


def started(repo: Path, cache: ManifestCache) -> tuple[Catalog, CountingStore]:
    """One start-up's catalog, as ``open_repository`` makes it, and what it read."""
    store = CountingStore(repo)
    known, folders = cache.load_with_folders()
    store.seed_folders(folders)
    catalog = Catalog.from_store(store, known=known)
    if catalog.parses:
        cache.save(catalog.known(), store.folders())
    return catalog, store


def many(repo: Path, count: int) -> None:
    """``count`` packages, their stamps settled (written in one go, no settle per file)."""
    old = os.stat(package(repo, "m00000")).st_mtime
    for i in range(1, count):
        name = f"m{i:05d}"
        folder = repo / name / "1"
        folder.mkdir(parents=True)
        manifest = folder / "model.toml"
        manifest.write_text(BANNER.replace('name = "banner"', f'name = "{name}"'))
        os.utime(manifest, (old, old))


def test_a_second_start_parses_no_manifest_and_serves_the_same_catalog(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    many(repo, MODELS)
    cache = ManifestCache(tmp_path / "state", str(repo))
    first, store = started(repo, cache)
    assert first.parses == len(store.read) == MODELS and first.reused == 0
    second, store = started(repo, ManifestCache(tmp_path / "state", str(repo)))
    assert store.read == [] and second.parses == 0 and second.reused == MODELS
    assert list(second.ids()) == list(first.ids())
    assert [e.versions for e in second] == [e.versions for e in first]


def test_the_launchers_keep_the_cache_in_the_state_dir(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    many(repo, 50)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state")
    _, first = open_repository(settings, manifest_cache(settings))
    _, second = open_repository(settings, manifest_cache(settings))
    assert (first.parses, second.parses, second.reused) == (50, 0, 50)
    assert manifest_cache(settings).path.parent == tmp_path / "state" / "catalog"
    _, uncached = open_repository(settings)  # no cache given: every manifest parsed
    assert uncached.parses == 50


def test_a_changed_manifest_is_read_again_even_with_its_old_mtime(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        package(repo, name)
    cache = ManifestCache(tmp_path / "state", str(repo))
    started(repo, cache)
    package(repo, "b", description="edited")
    # Same size, mtime put back: only the ctime (and the inode of a rewrite) tell.
    same_size = repo / "c" / "1" / "model.toml"
    mtime_ns = os.stat(same_size).st_mtime_ns
    same_size.write_text(same_size.read_text().replace("timeout_s = 5", "timeout_s = 7"))
    os.utime(same_size, ns=(mtime_ns, mtime_ns))
    package(repo, "d")
    catalog, store = started(repo, cache)
    assert sorted(store.read) == ["b", "c", "d"] and catalog.reused == 1
    assert catalog.get("b").manifest.description == "edited"
    assert catalog.get("c").manifest.timeout_s == 7
    _, store = started(repo, cache)  # and the cache now holds the new ones
    assert store.read == []


def test_a_manifest_written_just_now_is_always_read(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    manifest = package(repo, "a")
    cache = ManifestCache(tmp_path / "state", str(repo))
    started(repo, cache)
    manifest.write_text(manifest.read_text().replace("timeout_s = 5", "timeout_s = 6"))
    # Within the settling window a stamp is not trusted: read, whatever the cache says.
    for _ in range(2):
        catalog, store = started(repo, cache)
        assert store.read == ["a"] and catalog.get("a").manifest.timeout_s == 6


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "empty"])
def test_a_damaged_cache_is_ignored_and_rebuilt(tmp_path: Path, damage: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        package(repo, name)
    cache = ManifestCache(tmp_path / "state", str(repo))
    started(repo, cache)
    data = cache.path.read_bytes()
    cache.path.write_bytes({"garbage": b"\x80\x05not a pickle at all",
                            "truncated": data[:len(data) // 2],
                            "flipped": data[:-20] + bytes([data[-20] ^ 1]) + data[-19:],
                            "empty": b""}[damage])
    with caplog.at_level(logging.WARNING, logger="modelfleet"):
        catalog, store = started(repo, cache)
    assert sorted(store.read) == ["a", "b"] and catalog.reused == 0
    assert [e.model_id for e in catalog] == ["a", "b"]
    assert "ignoring the manifest cache" in caplog.text
    _, store = started(repo, cache)  # rewritten whole by the start that ignored it
    assert store.read == []


def test_a_cache_file_can_build_manifests_and_call_nothing_else(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package(repo, "a")
    cache = ManifestCache(tmp_path / "state", str(repo))
    started(repo, cache)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    # A well-formed file (right header and digest) whose pickle calls os.system.
    payload = pickle.dumps(Payload())
    cache.path.write_bytes(parse_cache._MAGIC + hashlib.blake2b(
        payload, digest_size=parse_cache._DIGEST_BYTES).digest() + payload)
    catalog, store = started(repo, cache)
    assert not marker.exists() and store.read == ["a"] and catalog.reused == 0


def test_another_repositorys_cache_is_not_used(tmp_path: Path) -> None:
    for repo in ("one", "two"):
        package(tmp_path / repo, "a")
    one = ManifestCache(tmp_path / "state", str(tmp_path / "one"))
    two = ManifestCache(tmp_path / "state", str(tmp_path / "two"))
    started(tmp_path / "one", one)
    assert one.path != two.path
    two.path.write_bytes(one.path.read_bytes())  # one's file where two's belongs
    _, store = started(tmp_path / "two", two)
    assert store.read == ["a"]


def test_an_invalid_manifest_is_never_cached_and_still_stops_a_start(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    manifest = package(repo, "a")
    package(repo, "b")
    cache = ManifestCache(tmp_path / "state", str(repo))
    catalog, _ = started(repo, cache)
    manifest.write_text(manifest.read_text().replace("tenant =", "tenant_typo ="))
    settle(manifest)
    broken: list[ManifestError] = []
    catalog.apply(catalog.scan(LocalStore(repo), broken.append))
    assert [e.field for e in broken] == ["tenant_typo"]
    assert catalog.get("a").manifest.tenant == "examples"  # the last good one serves
    cache.save(catalog.known())  # what a refresh writes: not a's last good version
    with pytest.raises(ManifestError, match="tenant_typo"):
        started(repo, cache)


async def test_a_refresh_that_parsed_keeps_the_cache_current(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package(repo, "a")
    cache = ManifestCache(tmp_path / "state", str(repo))
    catalog, store = started(repo, cache)
    refresher = CatalogRefresher(store, catalog, 3600, cache)
    running = asyncio.create_task(refresher.run())
    try:
        package(repo, "b")
        assert (await refresher.refresh_now()).added == ("b",)
        # Written once the waiting callers are answered: the next refresh comes after.
        assert not await refresher.refresh_now()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    _, store = started(repo, cache)
    assert store.read == []


def test_the_cache_holds_manifests_by_location_and_stamp(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package(repo, "a")
    cache = ManifestCache(tmp_path / "state", str(repo))
    catalog, _ = started(repo, cache)
    known = cache.load()
    assert list(known) == [str(repo / "a" / "1" / "model.toml")]
    assert known == catalog.known()


def test_every_example_manifest_comes_back_from_the_cache_as_it_was_parsed(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    examples = sorted(Path(__file__).resolve().parents[2].glob("examples/models/*/1"))
    for example in examples:
        (repo / example.parent.name / "1").mkdir(parents=True)
        manifest = repo / example.parent.name / "1" / "model.toml"
        manifest.write_text((example / "model.toml").read_text())
        settle(manifest)
    cache = ManifestCache(tmp_path / "state", str(repo))
    first, _ = started(repo, cache)
    second, store = started(repo, ManifestCache(tmp_path / "state", str(repo)))
    assert store.read == [] and second.reused == len(examples) >= 10
    for parsed, cached in zip(first, second, strict=True):
        assert cached.versions == parsed.versions
        assert [m.model_fields_set for m in cached.versions] == \
            [m.model_fields_set for m in parsed.versions]


def _settle_folders(repo: Path) -> None:
    """Date the model folders back past the settling window, as a repository's are."""
    old = time.time() - SETTLE_S - 60
    for folder in repo.iterdir():
        os.utime(folder, (old, old))


def test_a_restart_lists_only_the_model_folders_that_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelfleet.repository import store as store_module

    repo = tmp_path / "repo"
    many(repo, 20)
    _settle_folders(repo)
    listed: list[str] = []
    folders = store_module._folders

    def counting(path: str) -> list[str]:
        listed.append(Path(path).name)
        return folders(path)

    monkeypatch.setattr(store_module, "_folders", counting)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state")
    _, first = open_repository(settings, manifest_cache(settings))
    assert first.parses == 20 and len(listed) == 21  # the root and every model folder
    listed.clear()
    _, second = open_repository(settings, manifest_cache(settings))
    assert listed == ["repo"] and second.reused == 20  # the root only
    # While no process ran: a version added to one model, another's version folder
    # replaced by one that holds a second version too, its mtime put back.
    package(repo, "m00003", version="2")
    mtime_ns = os.stat(repo / "m00007").st_mtime_ns
    package(repo, "m00007", version="3")
    os.utime(repo / "m00007", ns=(mtime_ns, mtime_ns))
    listed.clear()
    _, third = open_repository(settings, manifest_cache(settings))
    assert sorted(listed) == ["m00003", "m00007", "repo"]
    assert [m.version for m in third.get("m00003").versions] == ["1", "2"]
    assert [m.version for m in third.get("m00007").versions] == ["1", "3"]


def test_a_model_folder_listed_before_it_settled_is_not_kept(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        package(repo, name)
    old = time.time() - SETTLE_S - 60
    os.utime(repo / "a", (old, old))  # b's folder changed just now: the same mtime tick
    store = LocalStore(repo)         # may still change it, unseen by its mtime
    Catalog.from_store(store)
    assert list(store.folders()) == ["a"]
    cache = ManifestCache(tmp_path / "state", str(repo))
    started(repo, cache)
    assert list(cache.load_with_folders()[1]) == ["a"]
