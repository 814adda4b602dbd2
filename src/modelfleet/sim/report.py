"""Summaries of simulation runs: the comparison table, its JSON form, and the plot.

Definitions (over every request that arrived after the warm-up, timeouts
included; loads and busy time between the warm-up and the end of arrivals):

- hit_rate: share of requests that found their model on the device of the
  worker that ran them (no load, no promotion);
- loads_per_min: full model loads (not host promotions) finished during the
  run, per simulated minute, fleet-wide;
- p50_s / p99_s / p999_s: latency from arrival to reply; a request that timed
  out counts as the deadline (what its caller waited);
- over_10s_share: share of requests that took more than 10 s (or timed out);
- busy_fraction: share of worker time with anything running (an inference, a
  load or a promotion), averaged over workers;
- req_per_s: answers (not timeouts) completed between the warm-up and the end of
  arrivals, per second (closed-loop clients: the bench's throughput);
- loads: full loads finished in that window (the bench's "loads" column).

With closed-loop clients the latencies are those of the requests *sent* in the
window (as bench/peers' load generator counts them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from modelfleet.scheduling import ScoringSettings
from modelfleet.sim.engine import SimResult
from modelfleet.sim.scenario import ScenarioConfig

JSON_KEYS = ("router", "hit_rate", "loads_per_min", "p50_s", "p99_s", "p999_s",
             "over_10s_share", "busy_fraction", "req_per_s")


@dataclass(frozen=True, slots=True)
class RouterSummary:
    router: str
    hit_rate: float
    loads_per_min: float
    p50_s: float
    p99_s: float
    p999_s: float
    over_10s_share: float
    busy_fraction: float
    req_per_s: float
    promotions_per_min: float  # table only: host -> device copies
    timeout_share: float  # table only
    loads: int = 0  # table only: full loads in the window
    cpu_utilisation: float = 0.0  # table only: of the machines' CPUs (0: not modelled)
    idle_permit_s: float = 0.0  # pull only: permit-seconds idle while work waited
    rescores: int = 0  # pull only: decisions taken in the window

    def as_json(self) -> dict[str, object]:
        """Exactly the keys of ``JSON_KEYS``."""
        values = asdict(self)
        return {key: values[key] for key in JSON_KEYS}


def summarise(result: SimResult) -> RouterSummary:
    latency = np.asarray(result.latency_s, dtype=np.float64)
    requests = max(len(latency), 1)
    minutes = max(result.duration_s - result.warmup_s, 1e-9) / 60.0
    loads = sum(1 for t in result.load_times if result.warmup_s <= t <= result.duration_s)
    if len(latency):
        p50, p99, p999 = (float(x) for x in np.percentile(latency, [50, 99, 99.9]))
    else:
        p50 = p99 = p999 = 0.0
    return RouterSummary(
        router=result.router,
        hit_rate=round(result.hits / requests, 4),
        loads_per_min=round(loads / minutes, 2),
        p50_s=round(p50, 4),
        p99_s=round(p99, 3),
        p999_s=round(p999, 3),
        over_10s_share=round(float(np.mean(latency > 10.0)) if len(latency) else 0.0, 5),
        busy_fraction=round(result.busy_fraction, 4),
        req_per_s=round(result.answered_in_window / (minutes * 60.0), 2),
        promotions_per_min=round(result.promotions / minutes, 2),
        timeout_share=round(result.timeouts / requests, 5),
        loads=loads,
        cpu_utilisation=round(result.cpu_utilisation, 4),
        idle_permit_s=round(result.idle_permit_s, 2),
        rescores=result.rescores,
    )


def to_json(summaries: Sequence[RouterSummary]) -> str:
    return json.dumps([s.as_json() for s in summaries], indent=2)


def format_table(summaries: Sequence[RouterSummary], closed_loop: bool = False) -> str:
    """A Markdown table, ready to paste. ``closed_loop``: the bench's columns (req/s,
    p50/p99 in ms, loads in the window) instead of the fleet's."""
    if closed_loop:
        header = ("| router | req/s | p50 ms | p99 ms | loads | hit rate | CPU "
                  "| idle permit-s while work waited | decisions | timeouts |")
        rows = [header, "|" + "---|" * 10]
        for s in summaries:
            rows.append(
                f"| {s.router} | {s.req_per_s:.1f} | {s.p50_s * 1000:.1f} "
                f"| {s.p99_s * 1000:.1f} | {s.loads} | {s.hit_rate:.1%} "
                f"| {s.cpu_utilisation:.1%} | {s.idle_permit_s:.1f} | {s.rescores} "
                f"| {s.timeout_share:.2%} |")
        return "\n".join(rows)
    header = ("| router | hit rate | loads/min | p50 s | p99 s | p99.9 s | over 10 s "
              "| busy | promotions/min | timeouts |")
    rule = "|" + "---|" * 10
    rows = [header, rule]
    for s in summaries:
        rows.append(
            f"| {s.router} | {s.hit_rate:.1%} | {s.loads_per_min:.1f} | {s.p50_s:.3f} "
            f"| {s.p99_s:.2f} | {s.p999_s:.2f} | {s.over_10s_share:.2%} "
            f"| {s.busy_fraction:.1%} | {s.promotions_per_min:.1f} | {s.timeout_share:.2%} |"
        )
    return "\n".join(rows)


def peers_row(config: ScenarioConfig, scoring: ScoringSettings | None = None,
              router: str = "pull-affinity") -> dict[str, Any]:
    """One run of a closed-loop scenario in bench/peers' units: req/s, p50/p99 in ms,
    loads in the window (and what explains them)."""
    from modelfleet.sim.compare import compare

    result = compare(config, [router], scoring)[0]
    s = summarise(result)
    cpu_ms = (result.cpu_utilisation * config.cores * config.workers * 1000.0
              / s.req_per_s if s.req_per_s else 0.0)
    answered = s.req_per_s * (config.duration_s - config.warmup_s)
    by_thread = {k: round(v * 1000 / answered, 3) if answered else 0.0
                 for k, v in sorted(result.cpu_by_thread.items())}
    return {"req_per_s": s.req_per_s, "p50_ms": round(s.p50_s * 1000, 2),
            "cpu_ms_per_request": round(cpu_ms, 3), "cpu_ms_per_request_by": by_thread,
            "p99_ms": round(s.p99_s * 1000, 2), "loads": s.loads,
            "hit_rate": s.hit_rate, "cpu_utilisation": s.cpu_utilisation,
            "idle_permit_s_while_backlog": s.idle_permit_s, "decisions": s.rescores,
            "timeouts": round(s.timeout_share * len(result.latency_s))}


def plot(results: Sequence[SimResult], path: str, title: str,
         shift_at_s: float | None = None) -> None:
    """Resident models and model-load rate over time, one line per router (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for result in results:
        top.plot(result.sample_times, result.resident_models, label=result.router)
        if len(result.sample_times) > 1:
            step = result.sample_times[1] - result.sample_times[0]
            edges = np.arange(0.0, result.duration_s + step, step)
            counts, _ = np.histogram(result.load_times, bins=edges)
            bottom.plot(edges[:-1], counts * 60.0 / step, label=result.router)
    bottom.set_ylim(bottom=0)
    top.set_ylabel("device-resident models (fleet)")
    bottom.set_ylabel("model loads per minute")
    bottom.set_xlabel("simulated seconds")
    for axis in (top, bottom):
        if shift_at_s is not None:  # where the popularity ranks were permuted
            axis.axvline(shift_at_s, color="grey", linestyle=":", linewidth=1)
        axis.grid(alpha=0.3)
    top.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
