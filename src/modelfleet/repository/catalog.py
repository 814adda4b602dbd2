"""The catalog: every model in the repository, validated once at start-up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from modelfleet.errors import ManifestError, ModelNotFound
from modelfleet.repository.manifest import Manifest, parse_manifest
from modelfleet.repository.store import ModelStore


@dataclass(frozen=True)
class CatalogEntry:
    """One model: its versions, newest (by natural order) last; ``manifest`` is the newest."""

    versions: tuple[Manifest, ...]

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
        raise ModelNotFound(
            f"model '{self.model_id}' has no version '{version}' "
            f"(versions: {', '.join(m.version for m in self.versions)})"
        )


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


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in version.split("."))


class Catalog:
    def __init__(self, entries: dict[str, CatalogEntry]) -> None:
        self._entries = entries
        # Moves at every ``replace_with``: what is derived from the whole catalog (the
        # worker's pinned set) is rebuilt when it moves, not at every look.
        self.generation = 0

    @classmethod
    def from_store(cls, store: ModelStore,
                   on_invalid: Callable[[ManifestError], None] | None = None) -> Catalog:
        """Validate every manifest.

        The first invalid one raises ``ManifestError`` (start-up: fix the repository
        first), or, given ``on_invalid``, is reported there and left out (a refresh of
        a running fleet: one bad upload must not take the others away).
        """
        found: dict[str, list[Manifest]] = {}
        for location, text in store.manifest_texts():
            try:
                manifest = _checked(location, text)
            except ManifestError as exc:
                if on_invalid is None:
                    raise
                on_invalid(exc)
                continue
            found.setdefault(manifest.name, []).append(manifest)
        return cls({
            name: CatalogEntry(tuple(sorted(ms, key=lambda m: _version_key(m.version))))
            for name, ms in sorted(found.items())
        })

    def replace_with(self, fresh: Catalog, keep: frozenset[str] = frozenset()
                     ) -> tuple[list[str], list[str]]:
        """Take ``fresh``'s entries (one atomic swap); returns (added, removed) model ids.

        Models in ``keep`` that ``fresh`` lacks keep their current entry: a model whose
        manifest was just broken by an edit goes on serving as it was.
        """
        entries = dict(fresh._entries)
        for model_id in keep - set(entries):
            if model_id in self._entries:
                entries[model_id] = self._entries[model_id]
        added = sorted(set(entries) - set(self._entries))
        removed = sorted(set(self._entries) - set(entries))
        self._entries = dict(sorted(entries.items()))
        self.generation += 1
        return added, removed

    def get(self, model_id: str) -> CatalogEntry:
        entry = self._entries.get(model_id)
        if entry is None:
            raise ModelNotFound(f"no model named '{model_id}' (GET /v1/models lists them)")
        return entry

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._entries

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
