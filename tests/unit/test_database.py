"""The deployment's database: one location and one error translation for every store in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.control.orders import OrderStore, OrderStoreUnavailable
from modelfleet.database import default_location
from modelfleet.dlq.archive import ArchiveUnavailable, open_archive
from modelfleet.errors import ConfigError
from modelfleet.tenancy import TenancyStoreUnavailable
from modelfleet.tenancy.store import open_store, store_location


def test_the_default_location_is_in_the_state_dir(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELFLEET_DLQ_DB", raising=False)
    monkeypatch.delenv("MODELFLEET_STATE_DIR", raising=False)
    assert default_location(tmp_path) == str(tmp_path / "dlq.sqlite3")
    assert default_location() == str(Path.home() / ".cache" / "modelfleet" / "dlq.sqlite3")
    monkeypatch.setenv("MODELFLEET_STATE_DIR", str(tmp_path / "state"))
    assert default_location() == str(tmp_path / "state" / "dlq.sqlite3")
    # The tenants' store and the control orders default to the same place.
    assert store_location("", tmp_path) == default_location(tmp_path)
    assert store_location(str(tmp_path / "other.db"), tmp_path) == str(tmp_path / "other.db")


def test_an_explicit_database_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFLEET_DLQ_DB", str(tmp_path / "fleet.sqlite3"))
    assert default_location(tmp_path / "ignored") == str(tmp_path / "fleet.sqlite3")


def test_every_store_shares_one_file(tmp_path: Path) -> None:
    location = str(tmp_path / "fleet.sqlite3")
    archive, tenants, orders = open_archive(location), open_store(location), OrderStore(location)
    try:
        assert archive.location == tenants.location == orders.location == location
        tenants.set_tenant("acme", "pro")
        assert [t.name for t in open_store(location).tenants()] == ["acme"]
    finally:
        archive.close()
        tenants.close()
        orders.close()


@pytest.mark.parametrize("opener, unavailable, label", [
    (open_archive, ArchiveUnavailable, "the dead-letter archive"),
    (open_store, TenancyStoreUnavailable, "the tenants' store"),
    (OrderStore, OrderStoreUnavailable, "the control orders' database")])
def test_each_store_names_itself_when_its_database_cannot_open(
        tmp_path: Path, opener: object, unavailable: type[Exception], label: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(unavailable, match=f"cannot open {label}"):
        opener(str(blocker / "db.sqlite3"))  # type: ignore[operator]
    with pytest.raises(ConfigError, match="redis:// is not supported"):
        opener("redis://localhost/0")  # type: ignore[operator]
