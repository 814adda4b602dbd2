"""The catalog: every model in the repository, kept current by incremental refreshes.

Start-up validates every manifest (``Catalog.from_store``: the first invalid one
raises). A running fleet refreshes it in two steps, so that a refresh of a large
repository never stalls an event loop:

    update = await asyncio.to_thread(catalog.scan, store, on_invalid)  # off the loop
    change = catalog.apply(update)                                      # on it: a swap

``scan`` asks the store for each manifest's stamp (``ModelStore.manifest_stamps``:
mtime, ctime, size and inode for a local folder; the listing's etag or mtime and size
for an fsspec store, one listing call, no request per file) and reads and parses only
the manifests whose stamp changed, or that are new: an unchanged package costs one
``stat`` (``Catalog.parses`` counts the parses). It builds the new entries without
touching the live ones. ``apply`` installs them in one swap and returns what changed:
a ``CatalogChange`` (model ids added, removed, changed, and the catalog's new
``generation``, which counts the refreshes that changed something). Consumers either
compare ``generation`` with the one they last saw, or ``subscribe`` a listener that
``apply`` calls on the loop with each non-empty change.

A manifest that an edit broke (``on_invalid`` reports it) keeps its last good
version in the catalog: one bad upload must not take a serving model away. The
sorted model ids (``ids``) and ``page`` (a bisect: O(log n + limit)) serve listings;
``pinned`` is the set of models pinned by their manifests. All three are kept by
``apply`` and cost nothing to ask for.

Start-up can skip parsing what an earlier process parsed: ``from_store(store,
known=...)`` takes manifests by location with the digest of the stamp they were parsed
at (``parse_cache.ManifestCache`` keeps them across starts), and uses one only where the
stamp is the same now; ``known()`` is what a cache may keep (only manifests parsed from
their current stamp). Stamps are kept as a stable digest (``stamp_digest``), the same in
every process.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from modelfleet.errors import ManifestError, ModelNotFound
from modelfleet.repository.manifest import Manifest, parse_manifest
from modelfleet.repository.overrides import ALL_VERSIONS, ConfigOverride, VersionPolicy
from modelfleet.repository.store import ModelStore


@dataclass(frozen=True)
class CatalogEntry:
    """One model: its versions, newest (by natural order) last; ``manifest`` is the newest.

    Under an operator's override (``Catalog.configure``) ``versions`` are the ones its
    version policy serves, with its settings; ``hidden`` the repository's others."""

    versions: tuple[Manifest, ...]
    policy: VersionPolicy = ALL_VERSIONS
    hidden: tuple[str, ...] = ()

    @property
    def manifest(self) -> Manifest:
        return self.versions[-1]

    @property
    def model_id(self) -> str:
        return self.manifest.name

    def version(self, version: str | None) -> Manifest:
        if version is None:
            return self.manifest
        for manifest in self.versions:
            if manifest.version == version:
                return manifest
        if version in self.hidden:
            raise ModelNotFound(
                f"model '{self.model_id}' version '{version}' is not served: the version "
                f"policy of the config its last load gave serves {self.policy.describe()} "
                f"(versions: {', '.join(m.version for m in self.versions)}); a load "
                "without a config serves every version again")
        raise ModelNotFound(
            f"model '{self.model_id}' has no version '{version}' "
            f"(versions: {', '.join(m.version for m in self.versions)})"
        )


@dataclass(frozen=True)
class CatalogChange:
    """What one refresh changed, by model id (sorted), and the generation it made."""

    generation: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # still there, with a version added, removed or edited

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


Listener = Callable[[CatalogChange], None]


class _Seen(NamedTuple):
    """What the last scan saw at one location."""

    stamp: int | None  # the stamp's digest (not its text: 100,000 are kept); None: read again
    manifest: Manifest | None  # None: it never validated
    # The manifest is what the file says at ``stamp`` (False: an invalid edit there kept
    # the last good version, which a cache must not keep under this stamp).
    current: bool


_Scanned = dict[str, _Seen]


def stamp_digest(stamp: str) -> int:
    """A stamp's 64-bit digest, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(stamp.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class CatalogUpdate:
    """A scan's result, not installed yet (``Catalog.apply`` installs it)."""

    base: int  # the generation it was computed against
    scanned: _Scanned
    entries: dict[str, CatalogEntry] | None  # None: no model changed
    ids: list[str] | None  # None: the same model ids
    pinned: frozenset[str] | None  # None: the same ones
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    parses: int = 0
    stamps: int = field(default=0)
    reused: int = 0  # manifests taken from ``known`` (a cache) instead of parsed


def model_of_location(location: str) -> str:
    """The model folder a manifest's location names (``.../<model>/<version>/model.toml``)."""
    parts = location.replace("\\", "/").rsplit("/", 3)
    return parts[-3] if len(parts) >= 3 else ""


def _checked(location: str, text: str) -> Manifest:
    manifest = parse_manifest(text, location)
    parts = location.replace("\\", "/").rsplit("/", 3)
    folder_model, folder_version = parts[-3], parts[-2]
    if manifest.name != folder_model:
        raise ManifestError(location, "name",
                            f"'{manifest.name}' must match its folder '{folder_model}'")
    if manifest.version != folder_version:
        raise ManifestError(location, "version", f"'{manifest.version}' must match "
                            f"its folder '{folder_version}'")
    return manifest


class _Sharing:
    """One copy of each equal field value across the manifests of one scan.

    100,000 manifests that differ only in their names would otherwise each hold their
    own copies of the same description, tuples and defaults (1.8 KB a manifest where
    0.5 KB does; measured). Values are shared, never changed (manifests are frozen).
    """

    def __init__(self) -> None:
        self._values: dict[tuple[type, object], object] = {}
        self._field_sets: dict[frozenset[str], set[str]] = {}
        # Per field, the shared value it had last: a default the schema hands out as
        # one object (a Batching(), an empty tuple) is that very object again, and
        # needs no hashing (pydantic hashes a model in Python).
        self._last: dict[str, object] = {}
        self._last_set: set[str] | None = None

    def __call__(self, manifest: Manifest) -> Manifest:
        fields, values, last = manifest.__dict__, self._values, self._last
        for name, value in fields.items():
            if name == "name":
                continue
            previous = last.get(name)
            if value is previous:
                continue
            # Equal to the value this field had last (most are): that shared value, as
            # the table below would give it (the same type, equal), without its key.
            if previous is not None and type(value) is type(previous) and value == previous:
                fields[name] = previous
                continue
            try:
                fields[name] = last[name] = values.setdefault((type(value), value), value)
            except TypeError:  # an unhashable value stays as it is
                pass
        fields_set = manifest.__pydantic_fields_set__
        shared = self._last_set
        if shared is None or fields_set != shared:
            shared = self._last_set = self._field_sets.setdefault(frozenset(fields_set),
                                                                  fields_set)
        object.__setattr__(manifest, "__pydantic_fields_set__", shared)
        return manifest


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Parsing 100,000 manifests makes millions of objects that all live on: the cyclic
    GC's passes over them cost more than the parsing (2.4x, measured). None run meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in version.split("."))


def _configured(entry: CatalogEntry, override: ConfigOverride) -> CatalogEntry:
    """``entry`` under an operator's override: the versions its policy serves, with its
    settings. Should the policy's versions all have left the repository, the newest
    serves (a model is never left with no version; the index still shows the policy)."""
    versions = [m.version for m in entry.versions]
    served = set(override.policy.served(versions)) or {versions[-1]}
    return CatalogEntry(tuple(override.apply(m) for m in entry.versions if m.version in served),
                        override.policy, tuple(v for v in versions if v not in served))


def _entry(manifests: list[Manifest]) -> CatalogEntry:
    if len(manifests) == 1:  # most models: nothing to sort
        return CatalogEntry((manifests[0],))
    return CatalogEntry(tuple(sorted(manifests, key=lambda m: _version_key(m.version))))


class Catalog:
    def __init__(self, entries: dict[str, CatalogEntry]) -> None:
        self._entries = dict(sorted(entries.items()))
        self._ids = list(self._entries)
        self._pinned = frozenset(m for m, e in self._entries.items() if e.manifest.fanout.pinned)
        self._scanned: _Scanned = {}
        self._generation = 0
        self._listeners: list[Listener] = []
        self.parses = 0  # manifests read and parsed over this catalog's life
        self.reused = 0  # manifests taken from what ``from_store`` was given as known
        self._overrides: dict[str, ConfigOverride] = {}  # model -> an operator's override
        self._configured: dict[str, tuple[CatalogEntry, CatalogEntry]] = {}  # (base, view)

    @classmethod
    def from_store(cls, store: ModelStore,
                   on_invalid: Callable[[ManifestError], None] | None = None,
                   known: Mapping[str, tuple[int, Manifest]] | None = None) -> Catalog:
        """Validate every manifest.

        The first invalid one raises ``ManifestError`` (start-up: fix the repository
        first), or, given ``on_invalid``, is reported there and left out. A manifest in
        ``known`` (location -> (``stamp_digest``, manifest), as ``known()`` gave them) whose
        stamp is the same now is taken as it is, not read: it validated at that stamp.
        """
        catalog = cls({})
        with _no_gc_pauses():
            catalog.apply(catalog._scan(store, on_invalid, known or {}))
        catalog._generation = 0
        return catalog

    def known(self) -> dict[str, tuple[int, Manifest]]:
        """Every manifest parsed from the stamp its file has now, by location, with the
        stamp's digest: what a cache may keep for ``from_store``'s ``known``. Safe to
        call in a thread while the loop installs a refresh (it reads one scan's state)."""
        return {location: (seen.stamp, seen.manifest) for location, seen in
                self._scanned.items()
                if seen.current and seen.stamp is not None and seen.manifest is not None}

    # -- refreshing ---------------------------------------------------------------
    def scan(self, store: ModelStore,
             on_invalid: Callable[[ManifestError], None] | None = None) -> CatalogUpdate:
        """Read what changed in ``store`` since the last scan; installs nothing.

        Safe to run in a thread while the loop reads the catalog (it only reads the
        live state, which ``apply`` replaces and never mutates); one scan at a time.
        An invalid manifest raises without ``on_invalid``; with it, it is reported and
        keeps its last good version (left out if it never had one).
        """
        with _no_gc_pauses():
            return self._scan(store, on_invalid, {})

    def _scan(self, store: ModelStore, on_invalid: Callable[[ManifestError], None] | None,
              known: Mapping[str, tuple[int, Manifest]]) -> CatalogUpdate:
        before, generation = self._scanned, self._generation
        scanned: _Scanned = {}
        touched: set[str] = set()
        parses = stamps = reused = 0
        shared = _Sharing()
        for location, stamp in store.manifest_stamps():
            stamps += 1
            old = before.get(location)
            stamped = stamp_digest(stamp) if stamp else None
            if old is not None and stamped is not None and old.stamp == stamped:
                scanned[location] = old
                continue
            kept = known.get(location) if stamped is not None else None
            if kept is not None and kept[0] == stamped:
                # Parsed and validated at this very stamp before: the file says the same.
                reused += 1
                scanned[location] = _Seen(stamped, kept[1], True)
                if old is None or old.manifest != kept[1]:
                    touched.add(kept[1].name)  # its folder's name (it validated there)
                continue
            parses += 1
            current = True
            try:
                manifest: Manifest | None = shared(
                    _checked(location, store.read_manifest(location)))
            except ManifestError as exc:
                if on_invalid is None:
                    raise
                on_invalid(exc)
                manifest, current = (old.manifest if old is not None else None), False
            scanned[location] = _Seen(stamped, manifest, current)
            if old is None or old.manifest != manifest:
                touched.add(manifest.name if manifest is not None
                            else model_of_location(location))
        touched.update(model_of_location(gone) for gone in before.keys() - scanned.keys()
                       if before[gone].manifest is not None)
        if not touched:
            return CatalogUpdate(generation, scanned, None, None, None, parses=parses,
                                 stamps=stamps, reused=reused)
        versions: dict[str, list[Manifest]] = {}
        for _, manifest, _ in scanned.values():
            if manifest is not None and manifest.name in touched:
                versions.setdefault(manifest.name, []).append(manifest)
        if not self._entries:  # start-up: every model is new, in one pass and one sort
            added = tuple(sorted(versions))
            entries = {model_id: _entry(versions[model_id]) for model_id in added}
            return CatalogUpdate(generation, scanned, entries, list(added) if added else None,
                                 frozenset(model_id for model_id, entry in entries.items()
                                           if entry.versions[-1].fanout.pinned),
                                 added, (), (), parses, stamps, reused)
        entries = dict(self._entries)
        for model_id in touched:
            if model_id in versions:
                entries[model_id] = _entry(versions[model_id])
            else:
                entries.pop(model_id, None)
        added = tuple(sorted(m for m in touched if m in entries and m not in self._entries))
        removed = tuple(sorted(m for m in touched if m not in entries and m in self._entries))
        changed = tuple(sorted(m for m in touched if m in entries and m in self._entries
                               and entries[m] != self._entries[m]))
        ids = sorted(entries) if added or removed else None
        if ids is not None:
            entries = {model_id: entries[model_id] for model_id in ids}
        pinned = set(self._pinned)
        for model_id in touched:
            if model_id in entries and entries[model_id].manifest.fanout.pinned:
                pinned.add(model_id)
            else:
                pinned.discard(model_id)
        return CatalogUpdate(generation, scanned, entries, ids, frozenset(pinned), added,
                             removed, changed, parses, stamps, reused)

    def apply(self, update: CatalogUpdate) -> CatalogChange:
        """Install a scan's result (one swap, on the loop) and tell the listeners."""
        if update.base != self._generation:
            raise RuntimeError("a catalog update made against an older generation "
                               "(one scan at a time)")
        self._scanned = update.scanned
        self.parses += update.parses
        self.reused += update.reused
        if update.entries is None or not (update.added or update.removed or update.changed):
            return CatalogChange(self._generation)
        return self._install(update.entries, update.ids, update.pinned, update.added,
                             update.removed, update.changed)

    def _install(self, entries: dict[str, CatalogEntry], ids: list[str] | None,
                 pinned: frozenset[str] | None, added: tuple[str, ...],
                 removed: tuple[str, ...], changed: tuple[str, ...]) -> CatalogChange:
        self._entries = entries
        if ids is not None:
            self._ids = ids
        if pinned is not None:
            self._pinned = pinned
        self._generation += 1
        change = CatalogChange(self._generation, added, removed, changed)
        for listener in list(self._listeners):
            listener(change)
        return change

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every non-empty change; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    @property
    def generation(self) -> int:
        """How many installed refreshes changed something (0 at start-up)."""
        return self._generation

    def replace_with(self, fresh: Catalog, keep: frozenset[str] = frozenset()
                     ) -> tuple[list[str], list[str]]:
        """Take ``fresh``'s entries (one atomic swap); returns (added, removed) model ids.

        Models in ``keep`` that ``fresh`` lacks keep their current entry: a model whose
        manifest was just broken by an edit goes on serving as it was. (A whole second
        catalog: ``scan`` and ``apply`` are the incremental way.)
        """
        entries = dict(fresh._entries)
        for model_id in keep - set(entries):
            if model_id in self._entries:
                entries[model_id] = self._entries[model_id]
        added = tuple(sorted(set(entries) - set(self._entries)))
        removed = tuple(sorted(set(self._entries) - set(entries)))
        changed = tuple(sorted(m for m in entries if m in self._entries
                               and entries[m] != self._entries[m]))
        self._scanned = fresh._scanned
        if added or removed or changed:
            ids = sorted(entries)
            pinned = frozenset(m for m, e in entries.items() if e.manifest.fanout.pinned)
            self._install({m: entries[m] for m in ids}, ids, pinned, added, removed, changed)
        return list(added), list(removed)

    # -- operators' overrides --------------------------------------------------------
    def configure(self, model_id: str, override: ConfigOverride | None) -> bool:
        """Serve ``model_id`` with an operator's override of its model.toml settings
        (None: as model.toml says), from now on and across refreshes. True if it
        changed. Not a refresh: ``generation`` stays (an override changes no manifest
        file, and a scan under way in a thread is still installed)."""
        if not override:
            override = None
        if self._overrides.get(model_id) == override:
            return False
        if override is None:
            self._overrides.pop(model_id, None)
        else:
            self._overrides[model_id] = override
        self._configured.pop(model_id, None)
        return True

    def override(self, model_id: str) -> ConfigOverride | None:
        return self._overrides.get(model_id)

    def original(self, model_id: str) -> CatalogEntry:
        """The model as its model.toml files say, whatever an operator's override says."""
        entry = self._entries.get(model_id)
        if entry is None:
            raise ModelNotFound(f"no model named '{model_id}' (GET /v1/models lists them)")
        return entry

    def view(self, model_id: str, override: ConfigOverride | None) -> CatalogEntry:
        """The model as it would serve under ``override`` (None: as model.toml says)."""
        entry = self.original(model_id)
        return _configured(entry, override) if override else entry

    def _view(self, model_id: str, entry: CatalogEntry) -> CatalogEntry:
        override = self._overrides.get(model_id) if self._overrides else None
        if override is None:
            return entry
        cached = self._configured.get(model_id)
        if cached is not None and cached[0] is entry:
            return cached[1]
        view = _configured(entry, override)
        self._configured[model_id] = (entry, view)
        return view

    # -- reading ------------------------------------------------------------------
    def get(self, model_id: str) -> CatalogEntry:
        """The model as it is served: its model.toml files under an operator's override."""
        return self._view(model_id, self.original(model_id))

    def ids(self) -> Sequence[str]:
        """Every model id, sorted (a list the catalog replaces, never changes: keep it
        for as long as you like, but do not modify it)."""
        return self._ids

    def pinned(self) -> frozenset[str]:
        """The models whose newest manifest says ``[fanout] pinned = true``, kept by each
        refresh in O(what changed): what a worker preloads, without a walk of the catalog."""
        return self._pinned

    def page(self, after: str | None, limit: int,
             keep: Callable[[CatalogEntry], bool] | None = None
             ) -> tuple[list[CatalogEntry], str | None]:
        """Up to ``limit`` entries (those ``keep`` accepts, if given) whose ids sort after
        ``after`` (from the first with None), and the id to pass as ``after`` for the
        next page (None: that was the last). O(log n + the entries looked at)."""
        ids, entries = self._ids, self._entries
        at = 0 if after is None else bisect.bisect_right(ids, after)
        found: list[CatalogEntry] = []
        while at < len(ids) and len(found) < limit:
            entry = self._view(ids[at], entries[ids[at]])
            at += 1
            if keep is None or keep(entry):
                found.append(entry)
        return found, (ids[at - 1] if at < len(ids) else None)

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._entries

    def __iter__(self) -> Iterator[CatalogEntry]:
        return (self._view(m, e) for m, e in self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)
