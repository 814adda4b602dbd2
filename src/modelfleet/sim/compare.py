"""Run several routers on one scenario: same catalog, same trace."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from functools import partial

from modelfleet.scheduling import ScoringSettings
from modelfleet.sim.engine import Router, SimResult, Simulation
from modelfleet.sim.pull import PullAffinity
from modelfleet.sim.routers import PUSH_ROUTERS
from modelfleet.sim.scenario import Catalog, ScenarioConfig, Trace, build_catalog, build_trace

ROUTER_NAMES: tuple[str, ...] = (PullAffinity.name, *PUSH_ROUTERS)
"""The routers compared by default."""
ABLATIONS: tuple[str, ...] = ("pull-affinity-lru",)
"""Also accepted by ``make_router``: pull-affinity on the push routers' device-only LRU."""

Progress = Callable[[str, int], Callable[[int], None] | None]
"""Given a router name and the number of requests, a callback fed request counts."""


def make_router(name: str, config: ScenarioConfig, scoring: ScoringSettings) -> Router:
    if name == PullAffinity.name:
        return PullAffinity(scoring, rng_seed=config.seed,
                            eviction_policy=config.eviction_policy)
    if name == "pull-affinity-lru":
        return PullAffinity(scoring, rng_seed=config.seed, device_only_lru=True)
    try:
        return PUSH_ROUTERS[name]()
    except KeyError:
        known = ", ".join(ROUTER_NAMES + ABLATIONS)
        raise ValueError(f"unknown router {name!r}; choose from {known}") from None


def default_jobs(routers: Sequence[str]) -> int:
    """One process per router, at most as many as this process may run on at once."""
    return max(1, min(len(routers), len(os.sched_getaffinity(0))))


def compare(config: ScenarioConfig, routers: Sequence[str] = ROUTER_NAMES,
            scoring: ScoringSettings | None = None,
            progress: Progress | None = None, jobs: int = 1) -> list[SimResult]:
    """Run each router on the same catalog and trace; results in the order given.

    With ``jobs`` > 1 the routers run in that many processes at once, each router's run
    whole in one of them, started in the order given: every run is a pure function of
    the config, the catalog, the trace and the router, so the results are the same."""
    scoring = scoring if scoring is not None else ScoringSettings()
    catalog = build_catalog(config)
    trace = build_trace(config)
    if jobs > 1 and len(routers) > 1:
        return _in_processes(config, catalog, trace, routers, scoring, progress, jobs)
    results = []
    for name in routers:
        router = make_router(name, config, scoring)
        callback = progress(name, len(trace)) if progress is not None and len(trace) else None
        results.append(Simulation(config, catalog, trace, router, callback).run())
    return results


# A child's channel for progress (set by _child_init): (router's position, requests).
_progress_channel: multiprocessing.queues.Queue[tuple[int, int]] | None = None


def _child_init(channel: multiprocessing.queues.Queue[tuple[int, int]] | None) -> None:
    global _progress_channel
    _progress_channel = channel


def _run_one(config: ScenarioConfig, catalog: Catalog, trace: Trace, name: str,
             scoring: ScoringSettings, position: int) -> SimResult:
    channel = _progress_channel
    callback = None if channel is None else partial(_report, channel, position)
    return Simulation(config, catalog, trace, make_router(name, config, scoring),
                      callback).run()


def _report(channel: multiprocessing.queues.Queue[tuple[int, int]], position: int,
            requests: int) -> None:
    channel.put((position, requests))


def _in_processes(config: ScenarioConfig, catalog: Catalog, trace: Trace,
                  routers: Sequence[str], scoring: ScoringSettings,
                  progress: Progress | None, jobs: int) -> list[SimResult]:
    """``compare``'s runs in ``jobs`` processes; progress comes back over a queue."""
    context = multiprocessing.get_context()
    channel: multiprocessing.queues.Queue[tuple[int, int]] | None = None
    callbacks: list[Callable[[int], None] | None] = []
    if progress is not None and len(trace):
        channel = context.Queue()
        callbacks = [progress(name, len(trace)) for name in routers]
    with ProcessPoolExecutor(min(jobs, len(routers)), context, _child_init,
                             (channel,)) as pool:
        futures = [pool.submit(_run_one, config, catalog, trace, name, scoring, position)
                   for position, name in enumerate(routers)]
        pending: set[Future[SimResult]] = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            _drain(channel, callbacks)
        results = [future.result() for future in futures]
    _drain(channel, callbacks)  # the children have exited: what they sent is all here
    return results


def _drain(channel: multiprocessing.queues.Queue[tuple[int, int]] | None,
           callbacks: list[Callable[[int], None] | None]) -> None:
    while channel is not None:
        try:
            position, requests = channel.get_nowait()
        except queue.Empty:
            return
        callback = callbacks[position]
        if callback is not None:
            callback(requests)
