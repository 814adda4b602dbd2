"""Settings that cannot lie: a setting that does not exist is an error, never ignored, and
``state_dir`` is a setting like any other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from modelfleet.exits import EXIT_CONFIG
from modelfleet.settings import Settings, unknown_settings


def test_an_unknown_keyword_is_an_error() -> None:
    with pytest.raises(ValidationError, match="stat_dir"):
        Settings(stat_dir="/tmp/x")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="prot"):
        Settings(gateway={"prot": 1})


def test_state_dir_is_a_real_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(state_dir=tmp_path).state_dir == tmp_path
    monkeypatch.setenv("MODELFLEET_STATE_DIR", str(tmp_path / "env"))
    assert Settings().state_dir == tmp_path / "env"
    monkeypatch.delenv("MODELFLEET_STATE_DIR")
    assert Settings().state_dir == Path.home() / ".cache" / "modelfleet"


def test_unknown_sectioned_environment_variables_are_found() -> None:
    environ = {"MODELFLEET_GATEWAY__PORT": "1", "MODELFLEET_GATEWAY__PROT": "1",
               "MODELFLEET_NOPE__X": "1", "MODELFLEET_TENANCY__DB": "x",
               "MODELFLEET_DLQ_DB": "x", "MODELFLEET_EXAMPLE_SLOWLOAD_S": "3", "PATH": "/bin"}
    assert unknown_settings(environ) == ["MODELFLEET_GATEWAY__PROT", "MODELFLEET_NOPE__X"]


def test_the_cli_refuses_to_start_with_a_misspelt_setting(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "MODELFLEET_GATEWAY__MAX_BODY_BYTE": "10"}
    done = subprocess.run([sys.executable, "-m", "modelfleet", "serve", "--repo",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG
    assert "no such setting: MODELFLEET_GATEWAY__MAX_BODY_BYTE" in done.stderr
