"""Headless Chromium (Debian's package) for page tests: the DOM after scripts ran, and
screenshots. No WebDriver: Chromium's own --dump-dom and --screenshot modes are enough
for a page that renders what it fetches, and have nothing to keep in step."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

# As root on a machine with a closed network: no sandbox, no background connections.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise AssertionError("no chromium on PATH: run .ci/tools-up (Debian's chromium)")
    return path


def _run(url: str, extra: list[str], timeout_s: float) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(url: str, settle_ms: int = 5000, timeout_s: float = 90) -> Dom:
    """The page's DOM after its scripts ran for ``settle_ms`` of virtual time."""
    html = _run(url, [f"--virtual-time-budget={settle_ms}", "--dump-dom"], timeout_s)
    dom = Dom()
    dom.feed(html)
    return dom


def screenshot(url: str, path: Path, size: tuple[int, int] = (1280, 1000),
               settle_ms: int = 5000, timeout_s: float = 90) -> Path:
    _run(url, [f"--virtual-time-budget={settle_ms}", f"--window-size={size[0]},{size[1]}",
               f"--screenshot={path}"], timeout_s)
    return path


class Dom(HTMLParser):
    """Text by element id, and table rows (their data-* attributes and cells' text)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.attrs_by_id: dict[str, dict[str, str]] = {}
        self.rows: dict[str, list[dict[str, object]]] = {}
        self._open: list[tuple[str, str | None]] = []  # (tag, id)
        self._table: str | None = None
        self._row: dict[str, object] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        element_id = values.get("id")
        if element_id:
            self.by_id.setdefault(element_id, "")
            self.attrs_by_id[element_id] = values
        if tag == "table" and element_id:
            self._table = element_id
            self.rows[element_id] = []
        elif tag == "tr" and self._table is not None:
            self._row = {"data": {k[5:]: v for k, v in values.items()
                                  if k.startswith("data-")}, "cells": []}
        elif tag == "td" and self._row is not None:
            self._cell = []
        if tag not in ("br", "img", "input", "meta", "link", "option"):
            self._open.append((tag, element_id))

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row["cells"].append("".join(self._cell).strip())  # type: ignore[attr-defined]
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            if self._row["cells"]:
                self.rows[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, element_id in self._open:
            if element_id:
                self.by_id[element_id] += data
        if self._cell is not None:
            self._cell.append(data)

    def text(self, element_id: str) -> str:
        return self.by_id.get(element_id, "").strip()
