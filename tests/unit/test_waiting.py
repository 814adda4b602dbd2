"""The suite's one polling helper must fail when the state never comes: a helper that
returned regardless would make every test that waits with it pass vacuously."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import eventually, eventually_blocking


async def test_eventually_returns_the_first_truthy_value_of_a_plain_or_async_check() -> None:
    calls = itertools.count(1)
    assert await eventually(lambda: next(calls) >= 3 and "third", every_s=0.001) == "third"

    async def ready() -> dict[str, int]:
        return {"n": 1}

    assert await eventually(ready) == {"n": 1}


async def test_eventually_fails_naming_what_never_held() -> None:
    seen: list[int] = []
    with pytest.raises(AssertionError, match=r"the queue gone did not hold within 0\.2 s"):
        await eventually(lambda: seen.append(1), 0.2, what="the queue gone", every_s=0.01)
    assert len(seen) > 2  # it kept asking until the deadline


def test_eventually_blocking_returns_a_value_or_fails_naming_it() -> None:
    calls = itertools.count(1)
    assert eventually_blocking(lambda: next(calls) == 2, every_s=0.001) is True
    with pytest.raises(AssertionError, match=r"p pinned did not hold within 0\.1 s"):
        eventually_blocking(lambda: 0, 0.1, what="p pinned", every_s=0.01)
