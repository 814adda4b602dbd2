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


async def test_suspects_woken_across_the_end_of_a_yield_do_not_wait_for_each_other() -> None:
    """Woken together when the runtime frees, a suspect from a crash checks its turn a
    moment before it stops yielding (another waits ahead: a suspect from no crash), and
    that other checks a moment after (the first one is ahead now). Neither may wait for
    a notify that nothing sends: the first goes in once its yield is over."""
    times = iter([0.0, 0.0,  # the holder comes and goes in
                  0.0,  # the crash's suspect comes
                  0.5,  # the suspect from no crash comes
                  0.99,  # the crash's suspect checks: still yielding to the other
                  1.01])  # the other checks: the crash's suspect is done yielding
    gate = SuspectGate(clock=lambda: next(times, 2.0))  # yields 1 s
    went_in: list[str] = []
    holding = asyncio.Event()
    release = asyncio.Event()

    async def suspect(name: str, crashes: int, hold: bool = False) -> None:
        async with gate.slot(suspect=True, crashes=crashes):
            went_in.append(name)
            if hold:
                holding.set()
                await release.wait()

    holder = asyncio.create_task(suspect("holder", 0, hold=True))
    await holding.wait()
    from_crash = asyncio.create_task(suspect("from a crash", 1))
    await asyncio.sleep(0.01)
    from_no_crash = asyncio.create_task(suspect("from no crash", 0))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, from_crash, from_no_crash), timeout=5)
    assert went_in == ["holder", "from a crash", "from no crash"]
