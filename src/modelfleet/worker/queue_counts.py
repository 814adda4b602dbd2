"""What a worker knows of its candidate queues' backlogs and consumers, and what it costs.

A count comes from one of two places: the broker (a passive declare on RabbitMQ, ~0.6 ms,
on a channel of its own) or the fleet's announcements (``worker/announced.py``: gateways
say how many tasks wait, workers say what they hold). ``QueueCounts`` keeps the counts
of the candidates the coordinator last observed and chooses, at each re-score, which of
them to ask the broker for:

- a full re-score (each tick) asks for every candidate, except those announced lately
  (an estimate stands in); at least every ``EXACT_EVERY_S`` it asks for all of them;
- a woken re-score asks only for what a demand event marked (``mark``), what is held
  with a backlog, and what was never counted;
- a queue the broker said is missing is not asked for again until a demand event names
  it (``broker.missing_queues``), nor is the queue of a model a cold lane brought here
  with no demand heard for it (``presume_missing``);
- a queue taken on an estimate is counted exactly before the worker acts on it
  (``count_exactly``, ``confirm``).

Why queue discovery works this way (demand announcements + exact counts): the
RabbitMQ management API is off by default on Debian's package, lists 2,000 queues in
0.2-0.5 s and reports counts several seconds stale; the event-exchange plugin is off
by default too and says a queue exists, not what is waiting in it. Gateways already
know exactly which models have requests waiting, so they announce it on a fanout
event (once per model per interval while requests wait, so a worker that starts late
learns of a backlog within a second), with how many wait there. Workers estimate the
queues they do not hold from that and from each other's announced subscriptions
(``worker/announced.py``), and ask for exact counts (a passive declare, ~0.6 ms each,
on a channel of its own because a missing queue closes the channel) only for what they
hold, is resident or pinned here, has no fresh announced count, or is about to be
taken. It works identically on the embedded broker, and its cost grows with the
candidates, not with the catalog.

The coordinator owns what the worker holds; this owns what it counted. The backlog gauge
(``modelfleet_queue_backlog``) shows the broker's counts of the current candidates only.
Every step costs O(candidates) or O(asked), never O(catalog).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from modelfleet import metrics
from modelfleet.broker import Broker, QueueStats
from modelfleet.broker.missing_queues import MissingQueues
from modelfleet.worker.announced import AnnouncedCounts

# Every candidate is counted on the broker at least this often, announced or not (a
# lost announcement costs at most this long); in between, announcements stand in.
EXACT_EVERY_S = 10.0


class QueueCounts:
    """The candidate queues' counts: the broker's, or estimates from announcements."""

    def __init__(self, broker: Broker, announced: AnnouncedCounts) -> None:
        self._broker = broker
        self._announced = announced
        self.missing = MissingQueues(time.monotonic)
        self._counts: dict[str, QueueStats] = {}  # candidate queues as last counted
        self._estimated: set[str] = set()  # those whose count is an announced estimate
        self._gauged: set[str] = set()  # models with a modelfleet_queue_backlog gauge
        self._marked: set[str] = set()  # queues to count afresh at the next re-score
        self._exact_at = -1e9  # the last re-score that counted every candidate

    def get(self, model_id: str) -> QueueStats | None:
        return self._counts.get(model_id)

    def estimated(self, model_ids: Iterable[str]) -> set[str]:
        """Of these, the queues whose count is an announced estimate."""
        return self._estimated.intersection(model_ids)

    # -- what the fleet's events say -------------------------------------------------
    def demand_heard(self, model_id: str) -> None:
        """A task may wait in its queue now: it exists again if it was missing."""
        self.missing.appeared(model_id)

    def presume_missing(self, model_id: str) -> None:
        """This queue has no count and no demand was heard for it: take it as missing
        without asking the broker, until a demand event names it (``demand_heard``)."""
        if model_id not in self._counts:
            self.missing.found_missing((model_id,))

    def marked(self, model_id: str) -> bool:
        return model_id in self._marked

    def mark(self, model_id: str) -> None:
        """Count this queue afresh at the next re-score, woken or not."""
        self._marked.add(model_id)

    def events_lost(self) -> None:
        """The events stream broke: demand said meanwhile is lost."""
        self.missing.forget_all()

    # -- one re-score ---------------------------------------------------------------
    def exact_due(self, full: bool) -> bool:
        """Is this (full) re-score the one that counts every candidate on the broker?"""
        if full and time.monotonic() - self._exact_at >= EXACT_EVERY_S:
            self._exact_at = time.monotonic()
            return True
        return False

    def keep_only(self, wanted: set[str]) -> None:
        """Forget the counts of queues that are no candidates any more."""
        for model_id in [m for m in self._counts if m not in wanted]:
            del self._counts[model_id]
            self._ungauge(model_id)  # a gauge nobody updates would go stale
        self._estimated &= wanted

    def to_ask(self, wanted: set[str], full: bool, held_backlog: set[str]) -> set[str]:
        """The candidates to count afresh: all of them each tick; when woken, what was
        marked, never counted, or held with a backlog (its window is sized to what
        waits there)."""
        if full:
            ask = set(wanted)
        else:
            ask = ((self._marked | held_backlog) & wanted) | {
                m for m in wanted if m not in self._counts}
        self._marked.clear()
        return ask

    def estimate(self, ask: set[str], now: float, here: Callable[[str], bool]) -> set[str]:
        """Of the queues to count, those the fleet's announcements say enough of: not
        ``here`` (held, resident, pinned, loading or running here: those are counted
        exactly), with a fresh announced count. Their estimates stand as their counts;
        returns them."""
        estimated = set()
        for model_id in ask:
            if here(model_id):
                continue
            said = self._announced.estimate(model_id, now)
            if said is not None:
                self._counts[model_id] = QueueStats(model_id, *said)
                self._ungauge(model_id)  # the gauge shows the broker's counts only
                estimated.add(model_id)
        self._estimated |= estimated
        return estimated

    def announced_idle(self, model_id: str, now: float) -> bool:
        """Announced lately with nothing waiting."""
        said = self._announced.estimate(model_id, now)
        return said is not None and said[0] == 0

    async def refresh(self, ask: set[str]) -> None:
        """Count these on the broker, but for queues it said lately are missing."""
        ask = self.missing.to_ask(ask)
        if ask:
            await self.ask_broker(ask)
            self._estimated -= ask

    async def count_exactly(self, model_ids: set[str]) -> None:
        await self.ask_broker(model_ids)
        self._estimated -= model_ids

    async def ask_broker(self, model_ids: set[str]) -> dict[str, QueueStats]:
        """The broker's exact counts of these queues; those it has not are no candidates
        (no count) and are not asked for again until announced (``MissingQueues``)."""
        stats = await self._broker.queue_stats(sorted(model_ids))
        self._counted(stats)
        missing = model_ids - stats.keys()
        for model_id in missing:
            self._counts.pop(model_id, None)  # no such queue (any more)
        self.missing.found_missing(missing)
        return stats

    async def confirm(self, model_id: str) -> QueueStats | None:
        """A fresh count of one queue before a cold take; None if it is missing, or was
        taken on an estimate and nothing waits there now."""
        stats = (await self.ask_broker({model_id})).get(model_id)
        if model_id in self._estimated:  # taken on announced counts: nothing may wait now
            self._estimated.discard(model_id)
            if stats is None or stats.backlog == 0:
                return None
        return stats

    def _counted(self, stats: dict[str, QueueStats]) -> None:
        """Take the broker's exact counts (and show them as the backlog gauge)."""
        self._counts.update(stats)
        for model_id, qs in stats.items():
            metrics.QUEUE_BACKLOG.labels(model_id).set(qs.backlog)
            self._gauged.add(model_id)

    def _ungauge(self, model_id: str) -> None:
        if model_id in self._gauged:
            self._gauged.discard(model_id)
            with contextlib.suppress(KeyError):
                metrics.QUEUE_BACKLOG.remove(model_id)
