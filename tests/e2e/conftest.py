"""What end-to-end tests share: the processes a test started, stopped after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procs import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Append every process the test starts; each is stopped when the test ends."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()
