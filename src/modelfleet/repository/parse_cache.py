"""Parsed manifests kept across starts, in the deployment's state dir.

Start-up validates every manifest of the repository (an invalid one stops it). At
100,000 packages that was ~20 s of CPU, nearly all of it reading and parsing TOML
(measured: ``bench/catalog_scale.py``). A manifest whose stamp
(``ModelStore.manifest_stamps``: mtime_ns, ctime_ns, size and inode of a local file;
the listing's etag or mtime and size on an object store) is the one it had when an
earlier start or refresh parsed it says what it said then, so the cache keeps, per
location, the stamp's digest and the validated manifest, and start-up parses only the
others (``Catalog.from_store(store, known=cache.load())``).

Why it never serves a stale manifest:

- a stamp that differs, and an empty one (a file changed within the settling window,
  a store that cannot tell), is parsed afresh; the stamp changes with any write;
- only a manifest parsed from the very stamp it is kept under is written
  (``Catalog.known``): an invalid edit, which keeps its last good version in a running
  catalog, is not;
- the file names the code that validated it (``fingerprint``: the sources of the
  manifest schema and the catalog, pydantic's and Python's versions) and the
  repository: another code's or repository's cache is not used.

A file that cannot be read back whole (truncated, corrupted, another format: its
digest says so) is ignored with a warning, and the start that ignored it writes a new
one. Writes are atomic (a temporary file renamed over the old one), so processes that
share a state dir each write a whole file and the last one stays.

The format is pickle (loading 100,000 manifests: ~0.3 s, where JSON and re-validation
would cost seconds), read with an unpickler that resolves the manifest's own classes
and nothing else: a file can build manifests, and make no other call.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

import pydantic

from modelfleet.repository import catalog as catalog_module
from modelfleet.repository import manifest as manifest_module
from modelfleet.repository.manifest import Batching, Fanout, Isolation, Manifest, TensorSpec

log = logging.getLogger("modelfleet")

Known = Mapping[str, tuple[int, Manifest]]  # location -> (stamp digest, manifest)

_MAGIC = b"modelfleet-manifests-1\n"
_DIGEST_BYTES = 32
_CLASSES = {(cls.__module__, cls.__qualname__): cls
            for cls in (Manifest, Batching, Isolation, Fanout, TensorSpec)}


def fingerprint() -> str:
    """What the cached manifests' validity depends on besides their files: the code
    that parsed and validated them."""
    digest = hashlib.blake2b(digest_size=16)
    for module in (manifest_module, catalog_module):
        digest.update(Path(str(module.__file__)).read_bytes())
    digest.update(f"{pydantic.VERSION} {sys.version}".encode())
    return digest.hexdigest()


class _ManifestsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        found = _CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a manifest class")
        return found


class ManifestCache:
    """One repository's parsed manifests in one file under ``folder``."""

    def __init__(self, folder: Path, repo: str) -> None:
        self._repo = repo
        # One file per repository: a state dir shared by deployments of several.
        name = hashlib.blake2b(repo.encode(), digest_size=8).hexdigest()
        self.path = folder / f"manifests-{name}.pickle"
        self._fingerprint = fingerprint()

    def load(self) -> dict[str, tuple[int, Manifest]]:
        """The manifests kept (location -> (stamp digest, manifest)); none if there is
        no file, or one that is not whole and this code's and repository's."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("repository: cannot read the manifest cache %s (%s): parsing "
                        "every manifest", self.path, exc.strerror)
            return {}
        try:
            return self._decoded(data)
        except Exception as exc:  # whatever a damaged file raises: ignored, rebuilt
            log.warning("repository: ignoring the manifest cache %s (%s); it is rebuilt "
                        "by this start", self.path, exc)
            return {}

    def _decoded(self, data: bytes) -> dict[str, tuple[int, Manifest]]:
        head = len(_MAGIC) + _DIGEST_BYTES
        if not data.startswith(_MAGIC) or len(data) < head:
            raise ValueError("not a manifest cache")
        payload = memoryview(data)[head:]
        if hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest() != data[len(_MAGIC):head]:
            raise ValueError("damaged: its digest does not match")
        fingerprint_, repo, known = _ManifestsOnly(io.BytesIO(payload)).load()
        if fingerprint_ != self._fingerprint or repo != self._repo:
            log.info("repository: the manifest cache %s was made by other code or for "
                     "another repository; rebuilt by this start", self.path)
            return {}
        if not isinstance(known, dict) or not all(
                isinstance(location, str) and isinstance(entry, tuple) and len(entry) == 2
                and isinstance(entry[0], int) and isinstance(entry[1], Manifest)
                for location, entry in known.items()):
            raise ValueError("not a table of manifests")
        return known

    def save(self, known: Known) -> None:
        """Keep ``known`` (``Catalog.known``), replacing the file whole; a failure to
        write is logged (the next start parses more), never raised."""
        payload = pickle.dumps((self._fingerprint, self._repo, dict(known)),
                               protocol=pickle.HIGHEST_PROTOCOL)
        digest = hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest()
        staging = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(staging, "wb") as file:
                file.write(_MAGIC + digest)
                file.write(payload)
            os.replace(staging, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                staging.unlink()
            log.warning("repository: cannot write the manifest cache %s (%s)", self.path,
                        exc.strerror)
