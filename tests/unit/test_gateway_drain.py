"""RequestsInFlight: read deadlines and the drain at shutdown, on one event loop."""

from __future__ import annotations

import asyncio

import pytest

from modelfleet.gateway.inflight import RequestsInFlight, RequestTimeout, ShuttingDown


async def _waits_forever(requests: RequestsInFlight, started: asyncio.Event) -> str:
    async with requests.track():
        started.set()
        await asyncio.Event().wait()
    return "answered"


async def test_a_slow_read_is_a_request_timeout_and_the_rest_of_the_request_is_not_timed(
        ) -> None:
    requests = RequestsInFlight()
    with pytest.raises(RequestTimeout, match=r"did not arrive within 0\.05 s"):
        async with requests.track() as guard:
            with guard.reading(0.05):
                await asyncio.Event().wait()
    async with requests.track() as guard:
        with guard.reading(0.05):
            pass
        await asyncio.sleep(0.1)  # past the read deadline: no longer reading, not timed
    assert len(requests) == 0


async def test_the_drain_waits_for_requests_then_cuts_off_the_rest() -> None:
    requests = RequestsInFlight()
    started = asyncio.Event()
    waiting = asyncio.ensure_future(_waits_forever(requests, started))
    await started.wait()

    async def finishes() -> str:
        async with requests.track():
            await asyncio.sleep(0.05)
        return "answered"

    quick = asyncio.ensure_future(finishes())
    await asyncio.sleep(0)
    cut = await requests.drain(timeout_s=0.5)
    assert cut == 1
    assert await quick == "answered"
    with pytest.raises(ShuttingDown, match="shut down before the answer"):
        await waiting
    with pytest.raises(ShuttingDown, match="shutting down"):  # new ones are refused
        async with requests.track():
            pass


async def test_a_second_signal_cuts_the_drain_short() -> None:
    requests = RequestsInFlight()
    started = asyncio.Event()
    waiting = asyncio.ensure_future(_waits_forever(requests, started))
    await started.wait()
    hurry = asyncio.Event()
    hurry.set()
    assert await requests.drain(timeout_s=3600, hurry=hurry) == 1
    with pytest.raises(ShuttingDown):
        await waiting


async def test_a_request_reading_its_body_when_cut_off_is_shutting_down_not_a_timeout() -> None:
    requests = RequestsInFlight()
    started = asyncio.Event()

    async def uploading() -> None:
        async with requests.track() as guard:
            with guard.reading(3600):
                started.set()
                await asyncio.Event().wait()

    upload = asyncio.ensure_future(uploading())
    await started.wait()
    assert await requests.drain(timeout_s=0.01) == 1
    with pytest.raises(ShuttingDown):
        await upload
