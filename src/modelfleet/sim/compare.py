"""Run several routers on one scenario: same catalog, same trace."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from modelfleet.scheduling import ScoringSettings
from modelfleet.sim.engine import Router, SimResult, Simulation
from modelfleet.sim.pull import PullAffinity
from modelfleet.sim.routers import PUSH_ROUTERS
from modelfleet.sim.scenario import ScenarioConfig, build_catalog, build_trace

ROUTER_NAMES: tuple[str, ...] = (PullAffinity.name, *PUSH_ROUTERS)
"""The routers compared by default."""
ABLATIONS: tuple[str, ...] = ("pull-affinity-lru",)
"""Also accepted by ``make_router``: pull-affinity on the push routers' device-only LRU."""

Progress = Callable[[str, int], Callable[[int], None] | None]
"""Given a router name and the number of requests, a callback fed request counts."""


def make_router(name: str, config: ScenarioConfig, scoring: ScoringSettings) -> Router:
    if name == PullAffinity.name:
        return PullAffinity(scoring, rng_seed=config.seed)
    if name == "pull-affinity-lru":
        return PullAffinity(scoring, rng_seed=config.seed, device_only_lru=True)
    try:
        return PUSH_ROUTERS[name]()
    except KeyError:
        known = ", ".join(ROUTER_NAMES + ABLATIONS)
        raise ValueError(f"unknown router {name!r}; choose from {known}") from None


def compare(config: ScenarioConfig, routers: Sequence[str] = ROUTER_NAMES,
            scoring: ScoringSettings | None = None,
            progress: Progress | None = None) -> list[SimResult]:
    """Run each router on the same catalog and trace; results in the order given."""
    scoring = scoring if scoring is not None else ScoringSettings()
    catalog = build_catalog(config)
    trace = build_trace(config)
    results = []
    for name in routers:
        router = make_router(name, config, scoring)
        callback = progress(name, len(trace)) if progress is not None and len(trace) else None
        results.append(Simulation(config, catalog, trace, router, callback).run())
    return results
