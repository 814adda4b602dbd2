"""A fast reader for the plain TOML that manifests are written in; ``tomllib`` for the rest.

Start-up reads every manifest of the repository, and ``tomllib``, a parser written in
Python that walks the text a character at a time, was the largest part of a first
start's CPU (about 5 s of 19 at 100,000 manifests, measured). Manifests use a small,
regular part of TOML: bare keys, one-line and multi-line strings, decimal numbers,
booleans, arrays of those, ``[table]`` and ``[[array of tables]]`` headers, comments.
``loads`` reads that part with one regular expression, and gives up (``None``) on
anything else; the caller then reads the text with ``tomllib``, so every other
document, and every invalid one, gets ``tomllib``'s result and its error message,
unchanged.

What it accepts is a strict subset of TOML 1.0, read to the same values ``tomllib``
gives (``tests/unit/test_plain_toml.py`` compares the two on the example manifests and
on thousands of mutations of them):

- a key is bare (``[A-Za-z0-9_-]+``), never dotted or quoted, and appears once in its
  table; a ``[table]`` header names a table not seen before, a ``[[table]]`` header
  one that only ``[[...]]`` headers made;
- a one-line string has no escape (no backslash); a multi-line basic string has no
  escape but the line-ending backslash, and does not end in a quote;
- a number is decimal, without ``_``, with at most 18 digits before the point (no
  ``inf``, ``nan``, hex, octal or binary); dates and times are not read;
- an array holds one-line scalars, with no comment inside it;
- no inline tables.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_CTRL_BUT_TAB = r"\x00-\x08\x0a-\x1f\x7f"  # what TOML forbids in a string or a comment
_KEY = r"[A-Za-z0-9_-]+"
_BASIC = rf'"[^"\\{_CTRL_BUT_TAB}]*"'
_LITERAL = rf"'[^'{_CTRL_BUT_TAB}]*'"
_NUMBER = r"[+-]?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,30})?(?:[eE][+-]?[0-9]{1,4})?"
_BOOL = r"true|false"
_SCALAR = f"{_BASIC}|{_LITERAL}|{_NUMBER}|{_BOOL}"
_ARRAY = rf"\[[ \t\n]*(?:(?:{_SCALAR})[ \t\n]*,[ \t\n]*)*(?:(?:{_SCALAR})[ \t\n]*)?\]"
# Newlines, tabs and quotes (not three in a row: they close it) may stand in a
# multi-line string; a backslash only before the end of a line (checked after the match).
_MULTILINE_RUN = r'[^"\x00-\x08\x0b-\x1f\x7f]*'
_MULTILINE = f'"""{_MULTILINE_RUN}(?:"(?!""){_MULTILINE_RUN})*"""'

# One statement, captured whole: a key = value, a header, or nothing; then an optional
# comment and the end of the line. A value's group holds its delimiters too, so a
# group that matched is never empty ("" in ``findall``'s tuples: did not match).
_STATEMENT = re.compile(
    rf"""([ \t]*
    (?:
        ({_KEY})[ \t]*=[ \t]*
        (?:({_MULTILINE})|({_BASIC})|({_LITERAL})|({_NUMBER})|({_BOOL})|({_ARRAY}))
      | \[\[[ \t]*({_KEY})[ \t]*\]\]
      | \[[ \t]*({_KEY})[ \t]*\]
    )?
    [ \t]*(?:\#[^{_CTRL_BUT_TAB}]*)?(?:\n|\Z))""",
    re.VERBOSE)
# An array's items: the array matched _ARRAY already (scalars, commas and white space).
_ITEM = re.compile(rf"(?P<basic>{_BASIC})|(?P<literal>{_LITERAL})|(?P<number>{_NUMBER})"
                   rf"|(?P<bool>{_BOOL})")
# A backslash at the end of a line in a multi-line string: it, the line break and the
# white space that follows go.
_LINE_ENDING_BACKSLASH = re.compile(r"\\[ \t]*\n[ \t\n]*")


class _NotPlain(Exception):
    """Outside the subset: let ``tomllib`` read it."""


def _number(text: str) -> int | float:
    if "." in text or "e" in text or "E" in text:
        return float(text)
    return int(text)


def _multiline(text: str) -> str:
    body = text[3:-3]
    if body.startswith("\n"):  # a line break right after the opening quotes is not content
        body = body[1:]
    if "\\" in body:
        body = _LINE_ENDING_BACKSLASH.sub("", body)
        if "\\" in body:  # an escape: tomllib reads it
            raise _NotPlain
    return body


def _array(text: str) -> list[Any]:
    # Its items are scalars between commas and white space (_ARRAY matched it: no
    # comment inside), so each match is the next item.
    return [_SCALARS[str(item.lastgroup)](item.group())
            for item in _ITEM.finditer(text, 1, len(text) - 1)]


_SCALARS: dict[str, Callable[[str], Any]] = {
    "basic": lambda text: text[1:-1],
    "literal": lambda text: text[1:-1],
    "number": _number,
    "bool": lambda text: text == "true",
}


def loads(text: str) -> dict[str, Any] | None:
    """The document ``text`` as ``tomllib.loads`` gives it, or None where it is not
    plain (outside the subset above, or not valid TOML): read it with ``tomllib``."""
    src = text.replace("\r\n", "\n")  # as tomllib does; a lone CR is then not plain
    # All statements in one call (a match object a statement cost more than the
    # matching). They are the document only if they cover it: findall skips what does
    # not match, and a statement always ends at a line break or at the end.
    statements = _STATEMENT.findall(src)
    if sum(len(statement[0]) for statement in statements) != len(src):
        return None
    document: dict[str, Any] = {}
    table = document
    arrays_of_tables: set[str] = set()
    try:
        for (_, key, multiline, basic, literal, number, boolean, array, tables,
             name) in statements:
            if key:
                if key in table:
                    return None
                table[key] = (basic[1:-1] if basic else _number(number) if number
                              else _multiline(multiline) if multiline
                              else _array(array) if array
                              else literal[1:-1] if literal else boolean == "true")
            elif name:  # [name]
                if name in document:
                    return None
                table = document[name] = {}
            elif tables:  # [[tables]]
                if tables not in document:
                    arrays_of_tables.add(tables)
                    document[tables] = []
                elif tables not in arrays_of_tables:
                    return None
                table = {}
                document[tables].append(table)
    except _NotPlain:
        return None
    return document
