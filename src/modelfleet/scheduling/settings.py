"""Every weight and threshold of queue scoring, with defaults that work.

Nested into the app's settings as ``Settings.scheduling``; frozen like every
other section. The defaults were tuned with ``modelfleet sim`` (see
``bench/README_sim.md``): change them there first, then here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ScoringSettings(BaseModel):
    """Weights, thresholds and limits of :func:`modelfleet.scheduling.choose_queues`.

    A queue's score is ``warmth + pressure + stickiness + noise``; a queue with
    messages and no consumer anywhere scores ``starvation_score`` instead.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Warmth: a request for a device-resident model costs milliseconds, one in
    # host memory costs a PCIe copy, anything else costs a full load (seconds).
    device_warmth_weight: float = Field(default=4.0, ge=0)
    host_warmth_weight: float = Field(default=2.0, ge=0)
    # Pinned models are preloaded on every worker: as warm as device-resident.
    pinned_warmth_weight: float = Field(default=4.0, ge=0)

    # Pressure: weight * log1p(backlog_per_consumer / pressure_scale), where
    # backlog_per_consumer counts this worker as a consumer (as if it joined).
    # log1p so that a huge backlog cannot outvote warmth without limit.
    pressure_weight: float = Field(default=1.0, ge=0)
    pressure_scale: float = Field(default=4.0, gt=0)

    # Stickiness: weight at the moment this worker last served the model,
    # decaying linearly to zero over the window.
    stickiness_weight: float = Field(default=1.0, ge=0)
    stickiness_window_s: float = Field(default=120.0, gt=0)

    # Noise: uniform in [-amplitude, +amplitude] per (worker, queue), held fixed
    # for noise_hold_s so identical workers do not herd and scores do not jitter.
    noise_amplitude: float = Field(default=0.25, ge=0)
    noise_hold_s: float = Field(default=5.0, gt=0)

    # Hysteresis: take a queue at >= subscribe_threshold, drop it only below
    # drop_threshold (clearly lower), so a score near the bar does not flap.
    subscribe_threshold: float = Field(default=1.5)
    drop_threshold: float = Field(default=0.5)

    # Starvation: a queue with messages and no consumer anywhere.
    starvation_score: float = Field(default=1000.0, gt=0)

    # Cold subscriptions (model not resident here) per worker per minute, taken
    # under pressure by a busy worker. Starved queues and idle joins are exempt.
    cold_subscribes_per_minute: int = Field(default=6, ge=0)
    # Idle join: a worker with a free permit joins a queue under its fan-out cap,
    # whatever its score, once this many tasks wait per consumer (counting it).
    idle_join_backlog: float = Field(default=2.0, gt=0)
    # A worker takes no new cold queue while this many models are loading on it
    # (the new model would only wait behind them); a cold queue taken under
    # pressure also needs a free permit, a starved one only the loader. Used when
    # the worker does not report a loader per runtime (WorkerView.loader_room);
    # the coordinator does, from each runtime's max_concurrent_loads. Keep it
    # equal to the runtime's concurrent loads: at 1 with 2 loaders the
    # simulator's fleet warmed up at half speed.
    max_loads_for_cold: int = Field(default=2, ge=1)

    # A cap on queues held at once. Keep it above the number of models a worker
    # holds (device + host): a resident model whose queue nobody consumes gets
    # starved, then loaded cold elsewhere (in the simulator a cap of 16 doubled
    # the fleet's model loads). Warm idle subscriptions are cheap to keep.
    max_subscriptions: int = Field(default=256, ge=1)

    # Fan-out cap: round(fanout_max_workers * multiplier), at least 1.
    plan_fanout_multiplier: dict[str, float] = Field(
        default_factory=lambda: {"free": 1.0, "pro": 2.0, "enterprise": 4.0}
    )
    # Multiplier for a plan missing from the table.
    default_fanout_multiplier: float = Field(default=1.0, gt=0)
    # Priority by plan: when a worker's load slots or free permits cannot take every cold
    # queue that waits, higher-priority plans' queues are taken first (score breaks ties).
    plan_priority: dict[str, int] = Field(
        default_factory=lambda: {"free": 0, "pro": 1, "enterprise": 2}
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> ScoringSettings:
        if not self.drop_threshold < self.subscribe_threshold:
            raise ValueError(
                "drop_threshold must be below subscribe_threshold (hysteresis); "
                f"got drop {self.drop_threshold} >= subscribe {self.subscribe_threshold}"
            )
        if any(m <= 0 for m in self.plan_fanout_multiplier.values()):
            raise ValueError("plan_fanout_multiplier values must be > 0")
        return self

    def fanout_cap(self, fanout_max_workers: int, plan: str) -> int:
        """How many workers may consume a queue of this plan at once (at least 1)."""
        multiplier = self.plan_fanout_multiplier.get(plan, self.default_fanout_multiplier)
        return max(1, round(fanout_max_workers * multiplier))

    def priority(self, plan: str) -> int:
        """The priority of a queue of this plan (0 for a plan missing from the table)."""
        return self.plan_priority.get(plan, 0)
