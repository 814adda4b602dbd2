"""Model stores: the repository tier, and the bounded local disk cache in front of remote ones.

A repository holds ``<root>/<model>/<version>/model.toml`` plus the handler and its
artifacts. ``LocalStore`` serves a folder in place. ``FsspecStore`` serves any fsspec
URL (``s3://``, ``gs://``, ``memory://``, ...) by copying a package into a local disk
cache on first use; the cache is bounded in bytes and evicts least-recently-used
packages that are not in use.

A catalog refresh reads only what changed: ``manifest_stamps`` lists every manifest
with a stamp that changes whenever the file does (an empty stamp: cannot tell, read it
again), and ``read_manifest`` reads one.

Publishing writes through ``PackageWriter`` (both stores are one): ``versions`` lists a
model's versions and ``write_package`` adds one, never replacing a version that exists
(``VersionExists``). A version appears whole or not at all to a catalog scan: a local
folder is written beside the model's versions under a hidden name and renamed into
place; an object store gets the manifest last, after every other file (a scan lists
manifests only).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal, Protocol, cast, runtime_checkable

from modelfleet.errors import (
    ConfigError,
    ManifestError,
    ModelLoadFailed,
    ModelNotFound,
    RepositoryUnavailable,
    VersionExists,
)

Source = Literal["repository", "disk"]
_DONE = ".modelfleet-complete"
# A file changed this recently may change again within the same mtime tick: its stamp
# is left empty (read again next time) until it has settled.
SETTLE_S = 2.0
# What an fsspec listing says about a file that changes when its content does.
_FSSPEC_STAMP_KEYS = ("ETag", "etag", "md5Hash", "md5", "generation", "mtime",
                      "LastModified", "last_modified", "updated", "created")


class ModelStore(Protocol):
    def manifest_stamps(self) -> Iterator[tuple[str, str]]:
        """(location, stamp) of every ``<model>/<version>/model.toml``: the stamp changes
        whenever the file does; an empty one means "cannot tell: read it"."""
        ...

    def read_manifest(self, location: str) -> str:
        """The TOML text at a location ``manifest_stamps`` gave (``ManifestError``)."""
        ...

    def materialize(self, model_id: str, version: str) -> tuple[Path, Source]:
        """A local folder holding the package, and where its bytes came from."""
        ...


@runtime_checkable
class PackageWriter(Protocol):
    """A repository that takes new versions (``modelfleet push``, load with files)."""

    def versions(self, model_id: str) -> list[str]:
        """The versions of ``model_id`` whose manifest is in the repository."""
        ...

    def write_package(self, model_id: str, version: str, files: Mapping[str, bytes]) -> None:
        """Add ``<model>/<version>/`` with ``files`` (relative paths, checked by the
        caller); ``VersionExists`` if it is there, ``RepositoryUnavailable`` if the
        write failed (nothing of it is then visible to a scan)."""
        ...


def _exists(model_id: str, version: str, where: str) -> VersionExists:
    return VersionExists(f"model '{model_id}' has a version '{version}' in {where} "
                         "already: a version never changes once published (publish "
                         "another version, or leave the version out to get the next one)")


Folders = dict[str, tuple[int, tuple[str, ...]]]  # model -> (folder stamp, versions)


class LocalStore:
    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a folder")
        self.root = root
        # model -> (its folder's stamp, its version folders): a folder is listed again
        # only when its stamp moved (``folder_stamp``; None: listed before it settled).
        self._versions: dict[str, tuple[int | None, tuple[str, ...]]] = {}
        self._version_names: dict[tuple[str, ...], tuple[str, ...]] = {}

    def folders(self) -> Folders:
        """The model folders' listings the last walk took while they had settled (the
        folder's stamp with them): what a later start may take instead of listing a
        folder whose stamp is the same then (``seed_folders``)."""
        return cast(Folders, {model: seen for model, seen in self._versions.items()
                              if seen[0] is not None})

    def seed_folders(self, folders: Folders) -> None:
        """Take listings an earlier process's ``folders`` gave, before the first walk: a
        model folder whose stamp is the same now is not listed again."""
        if not self._versions:
            self._versions = dict(folders)

    def manifest_stamps(self) -> Iterator[tuple[str, str]]:
        # One listing of the root, then per model folder a stat: its versions are listed
        # again only when its stamp moved (a version folder came or went), so a refresh
        # costs two stats a package and opens no file. Paths are joined by hand, as
        # os.path.join joins these (no component is absolute or empty): 200,000 joins.
        root = str(self.root)
        prefix = os.path.join(root, "")
        settled = time.time() - SETTLE_S
        settled_ns = int(settled * 1e9)
        known_folders, version_names = self._versions, self._version_names
        listed: dict[str, tuple[int | None, tuple[str, ...]]] = {}
        for model in _folders(root):
            folder = prefix + model
            try:
                st = os.stat(folder)
            except OSError:
                continue
            stamp = folder_stamp(st)
            known = known_folders.get(model)
            if known is not None and known[0] == stamp:
                listed[model] = known
                versions = known[1]
            else:  # most models hold the same few version names: one tuple for them all
                found = tuple(_folders(folder))
                versions = version_names.setdefault(found, found)
                # Trusted later only if nothing can have changed it within this mtime
                # tick: a change after this listing then moves the stamp.
                listed[model] = (stamp if st.st_mtime_ns <= settled_ns else None, versions)
            for version in versions:
                path = f"{folder}/{version}/model.toml"
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                # ctime and inode in the stamp catch a copy that kept an old mtime.
                yield path, "" if st.st_mtime > settled else \
                    f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_size}:{st.st_ino}"
        self._versions = listed

    def read_manifest(self, location: str) -> str:
        # Bytes, decoded whole: a text-mode file's decoder and newline translation cost
        # more than the read at 100,000 manifests (measured). Line breaks are then
        # translated as text mode does (CR LF and a lone CR read as LF).
        try:
            text = _read_bytes(location).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(location, "(file)", f"cannot read: {exc}") from exc
        return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text

    def versions(self, model_id: str) -> list[str]:
        folder = self.root / model_id
        return [v for v in _folders(str(folder)) if (folder / v / "model.toml").is_file()]

    def write_package(self, model_id: str, version: str, files: Mapping[str, bytes]) -> None:
        folder = self.root / model_id
        final = folder / version
        if (final / "model.toml").exists():
            raise _exists(model_id, version, str(self.root))
        staging = folder / f".{version}.publishing-{uuid.uuid4().hex[:12]}"
        try:
            for path, data in files.items():
                target = staging / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise RepositoryUnavailable(f"writing model '{model_id}' version {version} "
                                        f"to {self.root} failed: {exc.strerror}") from exc
        try:
            os.rename(staging, final)  # atomic; refused where a version's folder has files
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if final.exists():
                raise _exists(model_id, version, str(self.root)) from exc
            raise RepositoryUnavailable(f"writing model '{model_id}' version {version} "
                                        f"to {self.root} failed: {exc.strerror}") from exc

    def materialize(self, model_id: str, version: str) -> tuple[Path, Source]:
        package = self.root / model_id / version
        if not (package / "model.toml").is_file():
            raise ModelNotFound(f"model '{model_id}' version {version} is not in {self.root}")
        return package, "repository"


class FsspecStore:
    """A remote repository behind a bounded local disk cache."""

    def __init__(self, url: str, cache_dir: Path, cache_bytes: int) -> None:
        import fsspec

        try:
            self._fs, self._root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"model repository {url}: {exc}") from exc
        self.url = url
        self._cache_dir = cache_dir
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        cache_dir.mkdir(parents=True, exist_ok=True)

    def manifest_stamps(self) -> Iterator[tuple[str, str]]:
        # Remote filesystems cache listings with no expiry by default: list afresh. The
        # whole cache: invalidating the root drops its parents' listings, not the model
        # folders' below it, where a new version of a known model appears (s3fs, gcsfs).
        # One listing with details gives each file's info (etag, mtime...): no request
        # per file.
        self._fs.invalidate_cache()
        base = self._root.rstrip("/")
        found = self._fs.glob(f"{base}/*/*/model.toml", detail=True)
        assert isinstance(found, Mapping)
        for path in sorted(found):
            yield f"{self.url.rstrip('/')}/{path[len(base) + 1:]}", _fsspec_stamp(found[path])

    def read_manifest(self, location: str) -> str:
        path = f"{self._root.rstrip('/')}/{location[len(self.url.rstrip('/')) + 1:]}"
        try:
            return bytes(self._fs.cat_file(path)).decode("utf-8")
        except Exception as exc:  # fsspec backends raise their own errors
            raise ManifestError(location, "(file)", f"cannot read: {exc!r}") from exc

    def versions(self, model_id: str) -> list[str]:
        base = f"{self._root.rstrip('/')}/{model_id}"
        try:
            self._fs.invalidate_cache()
            found = self._fs.glob(f"{base}/*/model.toml")
        except Exception as exc:  # fsspec backends raise their own errors
            raise RepositoryUnavailable(f"listing {self.url}/{model_id} failed: "
                                        f"{exc!r}") from exc
        return sorted(str(path)[len(base) + 1:].split("/", 1)[0] for path in found)

    def write_package(self, model_id: str, version: str, files: Mapping[str, bytes]) -> None:
        remote = f"{self._root.rstrip('/')}/{model_id}/{version}"
        if version in self.versions(model_id):
            raise _exists(model_id, version, self.url)
        try:
            self._fs.pipe({f"{remote}/{path}": data for path, data in files.items()
                           if path != "model.toml"})
            self._fs.pipe_file(f"{remote}/model.toml", files["model.toml"])
        except Exception as exc:  # fsspec backends raise their own errors
            raise RepositoryUnavailable(f"writing model '{model_id}' version {version} "
                                        f"to {self.url} failed: {exc!r}") from exc
        finally:
            self._fs.invalidate_cache()

    def materialize(self, model_id: str, version: str) -> tuple[Path, Source]:
        local = self._cache_dir / model_id / version
        with self._lock:
            if (local / _DONE).exists():
                os.utime(local / _DONE)
                return local, "disk"
            remote = f"{self._root.rstrip('/')}/{model_id}/{version}"
            if not self._fs.exists(f"{remote}/model.toml"):
                raise ModelNotFound(f"model '{model_id}' version {version} is not in {self.url}")
            staging = local.with_name(f".{version}.partial-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            try:
                self._fs.get(remote + "/", str(staging), recursive=True)
            except Exception as exc:  # fsspec backends raise their own errors
                shutil.rmtree(staging, ignore_errors=True)
                raise ModelLoadFailed(
                    f"model '{model_id}': fetching {remote} failed: {exc!r}") from exc
            (staging / _DONE).touch()
            shutil.rmtree(local, ignore_errors=True)
            os.replace(staging, local)
            self._trim(keep=local)
            return local, "repository"

    def _trim(self, keep: Path) -> None:
        """Evict least-recently-used packages until the cache fits its byte budget."""
        packages = [p.parent for p in self._cache_dir.glob(f"*/*/{_DONE}")]
        sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in packages}
        total = sum(sizes.values())
        for package in sorted(packages, key=lambda p: (p / _DONE).stat().st_mtime):
            if total <= self._cache_bytes:
                return
            if package == keep:
                continue
            shutil.rmtree(package, ignore_errors=True)
            total -= sizes[package]


def _read_bytes(path: str) -> bytes:
    """The bytes of a file: four system calls for a small one, where ``open().read()``
    makes nine (its buffering asks fstat, isatty and the position first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while part := os.read(fd, 16384):
            parts.append(part)
    except OSError as exc:  # named, as open() names it
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        os.close(fd)
    return b"".join(parts)


def folder_stamp(st: os.stat_result) -> int:
    """A model folder's stamp: it moves when a version folder comes or goes (mtime), or
    when the folder is replaced or its mtime set back (ctime, inode). One int, the same
    in every process (a tuple of ints hashes the same everywhere)."""
    return hash((st.st_mtime_ns, st.st_ctime_ns, st.st_ino))


def _folders(path: str) -> list[str]:
    """The sub-folders of ``path`` (not hidden), sorted; none if it cannot be listed."""
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())
    except OSError:
        return []


def _fsspec_stamp(info: Mapping[str, object]) -> str:
    """A listing entry's stamp: what changes with the content, and the size; empty when
    the backend tells nothing that changes (read the file every time)."""
    known = [f"{key}={info[key]}" for key in _FSSPEC_STAMP_KEYS if info.get(key) is not None]
    return ";".join([*known, f"size={info.get('size')}"]) if known else ""


def store_folders(store: ModelStore) -> Folders | None:
    """The model folders' listings a store can hand a later start (a local one's)."""
    return store.folders() if isinstance(store, LocalStore) else None


def open_store(root: str, cache_dir: Path, cache_bytes: int) -> ModelStore:
    if "://" in root and not root.startswith("file://"):
        return FsspecStore(root, cache_dir, cache_bytes)
    return LocalStore(Path(root.removeprefix("file://")).expanduser().resolve())


