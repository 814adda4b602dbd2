"""modelfleet keys | tenants | usage: arguments, exit codes, and what each prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.cli import main
from modelfleet.errors import ConfigError
from modelfleet.settings import Settings
from modelfleet.tenancy.cli import parse_when
from modelfleet.tenancy.plans import with_plans_file
from modelfleet.tenancy.store import UsageRow, open_store

NOW_S = 1_800_000_000.0


def test_times_are_ages_or_iso_dates_in_utc() -> None:
    assert parse_when("90m", NOW_S) == int((NOW_S - 5400) * 1000)
    assert parse_when("7d", NOW_S) == int((NOW_S - 7 * 86400) * 1000)
    assert parse_when("2026-11-30T18:00", NOW_S) == parse_when("2026-11-30T18:00+00:00", NOW_S)
    with pytest.raises(ConfigError, match="cannot read 'yesterday'"):
        parse_when("yesterday", NOW_S)


def test_a_key_is_printed_once_and_listed_by_prefix_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "k.sqlite3")
    assert main(["keys", "create", "--tenant", "acme", "--role", "operator", "--db", db]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("mfk_")
    assert main(["keys", "list", "--db", db]) == 0
    listing = capsys.readouterr().out
    assert f"mfk_{key.split('_')[1]}_…" in listing and key.split("_", 2)[2] not in listing
    assert "operator" in listing
    assert main(["keys", "revoke", key[:16], "--db", db]) == 0
    assert main(["keys", "revoke", key[:16], "--db", db]) == 1
    assert "was revoked already" in capsys.readouterr().err
    assert main(["keys", "revoke", "mfk_ffffffffffff", "--db", db]) == 1
    assert main(["keys", "revoke", "nonsense", "--db", db]) == 2


def test_unknown_plans_and_unopenable_stores_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "k.sqlite3")
    assert main(["keys", "create", "--tenant", "a", "--plan", "gold", "--db", db]) == 2
    assert "no plan named 'gold'" in capsys.readouterr().err
    plans = tmp_path / "plans.toml"
    plans.write_text("[plans.gold]\nrequests_per_s = 1\n")
    assert main(["tenants", "set", "a", "--plan", "gold", "--plans-file", str(plans),
                 "--db", db]) == 0
    assert main(["tenants", "list", "--db", db]) == 0
    assert "gold" in capsys.readouterr().out
    assert main(["usage", "--db", "postgresql://x:y@127.0.0.1:1/none"]) == 4
    assert main(["usage", "--db", str(tmp_path), "--since", "1h"]) == 4  # a folder
    assert main(["tenants", "ungrant", "a", "m", "--db", db]) == 1


def test_usage_prints_a_table_or_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "u.sqlite3")
    store = open_store(db)
    hour = 3_600_000 * 480_000  # 2024-10-04T00:00Z (day 20000)
    store.add_usage([UsageRow("acme", "m", hour, "ok", 3, 0.5, 2.0, 30, 60),
                     UsageRow("other", "m", hour, "ok", 1, 0, 0, 1, 1)])
    store.close()
    assert main(["usage", "--tenant", "acme", "--since", "2024-10-04", "--csv", "--db", db]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "hour,tenant,model,outcome,requests,predict_s,load_s,bytes_in,bytes_out",
        "2024-10-04T00:00Z,acme,m,ok,3,0.500,2.000,30,60"]
    assert main(["usage", "--since", "2024-10-04", "--until", "2024-10-05", "--db", db]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["hour", "tenant", "model"] and len(table) == 3


def test_a_plans_file_reaches_queue_scoring(tmp_path: Path) -> None:
    plans = tmp_path / "plans.toml"
    plans.write_text("[plans.pro]\nfanout_multiplier = 3\npriority = 5\n")
    base = Settings()
    assert with_plans_file(base) is base
    tuned = with_plans_file(base.model_copy(update={"tenancy": base.tenancy.model_copy(
        update={"plans_file": str(plans)})}))
    assert tuned.scheduling.fanout_cap(2, "pro") == 6
    assert tuned.scheduling.priority("pro") == 5 and tuned.scheduling.priority("free") == 0
