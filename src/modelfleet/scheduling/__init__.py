"""Queue scoring: which model queues a worker consumes. Pure: no I/O, no clock, no broker.

    from modelfleet.scheduling import Snapshot, decide, ScoringSettings, QueueView, WorkerView

The worker coordinator and the fleet simulator (``modelfleet.sim``) share all three
steps: ``snapshot_of`` (observe), ``decide``, ``actions_for`` (act); time and
randomness come in as arguments.
"""

from modelfleet.scheduling.act import Action, actions_for
from modelfleet.scheduling.observe import (
    Observation,
    QueueFacts,
    candidates,
    cannot_matter,
    snapshot_of,
)
from modelfleet.scheduling.ranks import MAX_TAKE_TURNS, keep_rank, take_turn
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
from modelfleet.scheduling.step import (
    Snapshot,
    decide,
    decision_holds,
    prefetch_window,
    work_waiting,
)
from modelfleet.scheduling.views import Decision, QueueView, Reason, WorkerView

__all__ = [
    "MAX_TAKE_TURNS",
    "Action",
    "Decision",
    "Observation",
    "QueueFacts",
    "QueueScorer",
    "QueueView",
    "Reason",
    "ScoringSettings",
    "Snapshot",
    "WorkerView",
    "actions_for",
    "candidates",
    "cannot_matter",
    "choose_queues",
    "cold_budget",
    "decide",
    "decision_holds",
    "is_starving",
    "keep_rank",
    "loader_room",
    "noise",
    "prefetch_window",
    "score_queue",
    "snapshot_of",
    "take_turn",
    "work_waiting",
]
