"""Model queues found missing, so that nobody asks the broker for them again until the
fleet says something may wait there.

At a catalog of thousands most models resident on some worker have no queue: their
requests came by the cold lane, and an idle queue expires (``broker.queue_idle_expiry_s``).
Yet two loops count the queues of resident models: a worker's re-score (each full one,
every resident model's; each woken one, every candidate never counted) and a gateway's
fleet summary (every ``/metrics`` scrape and dashboard poll, every model resident
anywhere). On RabbitMQ a count is a passive declare, and a passive declare of a missing
queue is answered by closing the channel it was sent on: thousands of closes a minute,
some of which raced aiormq's reopen of the same channel number, and RabbitMQ then
closed the whole connection (README "5,000 models", round 6's 504).

A queue comes to exist only when a task is published to it, and every such publish is
announced (``{"kind": "demand"}``): a gateway's at once and again every
``gateway.demand_announce_interval_s`` while its request waits; a worker's hand-back or
passed-on lane task; a dead-letter replay. So a queue found missing is not asked for
again until a demand event names its model (``appeared``), or ``recheck_s`` has passed
(an announcement lost with a connection, or a publisher that does not announce), or
the events stream broke (``forget_all``).

Cost: O(1) per mark and per demand event, O(asked) per filter, O(expired) to age.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

# A queue found missing is asked for again after this long even if no demand event named
# it: what a lost announcement can cost at most.
RECHECK_S = 60.0


class MissingQueues:
    """Queues found missing lately, each until it may exist again."""

    def __init__(self, clock: Callable[[], float], recheck_s: float = RECHECK_S) -> None:
        self._recheck_s = recheck_s
        self._clock = clock
        self._since: OrderedDict[str, float] = OrderedDict()  # model -> found missing at

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, model_id: object) -> bool:
        self._age()
        return model_id in self._since

    def found_missing(self, model_ids: Iterable[str]) -> None:
        """The broker has no queue for these models (a count left them out)."""
        now = self._clock()
        for model_id in model_ids:
            self._since.pop(model_id, None)
            self._since[model_id] = now  # newest last: ageing pops from the front

    def appeared(self, model_id: str) -> None:
        """A task may wait in this model's queue now (a demand event named it)."""
        self._since.pop(model_id, None)

    def forget_all(self) -> None:
        """Announcements may have been lost (the events stream broke): ask for each again."""
        self._since.clear()

    def to_ask(self, model_ids: Iterable[str]) -> set[str]:
        """Of these queues, those worth asking the broker for: all but the missing ones."""
        self._age()
        return {m for m in model_ids if m not in self._since}

    def _age(self) -> None:
        horizon = self._clock() - self._recheck_s
        since = self._since
        while since:
            model_id, at = next(iter(since.items()))
            if at > horizon:
                break
            del since[model_id]
