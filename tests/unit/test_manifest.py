"""model.toml: what validates, and errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.errors import ConfigError, ManifestError
from modelfleet.repository.manifest import CONTENT_TYPES, load_manifest, parse_manifest

PATH = "repo/digits/1/model.toml"

FULL = """
name = "digits"
version = "1"
entrypoint = "handler:Digits"
accepts = ["image/png", "image/jpeg"]
device = "cpu"
memory_estimate_mb = 4
timeout_s = 30
tenant = "examples"
plan = "pro"
description = "8x8 digits"

[batching]
max_batch_size = 8
max_delay_ms = 2

[isolation]
requirements = ["numpy==1.26.4"]
memory_limit_mb = 2048

[fanout]
max_workers = 3
pinned = true
"""

MINIMAL = 'name = "m"\nentrypoint = "handler:M"\n'


def test_full_manifest_parses_every_field() -> None:
    m = parse_manifest(FULL, PATH)
    assert (m.name, m.model_id, m.version, m.entrypoint) == ("digits", "digits", "1",
                                                             "handler:Digits")
    assert m.accepts == ("image/png", "image/jpeg")
    assert (m.device, m.tenant, m.plan, m.description) == ("cpu", "examples", "pro", "8x8 digits")
    assert m.memory_estimate_bytes == 4 * 1024 * 1024
    assert m.timeout_s == 30
    assert (m.batching.max_batch_size, m.batching.max_delay_ms) == (8, 2)
    assert m.isolation.requirements == ("numpy==1.26.4",)
    assert m.isolated
    assert m.memory_limit_bytes == 2048 * 1024 * 1024
    assert (m.fanout.max_workers, m.fanout.pinned) == (3, True)


def test_minimal_manifest_gets_the_documented_defaults() -> None:
    m = parse_manifest(MINIMAL, PATH)
    assert m.version == "1"
    assert m.accepts == ("application/json",)
    assert (m.device, m.plan, m.tenant) == ("cpu", "free", "default")
    assert m.batching.max_batch_size == 1
    assert not m.isolated and m.memory_limit_bytes is None
    assert (m.fanout.max_workers, m.fanout.pinned) == (2, False)


def test_manifest_is_frozen() -> None:
    m = parse_manifest(MINIMAL, PATH)
    with pytest.raises(ValueError):
        m.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("name", ["digits", "a", "resnet-50", "bert.base_v2", "9lives"])
def test_good_model_names(name: str) -> None:
    assert parse_manifest(f'name = "{name}"\nentrypoint = "handler:M"\n', PATH).name == name


@pytest.mark.parametrize("entrypoint", ["handler:M", "pkg.handler:Model_2", "_h:_M"])
def test_good_entrypoints(entrypoint: str) -> None:
    text = f'name = "m"\nentrypoint = "{entrypoint}"\n'
    assert parse_manifest(text, PATH).entrypoint == entrypoint


@pytest.mark.parametrize("ctype", CONTENT_TYPES)
def test_every_known_content_type_is_accepted(ctype: str) -> None:
    assert parse_manifest(MINIMAL + f'accepts = ["{ctype}"]\n', PATH).accepts == (ctype,)


# (what is wrong, the TOML, the field the error must name, words the problem must contain)
INVALID = [
    ("bad name: upper case", 'name = "Digits"\nentrypoint = "h:M"', "name", "must match"),
    ("bad name: slash", 'name = "a/b"\nentrypoint = "h:M"', "name", "must match"),
    ("bad name: leading dash", 'name = "-a"\nentrypoint = "h:M"', "name", "must match"),
    ("bad name: too long", f'name = "{"a" * 129}"\nentrypoint = "h:M"', "name", "128"),
    ("missing name", 'entrypoint = "h:M"', "name", "required"),
    ("missing entrypoint", 'name = "m"', "entrypoint", "required"),
    ("entrypoint without class", 'name = "m"\nentrypoint = "handler"', "entrypoint",
     "module:Class"),
    ("entrypoint empty class", 'name = "m"\nentrypoint = "handler:"', "entrypoint",
     "module:Class"),
    ("entrypoint path", 'name = "m"\nentrypoint = "pkg/handler.py:M"', "entrypoint",
     "module:Class"),
    ("entrypoint bad class", 'name = "m"\nentrypoint = "handler:My-Model"', "entrypoint",
     "module:Class"),
    ("bad version", MINIMAL + 'version = "1 beta"', "version", "letters, digits"),
    ("unknown content type", MINIMAL + 'accepts = ["image/gif"]', "accepts", "image/png"),
    ("no content type", MINIMAL + "accepts = []", "accepts", "non-empty"),
    ("accepts not a list", MINIMAL + 'accepts = "image/png"', "accepts", "tuple"),
    ("unknown field", MINIMAL + 'colour = "red"', "colour", "unknown field"),
    ("unknown nested field", MINIMAL + "[batching]\nmax_batch = 8", "batching.max_batch",
     "unknown field"),
    ("wrong type: number as text", MINIMAL + 'memory_estimate_mb = "lots"',
     "memory_estimate_mb", "number"),
    ("wrong type: version unquoted", MINIMAL.replace('"m"\n', '"m"\nversion = 1\n'), "version",
     "string"),
    ("wrong type: table as number", MINIMAL + "batching = 3", "batching", "dictionary"),
    ("wrong type: fractional batch", MINIMAL + "[batching]\nmax_batch_size = 2.5",
     "batching.max_batch_size", "integer"),
    ("out of range: batch 0", MINIMAL + "[batching]\nmax_batch_size = 0",
     "batching.max_batch_size", "greater than or equal to 1"),
    ("out of range: negative timeout", MINIMAL + "timeout_s = -1", "timeout_s", "greater than"),
    ("out of range: zero memory", MINIMAL + "memory_estimate_mb = 0", "memory_estimate_mb",
     "greater than"),
    ("out of range: tiny memory limit", MINIMAL + "[isolation]\nmemory_limit_mb = 8",
     "isolation.memory_limit_mb", "16"),
    ("bad device", MINIMAL + 'device = "tpu"', "device", "'cpu' or 'cuda'"),
    ("bad plan", MINIMAL + 'plan = "gold"', "plan", "'free'"),
    ("requirements not a list", MINIMAL + '[isolation]\nrequirements = "numpy"',
     "isolation.requirements", "tuple"),
    ("bad TOML", 'name = "m\nentrypoint = "h:M"', "(toml)", "not valid TOML"),
    ("bad TOML: duplicate key", MINIMAL + 'name = "n"', "(toml)", "not valid TOML"),
]


@pytest.mark.parametrize(("toml", "field", "words"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_manifest_names_file_and_field(toml: str, field: str, words: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(toml + "\n", PATH)
    err = info.value
    assert (err.path, err.field) == (PATH, field)
    assert words.lower() in err.problem.lower()
    assert str(err).startswith(f"{PATH}: field '{field}': ")
    assert err.code == "invalid_manifest"
    assert isinstance(err, ConfigError)


def test_load_manifest_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_text(FULL, encoding="utf-8")
    assert load_manifest(path).name == "digits"


def test_load_manifest_names_the_file_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_text(MINIMAL + "colour = 1\n", encoding="utf-8")
    with pytest.raises(ManifestError, match=str(path)) as info:
        load_manifest(path)
    assert info.value.field == "colour"


def test_missing_manifest_file_is_a_manifest_error(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "model.toml"
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert (info.value.path, info.value.field) == (str(path), "(file)")
    assert "cannot read" in info.value.problem
