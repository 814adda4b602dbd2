"""How many model queues are alive, kept from what this process did, and a warning
before that nears what the broker is sized for.

Neither AMQP 0-9-1 nor the embedded broker can list queues without walking all of them,
and walking (or passively declaring) a catalog's worth of names on every count is the
O(catalog) cost the broker must not have. So each process counts what it knows:
queues it declared (publish or subscribe) whose expiry lease has not run out, and
queues it consumes. Updated per declare and per expiry, O(log n) each.

``LiveQueueWatch`` exports the count as ``modelfleet_broker_live_queues`` (read at scrape
time, so expiries show without any event) and logs a warning once the count reaches
``live_queues_warn_fraction`` of ``max_live_queues``; again once it fell back below 90 %
of that threshold and rose to it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from modelfleet import metrics
from modelfleet.settings import BrokerSettings

log = logging.getLogger("modelfleet.broker")

# A warning re-arms once the count fell this far below its threshold (no flapping).
REARM_FRACTION = 0.9


class LiveQueueWatch:
    """The live-queue gauge of this process and the warning near the broker's limit."""

    def __init__(self, settings: BrokerSettings, count: Callable[[], int],
                 where: str) -> None:
        self._max = settings.max_live_queues
        self._threshold = max(1, int(settings.max_live_queues
                                     * settings.live_queues_warn_fraction))
        self._count = count
        self._where = where
        self._warned = False

    @property
    def threshold(self) -> int:
        return self._threshold

    def export(self) -> None:
        """Make this process's gauges read this broker (the last one connected wins)."""
        metrics.BROKER_LIVE_QUEUES.set_function(self._count)
        metrics.BROKER_MAX_LIVE_QUEUES.set(self._max)

    def unexport(self) -> None:
        metrics.BROKER_LIVE_QUEUES.set_function(lambda: 0)

    def check(self) -> int:
        """Call after a queue was declared; returns the count."""
        count = self._count()
        if count >= self._threshold and not self._warned:
            self._warned = True
            log.warning(
                "%d live model queues on %s: %.0f%% of broker.max_live_queues=%d; "
                "size the broker for more (README \"The broker at scale\") or shorten "
                "broker.queue_idle_expiry_s", count, self._where, 100 * count / self._max,
                self._max)
        elif count < self._threshold * REARM_FRACTION:
            self._warned = False
        return count
