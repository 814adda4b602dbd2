"""Keeping a runtime's RSS under its line: shed models while over it, and let loads wait.

``MemoryGuard`` (``runtime/memory.py``) says whether RSS is over the line; this carries
out what follows. While over, the runtime sheds its lowest-ranked models (the cache's
``shed``: host tier first, never a pin) until it is back under, one task at a time. A
load that finds it over waits for that shedding (at most ``SHED_WAIT_S``) and starts
once it is back under; it is refused (``NoCapacity``: the worker asks another runtime)
only if shedding cannot bring RSS under in that time: memory held outside the models'
books, a handler's allocations or a leak. An episode is logged as a warning once it sheds
a model or refuses a load, and then only once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from modelfleet.cache import Eviction
from modelfleet.errors import NoCapacity
from modelfleet.runtime.memory import MemoryGuard

log = logging.getLogger("modelfleet.runtime")

# How long a load waits for its runtime's own shedding when RSS is over the line, before
# it is refused: shedding evicts in milliseconds, so a runtime a few hundred KB over (the
# allocator's slack after a budget moved away) takes the load instead of refusing it.
SHED_WAIT_S = 1.0


class Shedder:
    """Sheds models while ``memory`` is over its line; admits loads once it is under.

    ``shed_one`` names the next model to drop (None: nothing left to shed);
    ``carry_out`` drops it; ``refused`` counts a load turned away.
    """

    def __init__(self, memory: MemoryGuard, shed_one: Callable[[], Eviction | None],
                 carry_out: Callable[[list[Eviction]], Awaitable[None]],
                 refused: Callable[[], None]) -> None:
        self._memory = memory
        self._shed_one = shed_one
        self._carry_out = carry_out
        self._refused = refused
        self._task: asyncio.Task[None] | None = None
        self._stuck_episode = 0  # the episode whose "nothing left to shed" was logged

    async def admit(self, model_id: str) -> None:
        """Return once a load may start: RSS under its line, after shedding if need be;
        ``NoCapacity`` if shedding did not bring it under within ``SHED_WAIT_S``."""
        if self._memory.check() is None:
            return  # under its line: the usual case, one RSS read
        await asyncio.wait([self._start()], timeout=SHED_WAIT_S)
        try:
            self._memory.admit(model_id)
        except NoCapacity:
            self._refused()
            self._start()
            raise

    def watch(self) -> None:
        """Shed if RSS is over its line without any load asking (a handler grew)."""
        if self._memory.check() is not None:
            self._start()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._shed(), name="shed-memory")
        return self._task

    async def _shed(self) -> None:
        """Drop models, lowest-ranked first, until RSS is back under its line."""
        memory = self._memory
        shed = 0
        while (over := memory.reclaim()) is not None:
            memory.warn(over)
            eviction = self._shed_one()
            if eviction is None:
                if self._stuck_episode != memory.episodes:  # once per episode
                    self._stuck_episode = memory.episodes
                    log.warning("runtime still over its memory budget with nothing left to "
                                "shed (%s): memory is held outside the models' books (a "
                                "handler's allocations, or a leak); loads stay refused until "
                                "it falls", memory.exceeded())
                return
            await self._carry_out([eviction])
            shed += 1
        if shed:
            log.info("shed %d model(s) to come back under the memory budget", shed)
        memory.back_under()
