"""How a simulated coordinator carries a decision out: ``scheduling.actions_for``'s
steps one after another, each after what it waits for (a fresh count before a cold
subscription, the broker's subscribe), as ``modelfleet.worker.coordinator`` does.

``PullActing`` is a base of ``modelfleet.sim.pull.PullAffinity``.
"""

from __future__ import annotations

from collections import deque
from functools import partial

from modelfleet.scheduling import Action
from modelfleet.sim.pull_gather import PullGathering
from modelfleet.sim.pull_state import Consumer, Coordinator
from modelfleet.sim.worker import Task


class PullActing(PullGathering):
    """Subscribing and unsubscribing, step by step."""

    def _dispatch(self, model: int) -> None:
        """Deliver what ``model``'s queue holds (``PullAffinity._dispatch``)."""
        raise NotImplementedError

    def _requeue_front(self, model: int, task: Task) -> None:
        """Put ``task`` back at the head of its queue (``PullAffinity._requeue_front``)."""
        raise NotImplementedError

    def _rescored(self, coord: Coordinator) -> None:
        """The re-score is carried out (``PullAffinity._rescored``)."""
        raise NotImplementedError

    def _act(self, coord: Coordinator, steps: deque[Action]) -> None:
        """Carry ``scheduling.actions_for`` out step by step, each after what it waits for."""
        sim = self.sim
        costs = sim.config.broker_costs
        index_of = sim.index_of
        while steps:
            action = steps.popleft()
            model = index_of[action.model_id]
            if action.kind == "unsubscribe":
                self._unsubscribe(coord, model)
            elif action.kind == "prefetch":
                consumer = coord.consumers.get(model)
                if consumer is not None and consumer.window != action.window:
                    consumer.window = action.window
                    coord.windows = {**coord.windows, model: action.window}
                    coord.version += 1
                    self._dispatch(model)
            elif action.cold:
                # A fresh count first: another worker may have taken it since the snapshot.
                sim.after(costs.count_s, partial(self._cold, coord, model, action, steps))
                return
            else:
                sim.after(costs.subscribe_s, partial(self._subscribed, coord, model,
                                                     action.window, steps))
                return
        self._rescored(coord)

    def _cold(self, coord: Coordinator, model: int, action: Action,
              steps: deque[Action]) -> None:
        sim = self.sim
        if action.still_open(len(self._consumers[model])):
            coord.worker.recent_cold.append(sim.now)
            coord.version += 1
            sim.after(sim.config.broker_costs.subscribe_s,
                      lambda: self._subscribed(coord, model, action.window, steps))
        else:
            self._act(coord, steps)

    def _subscribed(self, coord: Coordinator, model: int, window: int,
                    steps: deque[Action]) -> None:
        if model not in coord.consumers:
            self._fold_heard(coord)  # heard while not held here: by the consumers then
            coord.version += 1
            consumer = Consumer(model, max(1, window), coord.worker.index)
            coord.consumers[model] = consumer
            coord.windows = {**coord.windows, model: consumer.window}
            coord.worker.subscriptions = coord.worker.subscriptions | {self._names[model]}
            self._consumers[model].append(consumer)
            self._dispatch(model)
        self._act(coord, steps)

    def _unsubscribe(self, coord: Coordinator, model: int) -> None:
        if model not in coord.consumers:
            return
        self._fold_heard(coord)  # heard while held here: by the consumers then
        consumer = coord.consumers.pop(model)
        coord.windows = {m: w for m, w in coord.windows.items() if m != model}
        coord.version += 1
        coord.worker.subscriptions = coord.worker.subscriptions - {self._names[model]}
        consumer.cancelled = True
        self._consumers[model].remove(consumer)
        # The broker takes back what was never taken out of the buffer (each to the
        # head, as the embedded broker does), then the loop's own delivery goes back.
        while consumer.buffer:
            task = consumer.buffer.popleft()
            consumer.held -= 1
            self._requeue_front(model, task)
        if consumer.blocked is not None:
            task, consumer.blocked = consumer.blocked, None
            consumer.held -= 1
            self._requeue_front(model, task)
            coord.waiters.remove(consumer)
        self._dispatch(model)

