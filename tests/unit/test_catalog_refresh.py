"""Incremental catalog refreshes: only changed manifests are read, and what changed is said."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import fsspec
import pytest

from modelfleet.errors import ManifestError
from modelfleet.repository import Catalog, CatalogChange, FsspecStore, LocalStore
from modelfleet.repository.manifest import parse_manifest
from modelfleet.repository.store import SETTLE_S
from tests.procs import EXAMPLES

BANNER = (EXAMPLES / "banner" / "1" / "model.toml").read_text()


def package(repo: Path, name: str, version: str = "1", description: str = "") -> Path:
    folder = repo / name / version
    folder.mkdir(parents=True, exist_ok=True)
    text = BANNER.replace('name = "banner"', f'name = "{name}"') \
        .replace('version = "1"', f'version = "{version}"')
    if description:
        text = text.split("description =")[0] + f'description = "{description}"\n' \
            + text.split('No numpy, no artifact: the cheapest model to load."""\n')[1]
    manifest = folder / "model.toml"
    manifest.write_text(text)
    settle(manifest)
    return manifest


def settle(path: Path) -> None:
    """Date a file back past the settling window (a stamp is only trusted then)."""
    old = time.time() - SETTLE_S - 60 - len(path.read_text()) % 7
    os.utime(path, (old, old))


class CountingStore(LocalStore):
    """A real local store that counts the manifests read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: list[str] = []

    def read_manifest(self, location: str) -> str:
        self.read.append(Path(location).parent.parent.name)
        return super().read_manifest(location)


def refresh(catalog: Catalog, store: LocalStore,
            invalid: list[ManifestError] | None = None) -> CatalogChange:
    return catalog.apply(catalog.scan(store, None if invalid is None else invalid.append))


def test_an_unchanged_repository_is_stat_not_read(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        package(tmp_path, name)
    store = CountingStore(tmp_path)
    catalog = Catalog.from_store(store)
    assert sorted(store.read) == ["a", "b", "c"] and catalog.parses == 3
    store.read.clear()
    change = refresh(catalog, store)
    assert not change and change.generation == 0 and catalog.generation == 0
    assert store.read == [] and catalog.parses == 3


def test_added_changed_and_removed_packages_are_read_and_reported(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        package(tmp_path, name)
    store = CountingStore(tmp_path)
    catalog = Catalog.from_store(store)
    seen: list[CatalogChange] = []
    catalog.subscribe(seen.append)
    store.read.clear()
    package(tmp_path, "d")  # added
    package(tmp_path, "b", description="edited")  # changed
    shutil.rmtree(tmp_path / "c")  # removed
    package(tmp_path, "a", version="2")  # a new version of a
    change = refresh(catalog, store)
    assert sorted(store.read) == ["a", "b", "d"]  # only what changed was read
    assert (change.added, change.removed, change.changed) == (("d",), ("c",), ("a", "b"))
    assert change.generation == catalog.generation == 1 and seen == [change]
    assert [e.model_id for e in catalog] == ["a", "b", "d"] == list(catalog.ids())
    assert catalog.get("b").manifest.description == "edited"
    assert [m.version for m in catalog.get("a").versions] == ["1", "2"]
    store.read.clear()
    assert not refresh(catalog, store) and store.read == [] and seen == [change]


def test_an_edit_within_the_settling_window_is_read_again(tmp_path: Path) -> None:
    manifest = package(tmp_path, "a")
    store = CountingStore(tmp_path)
    catalog = Catalog.from_store(store)
    manifest.write_text(manifest.read_text().replace("timeout_s = 5", "timeout_s = 6"))
    store.read.clear()
    assert refresh(catalog, store).changed == ("a",)
    # Just written: the same mtime tick could hold another edit, so it is read again.
    manifest.write_text(manifest.read_text().replace("timeout_s = 6", "timeout_s = 7"))
    assert refresh(catalog, store).changed == ("a",)
    assert catalog.get("a").manifest.timeout_s == 7 and store.read == ["a", "a"]
    settle(manifest)
    store.read.clear()
    assert not refresh(catalog, store) and store.read == ["a"]  # settled now: once more
    assert not refresh(catalog, store) and store.read == ["a"]  # then never again


def test_a_broken_edit_keeps_the_last_good_version_and_is_reported(tmp_path: Path) -> None:
    manifest = package(tmp_path, "a")
    package(tmp_path, "b")
    catalog = Catalog.from_store(LocalStore(tmp_path))
    manifest.write_text(manifest.read_text().replace("tenant =", "tenant_typo ="))
    settle(manifest)
    broken: list[ManifestError] = []
    assert not refresh(catalog, LocalStore(tmp_path), broken)
    assert [e.field for e in broken] == ["tenant_typo"]
    assert catalog.get("a").manifest.tenant == "examples"
    (tmp_path / "new" / "1").mkdir(parents=True)
    (tmp_path / "new" / "1" / "model.toml").write_text('name = "new"\nentrypoint = "x"\n')
    assert not refresh(catalog, LocalStore(tmp_path), broken)  # never valid: left out
    assert "new" not in catalog and [e.field for e in broken][-1] == "entrypoint"
    with pytest.raises(ManifestError):  # without on_invalid (start-up) it raises
        Catalog.from_store(LocalStore(tmp_path))


def test_an_update_made_against_an_older_generation_is_refused(tmp_path: Path) -> None:
    package(tmp_path, "a")
    catalog = Catalog.from_store(LocalStore(tmp_path))
    package(tmp_path, "b")
    first, second = catalog.scan(LocalStore(tmp_path)), catalog.scan(LocalStore(tmp_path))
    catalog.apply(first)
    with pytest.raises(RuntimeError, match="older generation"):
        catalog.apply(second)


def test_pages_follow_the_id_order_and_skip_what_keep_refuses(tmp_path: Path) -> None:
    for i in range(7):
        package(tmp_path, f"m{i}")
    catalog = Catalog.from_store(LocalStore(tmp_path))
    entries, last = catalog.page(None, 3)
    assert [e.model_id for e in entries] == ["m0", "m1", "m2"] and last == "m2"
    entries, last = catalog.page("m2", 3)
    assert [e.model_id for e in entries] == ["m3", "m4", "m5"] and last == "m5"
    entries, last = catalog.page("m5", 3)
    assert [e.model_id for e in entries] == ["m6"] and last is None
    entries, last = catalog.page("m0", 2, keep=lambda e: e.model_id in ("m4", "m6"))
    assert [e.model_id for e in entries] == ["m4", "m6"] and last is None
    entries, last = catalog.page("m2a", 1)  # an id that is gone: the next one after it
    assert [e.model_id for e in entries] == ["m3"] and last == "m3"


def test_a_remote_store_is_listed_once_and_reads_only_what_changed(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    root = f"/refresh-{tmp_path.name}"
    for name in ("a", "b"):
        fs.pipe(f"{root}/{name}/1/model.toml",
                BANNER.replace('name = "banner"', f'name = "{name}"').encode())
    store = FsspecStore(f"memory://{root}", tmp_path / "cache", 2**20)
    reads: list[str] = []
    original = store.read_manifest

    def counted(location: str) -> str:
        reads.append(location.rsplit("/", 3)[-3])
        return original(location)

    store.read_manifest = counted  # type: ignore[method-assign]
    catalog = Catalog.from_store(store)
    assert sorted(reads) == ["a", "b"]
    reads.clear()
    assert not refresh(catalog, store) and reads == []
    time.sleep(0.01)  # the memory filesystem stamps a file by its creation time
    fs.pipe(f"{root}/b/1/model.toml",
            BANNER.replace('name = "banner"', 'name = "b"').replace("timeout_s = 5",
                                                                     "timeout_s = 9").encode())
    fs.rm(f"{root}/a", recursive=True)
    change = refresh(catalog, store)
    assert reads == ["b"] and change.removed == ("a",) and change.changed == ("b",)
    assert catalog.get("b").manifest.timeout_s == 9


def test_the_pinned_set_follows_the_manifests(tmp_path: Path) -> None:
    package(tmp_path, "a")
    pinned = package(tmp_path, "b")
    pinned.write_text(pinned.read_text() + "\n[fanout]\npinned = true\n")
    settle(pinned)
    catalog = Catalog.from_store(LocalStore(tmp_path))
    assert catalog.pinned() == {"b"}
    later = package(tmp_path, "c")
    later.write_text(later.read_text() + "\n[fanout]\npinned = true\n")
    settle(later)
    shutil.rmtree(tmp_path / "b")
    assert refresh(catalog, LocalStore(tmp_path)).removed == ("b",)
    assert catalog.pinned() == {"c"}


def test_a_model_folder_is_listed_again_only_when_it_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelfleet.repository import store as store_module

    for name in ("a", "b"):
        package(tmp_path, name)
    old = time.time() - SETTLE_S - 60
    for name in ("a", "b"):
        os.utime(tmp_path / name, (old, old))
    listed: list[str] = []
    folders = store_module._folders

    def counting(path: str) -> list[str]:
        listed.append(Path(path).name)
        return folders(path)

    monkeypatch.setattr(store_module, "_folders", counting)
    store = LocalStore(tmp_path)
    catalog = Catalog.from_store(store)
    assert sorted(listed) == sorted([tmp_path.name, "a", "b"])
    listed.clear()
    assert not refresh(catalog, store) and listed == [tmp_path.name]  # the root only
    package(tmp_path, "b", version="2")  # a new version folder: b's mtime moves
    assert refresh(catalog, store).changed == ("b",) and "b" in listed and "a" not in listed


def test_an_operators_override_serves_across_refreshes_until_taken_back(
        tmp_path: Path) -> None:
    from modelfleet.errors import ModelNotFound
    from modelfleet.repository.overrides import ConfigOverride, VersionPolicy

    package(tmp_path, "a", "1")
    package(tmp_path, "a", "2")
    store = LocalStore(tmp_path)
    catalog = Catalog.from_store(store)
    override = ConfigOverride(max_batch_size=4, versions=VersionPolicy("latest", latest=1))
    assert catalog.configure("a", override) and not catalog.configure("a", override)
    assert catalog.generation == 0  # not a refresh: a scan under way still installs
    served = catalog.get("a")
    assert [m.version for m in served.versions] == ["2"]
    assert served.manifest.batching.max_batch_size == 4
    with pytest.raises(ModelNotFound, match="version '1' is not served: the version policy"):
        served.version("1")
    assert [m.version for m in catalog.original("a").versions] == ["1", "2"]
    assert [e.manifest.batching.max_batch_size for e in catalog] == [4]
    package(tmp_path, "a", "2", description="edited")
    assert refresh(catalog, store).changed == ("a",)
    assert catalog.get("a").manifest.description == "edited"
    assert catalog.get("a").manifest.batching.max_batch_size == 4  # still overridden
    catalog.configure("a", None)
    assert [m.version for m in catalog.get("a").versions] == ["1", "2"]
    assert catalog.get("a").manifest.batching.max_batch_size == 1


@pytest.mark.parametrize("raw", [b'name = "a"\r\nversion = "1"\r\n', b'name = "a"\rversion = "1"\r',
                                 b'd = """x\r\ny\rz"""\n', "é = 'ü'\n".encode(), b""])
def test_a_local_manifest_reads_as_a_text_mode_file_reads(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "model.toml"
    path.write_bytes(raw)
    with open(path, encoding="utf-8") as file:
        assert LocalStore(tmp_path).read_manifest(str(path)) == file.read()


def test_a_manifest_that_is_not_utf8_is_reported_as_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(ManifestError, match="can't decode byte 0xff in position 8") as info:
        LocalStore(tmp_path).read_manifest(str(path))
    assert info.value.field == "(file)"


def test_a_manifest_that_cannot_be_read_is_reported_as_open_reports_it(
        tmp_path: Path) -> None:
    for path in (tmp_path / "gone.toml", tmp_path):  # missing; a folder
        with pytest.raises(OSError) as opened:
            open(path, "rb")
        with pytest.raises(ManifestError) as info:
            LocalStore(tmp_path).read_manifest(str(path))
        assert info.value.field == "(file)"
        assert info.value.problem == f"cannot read: {opened.value}"


def test_manifests_share_equal_values_and_say_what_their_files_say(tmp_path: Path) -> None:
    paths = [package(tmp_path, name) for name in ("a", "b", "c")]
    paths.append(package(tmp_path, "d", description="another"))
    catalog = Catalog.from_store(LocalStore(tmp_path))
    a, b, c, d = (catalog.get(name).manifest for name in "abcd")
    assert a.description is b.description is c.description and d.description == "another"
    assert a.accepts is b.accepts is c.accepts is d.accepts
    assert a.timeout_s is d.timeout_s and a.batching is d.batching
    for path, manifest in zip(paths, (a, b, c, d), strict=True):
        assert manifest == parse_manifest(path.read_text(), str(path))


def test_equal_field_values_are_shared_and_others_kept_apart() -> None:
    from modelfleet.repository.catalog import _Sharing

    def manifest(name: str, memory: str, description: str) -> str:
        return (f'name = "{name}"\nentrypoint = "handler:M"\nmemory_estimate_mb = {memory}\n'
                f'description = "{description}"\n')

    share = _Sharing()
    a, b, c, d = (share(parse_manifest(manifest(name, memory, text), f"/r/{name}/1/model.toml"))
                  for name, memory, text in (("a", "1", "x"), ("b", "2", "x"),
                                             ("c", "1.0", "y"), ("d", "2", "x")))
    assert (a.memory_estimate_mb, b.memory_estimate_mb, c.memory_estimate_mb) == (1, 2, 1)
    assert c.memory_estimate_mb is a.memory_estimate_mb  # 1.0 again, two values later
    assert d.memory_estimate_mb is b.memory_estimate_mb
    assert a.description is b.description is d.description and c.description == "y"
    assert a.__pydantic_fields_set__ is b.__pydantic_fields_set__ is c.__pydantic_fields_set__
    assert [m.name for m in (a, b, c, d)] == ["a", "b", "c", "d"]
