"""Keeping a process's catalog current: every ``repo_refresh_s``, and at once when asked.

Only manifests whose stamp changed are read (``Catalog.scan``, in a thread: the loop
keeps serving), and the result is installed in one swap (``Catalog.apply``). A scan of a
large repository waits at least ``COST_FACTOR`` times as long as the last one took
before the next periodic one, so refreshing takes at most a small share of a core
whatever the repository's size. A manifest that does not validate is logged once and
left out (or keeps its last good version); the others keep serving.

``refresh_now`` asks for a scan that starts after the call (a publish that just wrote a
version awaits it: the version is in the catalog when it returns); ``request`` asks for
one without waiting (another process announced a change). Requests made while a scan
runs are served together by the next one: one scan at a time, never a queue of them.

Given the deployment's manifest cache (``parse_cache.ManifestCache``), a refresh that
parsed manifests writes it afresh (in a thread, after the callers waiting on the scan
were answered; its CPU counts in the refresh's cost), so that the next start parses
only what changed after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from modelfleet.errors import ManifestError
from modelfleet.repository.catalog import Catalog, CatalogChange
from modelfleet.repository.parse_cache import ManifestCache
from modelfleet.repository.store import ModelStore, store_folders

log = logging.getLogger("modelfleet")

# A periodic refresh's CPU is at most 1/50 of the time between refreshes (2 % of a core).
COST_FACTOR = 50.0


class CatalogRefresher:
    def __init__(self, store: ModelStore, catalog: Catalog, interval_s: float,
                 cache: ManifestCache | None = None) -> None:
        self._store = store
        self._catalog = catalog
        self._cache = cache
        self._interval_s = interval_s
        self._wake = asyncio.Event()
        self._waiting: list[asyncio.Future[CatalogChange]] = []
        self._seen_invalid: set[str] = set()

    def request(self) -> None:
        """Scan again soon, not waiting for the interval."""
        self._wake.set()

    async def refresh_now(self) -> CatalogChange:
        """What a scan started after this call changed (its error, if it failed)."""
        done: asyncio.Future[CatalogChange] = asyncio.get_running_loop().create_future()
        self._waiting.append(done)
        self._wake.set()
        return await done

    async def run(self) -> None:
        """Refresh until cancelled."""
        interval = self._interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()
            waiting, self._waiting = self._waiting, []
            try:
                change, parses, cost_s = await self._refresh()
            except Exception as exc:  # e.g. the remote repository is unreachable a while
                log.exception("repository: refresh failed; serving the catalog as it was")
                for future in waiting:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for future in waiting:
                if not future.done():
                    future.set_result(change)
            if parses and self._cache is not None:
                cost_s += await self._keep(self._cache)
            interval = max(self._interval_s, COST_FACTOR * cost_s)

    async def _keep(self, cache: ManifestCache) -> float:
        """Write the manifest cache (in a thread); its CPU seconds."""
        started = time.process_time()
        await asyncio.to_thread(lambda: cache.save(self._catalog.known(),
                                                   store_folders(self._store)))
        return time.process_time() - started

    async def _refresh(self) -> tuple[CatalogChange, int, float]:
        started = time.process_time(), time.perf_counter()
        update = await asyncio.to_thread(self._catalog.scan, self._store, self._report)
        # process_time: this process's CPU (the loop's share of it is small), so a busy
        # machine does not stretch the interval.
        cost_s = time.process_time() - started[0]
        change = self._catalog.apply(update)
        if change:
            parts = [f"{len(ids)} {what} {_few(ids)}" for what, ids in (
                ("added", change.added), ("removed", change.removed),
                ("changed", change.changed)) if ids]
            log.info("repository: %s (generation %d; %d of %d manifests read, %.2fs)",
                     "; ".join(parts), change.generation, update.parses, update.stamps,
                     time.perf_counter() - started[1])
        return change, update.parses, cost_s

    def _report(self, exc: ManifestError) -> None:
        if str(exc) not in self._seen_invalid:  # once per problem, not every refresh
            self._seen_invalid.add(str(exc))
            log.error("repository: %s (left out until fixed)", exc)


def _few(models: tuple[str, ...], shown: int = 10) -> str:
    more = f" and {len(models) - shown} more" if len(models) > shown else ""
    return "(" + ", ".join(models[:shown]) + more + ")"
