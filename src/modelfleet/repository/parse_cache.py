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
  manifest schema, its TOML reader and the catalog, pydantic's and Python's versions)
  and the repository: another code's or repository's cache is not used.

A file that cannot be read back whole (truncated, corrupted, another format: its
digest says so) is ignored with a warning, and the start that ignored it writes a new
one. Writes are atomic (a temporary file renamed over the old one), so processes that
share a state dir each write a whole file and the last one stays.

The format is a table, pickled: the distinct field values of all the manifests once
(``catalog._Sharing`` shares them the same way in a parse), and per manifest a row of
indices into them (an array), with the locations and the model names (one each) as one
string each and the stamps as one array. Pickling the manifests themselves was as fast
to load but kept a state dict per manifest alive until the load ended, between the
manifests that live on: the heap was left fragmented, +38 MB of RSS at 100,000
(measured). It is read with an unpickler that resolves the manifest's own classes and
nothing else: a file can build manifests and their parts, and make no other call.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import operator
import os
import pickle
import sys
import uuid
from array import array
from collections.abc import Mapping
from pathlib import Path

import pydantic

from modelfleet.repository import catalog as catalog_module
from modelfleet.repository import manifest as manifest_module
from modelfleet.repository import plain_toml
from modelfleet.repository import store as store_module
from modelfleet.repository.manifest import Batching, Fanout, Isolation, Manifest, TensorSpec
from modelfleet.repository.store import Folders  # model -> (folder stamp, versions)

log = logging.getLogger("modelfleet")

Known = Mapping[str, tuple[int, Manifest]]  # location -> (stamp digest, manifest)

_MAGIC = b"modelfleet-manifests-5\n"
_DIGEST_BYTES = 32
_CLASSES = {(cls.__module__, cls.__qualname__): cls
            for cls in (Manifest, Batching, Isolation, Fanout, TensorSpec)}


def fingerprint() -> str:
    """What the cached manifests' validity depends on besides their files: the code
    that parsed and validated them."""
    digest = hashlib.blake2b(digest_size=16)
    for module in (manifest_module, plain_toml, catalog_module, store_module):
        digest.update(Path(str(module.__file__)).read_bytes())
    digest.update(f"{pydantic.VERSION} {sys.version}".encode())
    return digest.hexdigest()


class _ManifestsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        found = _CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a manifest class")
        return found


def _index_of(value: object, index: dict[object, int], values: list[object]) -> int:
    """Where ``value`` is in ``values`` (one entry per equal value), added if new."""
    try:
        key: object = (type(value), value)
        at = index.setdefault(key, len(values))
    except TypeError:  # unhashable: one entry of its own
        at = len(values)
    if at == len(values):
        values.append(value)
    return at


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
        return self.load_with_folders()[0]

    def load_with_folders(self) -> tuple[dict[str, tuple[int, Manifest]], Folders]:
        """The manifests kept, and the model folders' listings kept with them
        (``LocalStore.folders``: a start then lists only the folders that changed)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}, {}
        except OSError as exc:
            log.warning("repository: cannot read the manifest cache %s (%s): parsing "
                        "every manifest", self.path, exc.strerror)
            return {}, {}
        try:
            return self._decoded(data)
        except Exception as exc:  # whatever a damaged file raises: ignored, rebuilt
            log.warning("repository: ignoring the manifest cache %s (%s); it is rebuilt "
                        "by this start", self.path, exc)
            return {}, {}

    def _decoded(self, data: bytes) -> tuple[dict[str, tuple[int, Manifest]], Folders]:
        head = len(_MAGIC) + _DIGEST_BYTES
        if not data.startswith(_MAGIC) or len(data) < head:
            raise ValueError("not a manifest cache")
        payload = memoryview(data)[head:]
        if hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest() != data[len(_MAGIC):head]:
            raise ValueError("damaged: its digest does not match")
        (fingerprint_, repo, joined, stamps, model_ids, names, values, field_sets, cells,
         folder_names, folder_stamps, version_sets, folder_versions) = \
            _ManifestsOnly(io.BytesIO(payload)).load()
        if fingerprint_ != self._fingerprint or repo != self._repo:
            log.info("repository: the manifest cache %s was made by other code or for "
                     "another repository; rebuilt by this start", self.path)
            return {}, {}
        if not (isinstance(joined, str) and isinstance(model_ids, str)
                and isinstance(folder_names, str) and isinstance(folder_stamps, bytes)
                and isinstance(folder_versions, bytes) and isinstance(version_sets, list)
                and all(isinstance(each, tuple) and all(isinstance(v, str) for v in each)
                        for each in version_sets)
                and isinstance(stamps, bytes)
                and isinstance(cells, bytes) and isinstance(values, list)
                and isinstance(field_sets, list)
                and all(isinstance(each, set) for each in field_sets)
                and isinstance(names, tuple)
                and {"name", *names} == set(Manifest.model_fields)):
            raise ValueError("not a table of manifests")
        locations = joined.split("\0") if joined else []
        ids = model_ids.split("\0") if model_ids else []
        digests, indices = array("Q"), array("I")
        digests.frombytes(stamps)
        indices.frombytes(cells)
        width = len(names) + 1  # the field set's index last
        if not len(locations) == len(ids) == len(digests) == len(indices) // width:
            raise ValueError("its columns differ in length")
        manifests: list[Manifest] = []
        # Rows repeat (manifests that differ in their names alone): each distinct row's
        # fields are looked up once, and copied into each manifest's own dict.
        templates: dict[bytes, tuple[dict[str, object], set[str]]] = {}
        row_bytes = width * indices.itemsize
        new, set_slot, append = Manifest.__new__, object.__setattr__, manifests.append
        for model_id, at in zip(ids, range(0, len(cells), row_bytes), strict=True):
            key = cells[at:at + row_bytes]
            template = templates.get(key)
            if template is None:
                row = indices[at // indices.itemsize:(at + row_bytes) // indices.itemsize]
                template = templates[key] = (
                    dict(zip(names, map(values.__getitem__, row), strict=False)),
                    field_sets[row[-1]])
            manifest = new(Manifest)  # what pickle does, less its state dicts
            fields: dict[str, object] = {"name": model_id}  # the schema's first field
            fields.update(template[0])
            set_slot(manifest, "__dict__", fields)
            set_slot(manifest, "__pydantic_fields_set__", template[1])
            set_slot(manifest, "__pydantic_extra__", None)
            set_slot(manifest, "__pydantic_private__", None)
            append(manifest)
        models = folder_names.split("\0") if folder_names else []
        folder_digests, listed = array("q"), array("I")
        folder_digests.frombytes(folder_stamps)
        listed.frombytes(folder_versions)
        folders = dict(zip(models, zip(folder_digests, map(version_sets.__getitem__, listed),
                                       strict=True), strict=True))
        return dict(zip(locations, zip(digests, manifests, strict=True), strict=True)), folders

    def save(self, known: Known, folders: Folders | None = None) -> None:
        """Keep ``known`` (``Catalog.known``) and the store's ``folders`` listings, if
        given (``LocalStore.folders``), replacing the file whole; a failure to write is
        logged (the next start parses more), never raised."""
        # NUL never occurs in a path: the locations travel as one string.
        joined = "\0".join(known)
        stamps = array("Q", (stamp for stamp, _ in known.values())).tobytes()
        # The names, one per manifest, as one string: not 100,000 entries in the table.
        model_ids = "\0".join(manifest.name for _, manifest in known.values())
        names = tuple(name for name in Manifest.model_fields if name != "name")
        values: list[object] = []
        index: dict[object, int] = {}
        field_sets: list[set[str]] = []
        set_index: dict[frozenset[str], int] = {}
        # The manifests of a scan share their equal values (catalog._Sharing): most
        # values are found by identity, with no hashing (a pydantic model hashes in
        # Python). Safe: ``known`` keeps every value alive, so no id is reused meanwhile.
        by_id: dict[int, int] = {}
        cells = array("I")
        # Most manifests' rows repeat (the same shared values, by identity): a row is
        # worked out once per distinct tuple of value ids, and copied after that.
        rows: dict[tuple[int, ...], array[int]] = {}
        field_values = operator.itemgetter(*names)
        for _, manifest in known.values():
            fields_set = manifest.__pydantic_fields_set__
            row_values = field_values(manifest.__dict__)
            key = (*map(id, row_values), id(fields_set))
            row = rows.get(key)
            if row is None:
                row = rows[key] = array("I")
                for value in row_values:
                    at = by_id.get(id(value))
                    if at is None:
                        at = by_id[id(value)] = _index_of(value, index, values)
                    row.append(at)
                at = set_index.setdefault(frozenset(fields_set), len(field_sets))
                if at == len(field_sets):
                    field_sets.append(set(fields_set))
                row.append(at)
            cells.extend(row)
        folders = folders or {}
        version_sets: list[tuple[str, ...]] = []
        version_index: dict[tuple[str, ...], int] = {}
        listed = array("I")
        for _, versions in folders.values():
            at = version_index.setdefault(versions, len(version_sets))
            if at == len(version_sets):
                version_sets.append(versions)
            listed.append(at)
        payload = pickle.dumps((self._fingerprint, self._repo, joined, stamps, model_ids,
                                names, values, field_sets, cells.tobytes(),
                                "\0".join(folders),
                                array("q", (stamp for stamp, _ in folders.values())).tobytes(),
                                version_sets, listed.tobytes()),
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
