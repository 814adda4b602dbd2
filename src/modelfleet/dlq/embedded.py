"""``modelfleet serve`` archives its embedded broker's dead letters itself.

The embedded broker lives inside one process, so no ``modelfleet dlq archive`` can
consume its dead-letter queue from outside; ``serve`` runs the same archiver in-process
for its whole life, into the same archive the ``dlq`` command reads by default
(``$MODELFLEET_DLQ_DB``, else ``~/.cache/modelfleet/dlq.sqlite3``). ``modelfleet dlq list``
and ``show`` then work as with RabbitMQ, and ``modelfleet dlq replay --gateway URL``
replays through the gateway's HTTP API. An archive that fails is retried every few
seconds; meanwhile the embedded dead-letter queue keeps at most
``broker.dead_letter_max`` letters (the oldest go first, counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from modelfleet.broker.base import Broker
from modelfleet.dlq.archive import Archive, ArchiveError, open_archive
from modelfleet.dlq.consumer import archive_dead_letters
from modelfleet.dlq.records import DeadLetterRecord
from modelfleet.errors import BrokerUnavailable, ModelfleetError

log = logging.getLogger(__name__)

RETRY_S = 5.0


@contextlib.asynccontextmanager
async def archiving(broker: Broker, location: str) -> AsyncIterator[None]:
    """Archive ``broker``'s dead letters into ``location`` while the block runs."""
    stop = asyncio.Event()
    task = asyncio.create_task(_archive_until(broker, location, stop), name="dlq-archiver")
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait({task})


async def _archive_until(broker: Broker, location: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        archive: Archive | None = None
        try:
            archive = await asyncio.to_thread(open_archive, location)
            log.info("dead letters are archived to %s", location)
            await archive_dead_letters(broker, archive, stop, on_record=_report)
        except (ArchiveError, BrokerUnavailable, ModelfleetError) as exc:
            log.error("dead-letter archive %s: %s; retrying in %.0fs", location, exc, RETRY_S)
        finally:
            if archive is not None:
                archive.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RETRY_S)


def _report(record: DeadLetterRecord, new: bool) -> None:
    if new:
        log.info("dead letter %s (%s) archived as %s/%s", record.request_id, record.model_id,
                 record.failure_class, record.rule)
