"""The plain-TOML reader: the values tomllib gives, or None; manifests read either way
validate to equal manifests and fail with the same errors."""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path
from typing import Any

import pytest

from modelfleet.errors import ManifestError
from modelfleet.repository import plain_toml
from modelfleet.repository.manifest import Manifest, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted([*ROOT.glob("examples/models/*/*/model.toml"),
                    *ROOT.glob("tests/fixtures/**/model.toml")])


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1, 1.0 and True are not)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    return bool(a == b)


def test_every_example_manifest_is_plain_and_read_as_tomllib_reads_it() -> None:
    assert len(MANIFESTS) >= 10
    for path in MANIFESTS:
        text = path.read_text()
        assert same(plain_toml.loads(text), tomllib.loads(text)), path


PLAIN = [
    ("", {}),
    ("# only a comment", {}),
    ('a = "x"\r\nb = 1\r\n', {"a": "x", "b": 1}),
    ("a=1#c\n\tb\t=\t-2 # c\n", {"a": 1, "b": -2}),
    ("a = +7\nb = -0.0\nc = 1e3\nd = 0\ne = 2.5E-2", {"a": 7, "b": -0.0, "c": 1000.0, "d": 0,
                                                     "e": 0.025}),
    ("a = true\nb = false", {"a": True, "b": False}),
    ("a = ''\nb = 'C:\\x'\nc = \"\"", {"a": "", "b": "C:\\x", "c": ""}),
    ('a = ["x", 1, 2.5, true, \'y\',]\nb = []\nc = [ ]\nd = [\n  "p",\n  "q"\n]',
     {"a": ["x", 1, 2.5, True, "y"], "b": [], "c": [], "d": ["p", "q"]}),
    ('a = ["#", ",", "]"]', {"a": ["#", ",", "]"]}),
    ('d = """\nfirst \\\n   second \\  \n\n  third"""', {"d": "first second third"}),
    ('d = """say "hi" and ""yes"" \t"""', {"d": 'say "hi" and ""yes"" \t'}),
    ('d = """"""', {"d": ""}),
    ("[t]\na = 1\n[ u ] # c\n[[v]]\nb = 1\n[[v]]\nb = 2\n",
     {"t": {"a": 1}, "u": {}, "v": [{"b": 1}, {"b": 2}]}),
    ("1 = 2\n-_ = 3", {"1": 2, "-_": 3}),
]


@pytest.mark.parametrize(("text", "value"), PLAIN)
def test_plain_documents_read_to_tomllibs_values(text: str, value: dict[str, Any]) -> None:
    assert same(plain_toml.loads(text), value)
    assert same(tomllib.loads(text), value)


NOT_PLAIN = [
    'a = "x\\ty"',  # an escape
    'a = """x\\ty"""',
    'a = """ends in a quote""""',
    "a = '''literal'''",
    "a = 1_000",
    "a = 0x10",
    "a = 1234567890123456789",  # more digits than the reader converts
    "a = inf",
    "a = 1979-05-27",
    "a = 07:32:00",
    "a = {b = 1}",
    "a.b = 1",
    '"a" = 1',
    "a = [[1], [2]]",
    "a = [1, # a comment\n 2]",
    "a = 1\r\nb = 2\r",  # a lone CR
    # invalid TOML, which tomllib reports
    "a = 1\na = 2",
    "a = 1\n[a]",
    "[a]\n[a]",
    "[a]\n[[a]]",
    "a = []\n[[a]]",
    "[[a]]\n[a]",
    "a = ",
    "a = 1 2",
    'a = "x" # \x00',
    "a = 01",
    "a = 1.",
    "a = [,]",
    'a = "unterminated',
    "\ufeffa = 1",
]


@pytest.mark.parametrize("text", NOT_PLAIN)
def test_everything_else_is_left_to_tomllib(text: str) -> None:
    assert plain_toml.loads(text) is None


TOKENS = [" ", "\t", "\n", "\r", "\r\n", '"', "'", "\\", "#", "=", "[", "]", "[[", "]]",
          ",", ".", "_", "-", "+", "e", "E", "0", "1", "9", "x", "{", "}", ":", "\x00",
          "\x7f", "\x0b", "é", "\ufeff", "true", "false", '"""', "'''", "nan", "inf",
          "1979-05-27", "\\\n", "\\ ", "a = 1\n", "[batching]\n", "[[inputs]]\n"]


def _mutants(rng: random.Random, texts: list[str], count: int) -> list[str]:
    out = []
    for _ in range(count):
        text = rng.choice(texts)
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            lines = text.split("\n")
            match rng.randint(0, 4):
                case 0:
                    text = text[:at] + rng.choice(TOKENS) + text[at:]
                case 1:
                    text = text[:at] + text[at + rng.randint(1, 3):]
                case 2:
                    text = text[:at] + rng.choice(TOKENS) + text[at + 1:]
                case 3:
                    line = rng.randrange(len(lines))
                    lines.insert(rng.randint(0, len(lines)), lines[line])
                    text = "\n".join(lines)
                case _:
                    other = rng.choice(texts).split("\n")
                    lines.insert(rng.randint(0, len(lines)), rng.choice(other))
                    text = "\n".join(lines)
        out.append(text)
    return out


def _tomllib_only(text: str) -> dict[str, Any] | None:
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError):
        return None


def test_mutated_manifests_read_as_tomllib_reads_them_or_not_at_all() -> None:
    rng = random.Random(20261204)
    texts = [path.read_text() for path in MANIFESTS] + [text for text, _ in PLAIN]
    plain = 0
    for text in _mutants(rng, texts, 6000):
        read = plain_toml.loads(text)
        if read is not None:
            plain += 1
            assert same(read, _tomllib_only(text)), repr(text)
    # Both ways were taken often: mutants that stayed plain and ones that did not.
    assert 1000 < plain < 5000


def _outcome(text: str) -> Manifest | str:
    try:
        return parse_manifest(text, "repo/m/1/model.toml")
    except ManifestError as exc:
        return str(exc)


def test_manifests_validate_the_same_whichever_reader_read_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    texts = [path.read_text() for path in MANIFESTS]
    mutants = texts + _mutants(rng, texts, 2000)
    fast = [_outcome(text) for text in mutants]
    monkeypatch.setattr(plain_toml, "loads", lambda text: None)
    slow = [_outcome(text) for text in mutants]
    assert fast == slow
    assert sum(isinstance(each, Manifest) for each in fast) > 100
    assert sum(isinstance(each, str) for each in fast) > 100
