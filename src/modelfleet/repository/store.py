"""Model stores: the repository tier, and the bounded local disk cache in front of remote ones.

A repository holds ``<root>/<model>/<version>/model.toml`` plus the handler and its
artifacts. ``LocalStore`` serves a folder in place. ``FsspecStore`` serves any fsspec
URL (``s3://``, ``gs://``, ``memory://``, ...) by copying a package into a local disk
cache on first use; the cache is bounded in bytes and evicts least-recently-used
packages that are not in use.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

from modelfleet.errors import ConfigError, ModelLoadFailed, ModelNotFound

Source = Literal["repository", "disk"]
_DONE = ".modelfleet-complete"


class ModelStore(Protocol):
    def manifest_texts(self) -> Iterator[tuple[str, str]]:
        """(location, TOML text) of every ``<model>/<version>/model.toml``."""
        ...

    def materialize(self, model_id: str, version: str) -> tuple[Path, Source]:
        """A local folder holding the package, and where its bytes came from."""
        ...


class LocalStore:
    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a folder")
        self.root = root

    def manifest_texts(self) -> Iterator[tuple[str, str]]:
        for path in sorted(self.root.glob("*/*/model.toml")):
            yield str(path), path.read_text(encoding="utf-8")

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

    def manifest_texts(self) -> Iterator[tuple[str, str]]:
        # Remote filesystems cache listings with no expiry by default: list afresh. The
        # whole cache: invalidating the root drops its parents' listings, not the model
        # folders' below it, where a new version of a known model appears (s3fs, gcsfs).
        self._fs.invalidate_cache()
        for path in sorted(self._fs.glob(f"{self._root.rstrip('/')}/*/*/model.toml")):
            yield f"{self.url.rstrip('/')}/{path[len(self._root.rstrip('/')) + 1:]}", \
                self._fs.cat_file(path).decode("utf-8")

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


def open_store(root: str, cache_dir: Path, cache_bytes: int) -> ModelStore:
    if "://" in root and not root.startswith("file://"):
        return FsspecStore(root, cache_dir, cache_bytes)
    return LocalStore(Path(root.removeprefix("file://")).expanduser().resolve())


