from __future__ import annotations

import pytest

from modelfleet.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_reset_starts_over() -> None:
    backoff = Backoff(0.2, 1.0)
    assert [backoff.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next() == 0.2


@pytest.mark.parametrize("first, cap", [(0, 1), (-1, 1), (2, 1)])
def test_a_backoff_that_cannot_pause_is_refused(first: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        Backoff(first, cap)


async def test_sleep_takes_the_next_pause() -> None:
    backoff = Backoff(0.01, 0.02)
    assert await backoff.sleep() == 0.01
    assert await backoff.sleep() == 0.02
