"""Queue scoring: which model queues a worker consumes. Pure: no I/O, no clock, no broker.

    from modelfleet.scheduling import Snapshot, decide, ScoringSettings, QueueView, WorkerView

The worker coordinator and the fleet simulator (``modelfleet.sim``) build the same
``Snapshot`` and run the same ``decide``; time and randomness come in as arguments.
"""

from modelfleet.scheduling.scoring import (
    QueueScorer,
    choose_queues,
    cold_budget,
    is_starving,
    loader_room,
    noise,
    score_queue,
)
from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.step import Snapshot, decide, prefetch_window, work_waiting
from modelfleet.scheduling.views import Decision, QueueView, Reason, WorkerView

__all__ = [
    "Decision",
    "QueueScorer",
    "QueueView",
    "Reason",
    "ScoringSettings",
    "Snapshot",
    "WorkerView",
    "choose_queues",
    "cold_budget",
    "decide",
    "is_starving",
    "loader_room",
    "noise",
    "prefetch_window",
    "score_queue",
    "work_waiting",
]
