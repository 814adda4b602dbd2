"""Act: a decision as the ordered steps a worker carries out. Pure.

The coordinator runs these against the broker (``worker/coordinator.py``), the
simulator against its broker model (``sim/pull.py``): drops first (they free permits
and load slots), then new subscriptions in model order, then the windows of the
queues still held. A cold subscription is taken only if a fresh count still finds its
queue under the fan-out cap: another worker may have taken it since the snapshot, and
a cold load is expensive enough to be worth one more count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.step import Snapshot
from modelfleet.scheduling.views import Decision

ActionKind = Literal["unsubscribe", "subscribe", "prefetch"]

@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    model_id: str
    window: int = 0  # subscribe, prefetch: the prefetch window
    # subscribe: the model is not resident here (count afresh first); unsubscribe: it
    # was not on the device here (for the metrics).
    cold: bool = False
    # A cold subscription is taken only while its queue has fewer consumers than this,
    # by a fresh count; None: no cap (pinned).
    cap: int | None = None

    def still_open(self, consumers: int) -> bool:
        """Take this cold subscription, now that a fresh count says ``consumers``?"""
        return self.cap is None or consumers < self.cap


def actions_for(decision: Decision, snapshot: Snapshot,
                settings: ScoringSettings) -> tuple[Action, ...]:
    worker = snapshot.worker
    views = {q.model_id: q for q in snapshot.queues}
    steps = [Action("unsubscribe", m, cold=m not in worker.resident_device)
             for m in sorted(decision.unsubscribe)]
    for model_id in sorted(decision.subscribe):
        cold = model_id in decision.cold
        view = views.get(model_id)
        cap = None if view is None or view.pinned else settings.fanout_cap(
            view.fanout_max_workers, view.plan)
        steps.append(Action("subscribe", model_id, decision.prefetch.get(model_id, 1),
                            cold, cap))
    held = worker.subscriptions - decision.unsubscribe
    for model_id, window in decision.prefetch.items():
        if model_id in held and worker.prefetch.get(model_id) != window:
            steps.append(Action("prefetch", model_id, window))
    return tuple(steps)
