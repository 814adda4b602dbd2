"""Parked requests: an HTTP request waiting for the reply that names it.

A reply that finds no waiting request (a duplicate after a redelivery, or one that
arrives after its deadline or after the caller hung up) is dropped and counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from modelfleet import metrics
from modelfleet.messages import Reply


class ParkedRequests:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._parked_at: dict[str, float] = {}
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._by_model: dict[str, int] = {}
        self._model_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def park(self, request_id: str, model_id: str) -> asyncio.Future[Reply]:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._model_of[request_id] = model_id
        self._parked_at[request_id] = self._clock()
        self._by_model[model_id] = self._by_model.get(model_id, 0) + 1
        metrics.PARKED.set(len(self._waiting))
        return future

    def unpark(self, request_id: str) -> None:
        future = self._waiting.pop(request_id, None)
        if future is None:
            return
        model_id = self._model_of.pop(request_id)
        self._parked_at.pop(request_id, None)
        left = self._by_model[model_id] - 1
        if left:
            self._by_model[model_id] = left
        else:
            del self._by_model[model_id]
        metrics.PARKED.set(len(self._waiting))

    def deliver(self, reply: Reply) -> bool:
        future = self._waiting.get(reply.request_id)
        if future is None or future.done():
            metrics.LATE_REPLIES.inc()
            return False
        future.set_result(reply)
        return True

    def waiting_models(self) -> list[str]:
        return list(self._by_model)

    def waiting(self, model_id: str) -> int:
        """How many requests for ``model_id`` wait for an answer here."""
        return self._by_model.get(model_id, 0)

    def oldest_waiting_s(self) -> dict[str, float]:
        """model id -> seconds its oldest still-unanswered request has waited."""
        now = self._clock()
        oldest: dict[str, float] = {}
        for request_id, parked_at in self._parked_at.items():
            model_id = self._model_of[request_id]
            oldest[model_id] = max(oldest.get(model_id, 0.0), now - parked_at)
        return oldest
