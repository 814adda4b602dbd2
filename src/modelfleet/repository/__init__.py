"""Model storage: where packages live (a local folder or any fsspec URL) and the catalog."""

from modelfleet.repository.catalog import Catalog, CatalogChange, CatalogEntry, CatalogUpdate
from modelfleet.repository.store import FsspecStore, LocalStore, ModelStore, open_store

__all__ = ["Catalog", "CatalogChange", "CatalogEntry", "CatalogUpdate", "FsspecStore",
           "LocalStore", "ModelStore", "open_store"]
