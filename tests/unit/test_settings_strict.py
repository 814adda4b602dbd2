"""Settings that cannot lie: a setting that does not exist is an error, never ignored, and
``state_dir`` is a setting like any other."""

from __future__ import annotations

import re
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


def test_unknown_top_level_environment_variables_are_found() -> None:
    """A misspelt top-level name (no ``__``) is refused too; the variables that are not
    settings (NOT_SETTINGS, the tests' and the examples' prefixes) are not."""
    environ = {"MODELFLEET_STAT_DIR": "/x", "MODELFLEET_STATE_DIR": "/x",
               "MODELFLEET_LOG_LEVL": "debug", "modelfleet_log_levl": "debug",
               "MODELFLEET_BROKER": "memory", "MODELFLEET_REPO_REFRESH_S": "1",
               "MODELFLEET_TEST_AMQP": "amqp://", "MODELFLEET_TEST_POSTGRES": "x",
               "MODELFLEET_EXAMPLE_ENRICH_LATENCY_MS": "1", "MODELFLEET_DLQ_DB": "x",
               "MODELFLEET_KEY": "k", "MODELFLEET_HEALTHCHECK_URL": "http://x",
               "MODELFLEET_RUNTIME_SETTINGS": "{}", "MODELFLEET_MEMORY_LIMIT_BYTES": "1",
               "MODELFLEET_RUNTIME": "{}", "MODELFLEET_RUNTIME_X": "1"}
    assert unknown_settings(environ) == ["MODELFLEET_LOG_LEVL", "MODELFLEET_RUNTIME_X",
                                         "MODELFLEET_STAT_DIR", "modelfleet_log_levl"]


# Names the project writes that are deliberately no setting: the tests of the refusal
# itself, the README's word on an old name, command-line placeholders, a Python name.
_NOT_VARIABLES = {"MODELFLEET_GATEWAY__PROT", "MODELFLEET_NOPE__X",
                  "MODELFLEET_GATEWAY__MAX_BODY_BYTE", "MODELFLEET_STAT_DIR",
                  "MODELFLEET_LOG_LEVL", "MODELFLEET_RUNTIME_X",
                  "MODELFLEET_RUNTIME__COMPRESS_THRESHOLD_BYTES",  # README: was, is refused
                  "MODELFLEET_X", "MODELFLEET_NAME",  # bench/peers: --mf-env MODELFLEET_X=V
                  "MODELFLEET_VENV"}  # bench/peers/run.py: a constant, not a variable


def test_every_modelfleet_variable_the_project_uses_is_accepted() -> None:
    """Every MODELFLEET_ name in the code, tests, benches, image and deployment is a
    setting or one of NOT_SETTINGS: none of them stops a process (or CI) at start-up."""
    root = Path(__file__).resolve().parents[2]
    names: set[str] = set()
    for folder in ("src", "tests", "bench", "examples", "deploy", ".ci", "docs"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".toml", ".yaml", ".yml", ".md",
                                                  ".sh", ""):
                names.update(re.findall(r"\bMODELFLEET_[A-Z0-9_]+",
                                        path.read_text(errors="replace")))
    for name in ("Containerfile", "Makefile", "README.md"):
        names.update(re.findall(r"\bMODELFLEET_[A-Z0-9_]+",
                                (root / name).read_text()))
    names = {name for name in names if not name.endswith("_")}  # prefixes (MODELFLEET_TEST_)
    assert len(names) > 50  # the scan saw the project
    refused = unknown_settings({name: "1" for name in names - _NOT_VARIABLES})
    assert refused == [], f"variables the project uses that start-up would refuse: {refused}"


def test_the_cli_refuses_to_start_with_a_misspelt_setting(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "MODELFLEET_GATEWAY__MAX_BODY_BYTE": "10"}
    done = subprocess.run([sys.executable, "-m", "modelfleet", "serve", "--repo",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG
    assert "no such setting: MODELFLEET_GATEWAY__MAX_BODY_BYTE" in done.stderr
    env = {**os.environ, "MODELFLEET_STAT_DIR": str(tmp_path)}  # state_dir, misspelt
    done = subprocess.run([sys.executable, "-m", "modelfleet", "serve", "--repo",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG
    assert "no such setting: MODELFLEET_STAT_DIR" in done.stderr
