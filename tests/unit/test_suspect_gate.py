"""SuspectGate: ordinary tasks share a runtime; a redelivered suspect runs alone."""

from __future__ import annotations

import asyncio

from modelfleet.worker.gate import CrashWitness, SuspectGate


async def test_suspect_waits_for_running_tasks_and_blocks_new_ones() -> None:
    gate = SuspectGate()
    log: list[str] = []
    first_in = asyncio.Event()
    release_first = asyncio.Event()

    async def ordinary(name: str, hold: asyncio.Event | None = None) -> None:
        async with gate.slot(suspect=False):
            log.append(f"{name} in")
            if hold is not None:
                first_in.set()
                await hold.wait()
            log.append(f"{name} out")

    async def suspect() -> None:
        async with gate.slot(suspect=True):
            log.append("suspect in")
            await asyncio.sleep(0)
            log.append("suspect out")

    a = asyncio.create_task(ordinary("a", release_first))
    await first_in.wait()
    s = asyncio.create_task(suspect())
    await asyncio.sleep(0.01)
    b = asyncio.create_task(ordinary("b"))  # arrives while the suspect waits: goes after it
    await asyncio.sleep(0.01)
    assert log == ["a in"]
    release_first.set()
    await asyncio.gather(a, s, b)
    assert log == ["a in", "a out", "suspect in", "suspect out", "b in", "b out"]


async def test_ordinary_tasks_share() -> None:
    gate = SuspectGate()
    inside = 0
    most = 0

    async def ordinary() -> None:
        nonlocal inside, most
        async with gate.slot(suspect=False):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(ordinary() for _ in range(5)))
    assert most == 5


def test_crash_witness_says_who_was_alone_on_the_runtime() -> None:
    witness = CrashWitness()
    with witness.on_runtime() as first_alone:
        assert first_alone()  # nothing else in flight (yet)
        with witness.on_runtime() as second_alone:
            assert not second_alone()  # entered beside the first
        assert not first_alone()  # someone ran beside it while it was in flight
    with witness.on_runtime() as later_alone:
        assert later_alone()  # the others are gone: alone again
