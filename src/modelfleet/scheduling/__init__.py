"""Queue scoring: which model queues a worker consumes. Pure: no I/O, no clock, no broker.

    from modelfleet.scheduling import (ScoringSettings, QueueView, WorkerView, Decision,
                                       choose_queues)

The worker coordinator and the fleet simulator (``modelfleet.sim``) run this
same code; time and randomness come in as arguments (``now``, ``rng_seed``).
"""

from modelfleet.scheduling.scoring import (
    QueueScorer,
    choose_queues,
    cold_budget,
    is_starving,
    noise,
    score_queue,
)
from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.views import Decision, QueueView, Reason, WorkerView

__all__ = [
    "Decision",
    "QueueScorer",
    "QueueView",
    "Reason",
    "ScoringSettings",
    "WorkerView",
    "choose_queues",
    "cold_budget",
    "is_starving",
    "noise",
    "score_queue",
]
