"""What scoring sees (a snapshot of queues and of one worker) and what it decides.

Plain frozen dataclasses, built by the caller (the worker coordinator, or the
simulator) from whatever it observes; scoring never looks anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Reason = Literal[
    "starving",        # messages waiting, no consumer anywhere
    "warm",            # resident here (or pinned) and worth keeping
    "pressure",        # backlog per consumer high enough to join
    "below-threshold",  # not worth taking (or, if held, still above the drop bar)
    "dropped",         # held, and the score fell below the drop bar
    "idle-cold",       # no backlog and not resident here: not worth a subscription
    "fanout-cap",      # enough workers consume it already
    "over-cap",        # more consumers than the cap: this worker steps back
    "rate-limited",    # cold, and this worker's cold budget for the minute is spent
    "no-capacity",     # cold, and this worker has no free permit or a busy loader
    "idle-join",       # below the bar, but this worker has free permits and tasks wait
    "max-subscriptions",  # worth it, but this worker holds its maximum already
    "gone",            # held, but the queue is no longer in the snapshot
]


@dataclass(frozen=True, slots=True)
class QueueView:
    """One model queue as the broker reports it now."""

    model_id: str
    backlog: int  # ready messages
    consumers: int  # all consumers, including this worker if it is subscribed
    fanout_max_workers: int = 2  # from model.toml [fanout] max_workers
    plan: str = "free"  # "free" | "pro" | "enterprise"
    pinned: bool = False  # preloaded everywhere, exempt from the fan-out cap
    batch_size: int = 1  # from model.toml [batching] max_batch_size: a batch must fit the window
    runtime: str = ""  # which of this worker's runtimes would run it (each has its own loader)
    # The highest plan priority among its recent callers (gateways' demand events); the
    # queue's own plan's priority counts too (ScoringSettings.priority).
    priority: int = 0
    # Held and over its fan-out cap: how many of the other consumers this worker knows
    # of rank ahead of it to keep the queue (``ranks.keep_rank``); it steps back when
    # that is the cap or more. None: it knows nothing of the others, and steps back at
    # random with the share of consumers over the cap.
    outranked_by: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker's own state: its subscriptions, its cache, its recent history."""

    worker_id: str
    subscriptions: frozenset[str] = frozenset()
    resident_device: frozenset[str] = frozenset()
    resident_host: frozenset[str] = frozenset()
    last_served: Mapping[str, float] = field(default_factory=dict)  # model id -> time
    recent_cold_subscribes: tuple[float, ...] = ()  # times of past cold subscriptions
    free_permits: int = 1
    permits_cap: int = 1
    # Models being loaded here (running or waiting for the loader): they count
    # as device-warm (a second load elsewhere would only race this one) and
    # they occupy the loader, so this worker takes no new cold work meanwhile.
    loading: frozenset[str] = frozenset()
    # Free load slots per runtime (runtime name -> slots). None: one loader of
    # ``ScoringSettings.max_loads_for_cold`` slots shared by every model.
    loader_room: Mapping[str, int] | None = None
    # Tasks running here now, per model (for the prefetch windows).
    running: Mapping[str, int] = field(default_factory=dict)
    # The prefetch window each held queue has now.
    prefetch: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to change: queues to start and stop consuming, and why.

    ``cold`` is the subset of ``subscribe`` for models not resident here: the
    caller appends ``now`` to its ``recent_cold_subscribes`` once per entry.
    ``scores`` and ``reasons`` cover every queue in the snapshot (and every
    held subscription) for debugging and metrics.
    """

    subscribe: frozenset[str]
    unsubscribe: frozenset[str]
    scores: Mapping[str, float]
    reasons: Mapping[str, Reason]
    cold: frozenset[str] = frozenset()
    # The prefetch window to set, for every queue subscribed anew and every held one
    # whose window should change; a held queue missing here keeps the window it has.
    prefetch: Mapping[str, int] = field(default_factory=dict)

    def apply(self, subscriptions: frozenset[str]) -> frozenset[str]:
        """The subscriptions after this decision, from the ones held before."""
        return (subscriptions - self.unsubscribe) | self.subscribe
