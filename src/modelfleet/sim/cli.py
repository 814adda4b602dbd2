"""``modelfleet sim``: compare routers on one simulated fleet and trace.

    python -m modelfleet.sim --models 2000 --workers 40 --zipf 1.0 --seed 1
    python -m modelfleet.sim --json --no-plot
    python -m modelfleet.sim --scoring noise_amplitude=0 --routers pull-affinity,round-robin
    python -m modelfleet.sim --scenario peers     # bench/peers: 1 worker, 32 clients
    python -m modelfleet.sim --scenario peers-5000  # the same over 5,000 small models

Every field of ``ScenarioConfig`` is an option (``--duration-s`` has the
shorter alias ``--duration``). The table goes to stdout (or the JSON form with
``--json``), the progress bar to stderr, the plot to ``--plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable

from pydantic import ValidationError

from modelfleet.scheduling import ScoringSettings
from modelfleet.sim.compare import ABLATIONS, ROUTER_NAMES, compare, default_jobs
from modelfleet.sim.report import format_table, plot, summarise, to_json
from modelfleet.sim.scenario import SCENARIOS, ScenarioConfig, scenario

HELP = {
    "models": "catalog size",
    "zipf": "Zipf exponent of model popularity",
    "workers": "fleet size",
    "duration_s": "simulated seconds of arrivals",
    "warmup_s": "seconds at the start not counted (caches start empty)",
    "seed": "one seed for catalog, trace and scoring noise",
    "rate": "requests per second (default: rate-per-worker x workers)",
    "shift": "permute popularity ranks at the middle of the run",
    "device_gib": "device memory budget per worker",
    "host_gib": "host memory budget per worker (pull-affinity only; push runs device-only LRU)",
    "permits": "concurrent tasks per worker",
    "loaders": "concurrent model loads per worker",
    "pinned": "most popular models preloaded and pinned on every worker",
    "rescore_s": "pull-affinity re-scoring period per worker",
    "clients": "closed-loop clients instead of the Poisson trace (0: open loop)",
    "cores": "CPUs per worker machine shared by all its work (0: not modelled)",
    "runtimes_per_worker": "runtime processes per worker; a model runs on crc32(id) % this",
    "artifact_min_bytes": "peers catalog: smallest artifact (sizes log-uniform up to the max)",
    "artifact_max_bytes": "peers catalog: largest artifact",
    "rescore_cpu_per_model_s": "coordinator CPU per catalog model per re-score (an O(catalog) "
                               "loop, as before issue 23; 0: none)",
    "wake_at_cap": "ablation: an announcement of a queue last counted at its fan-out cap "
                   "wakes a worker and is counted afresh (the coordinator skips it)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelfleet sim", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="fleet",
                        help="a preset the other options apply on top of (default: fleet)")
    for field in dataclasses.fields(ScenarioConfig):
        flag = "--" + field.name.replace("_", "-")
        flags = [flag, "--duration"] if field.name == "duration_s" else [flag]
        default = field.default
        # argparse %-formats help strings: a literal % must be doubled.
        text = f"{HELP.get(field.name, '')} (default: {default})".strip().replace("%", "%%")
        if isinstance(default, bool):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
            continue
        kind: Callable[[str], object] = float if default is None else type(default)
        parser.add_argument(*flags, dest=field.name, type=kind, default=None, help=text)
    parser.add_argument("--routers", default=None,
                        help=f"comma-separated, from: {', '.join(ROUTER_NAMES + ABLATIONS)} "
                             "(default: all four; pull-affinity alone with one worker)")
    parser.add_argument("--scoring", action="append", default=[], metavar="KEY=VALUE",
                        help="override a ScoringSettings field (JSON value), repeatable")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes to run the routers in, each router whole in one "
                             "(same results; default: one per router, at most one per CPU)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="PNG path (default: sim-<seed>.png in the current directory)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def scoring_settings(pairs: list[str]) -> ScoringSettings:
    values: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ValueError(f"--scoring wants KEY=VALUE, got {pair!r}")
        try:
            values[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.strip()] = raw
    return ScoringSettings.model_validate(values)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ScenarioConfig)
             if getattr(args, f.name) is not None}
    try:
        config = scenario(args.scenario, **given)
        config.check()
    except ValueError as exc:
        parser.error(str(exc))
    default_routers = "pull-affinity" if config.workers == 1 else ",".join(ROUTER_NAMES)
    routers = [r.strip() for r in (args.routers or default_routers).split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTER_NAMES + ABLATIONS]
    if unknown:
        parser.error(f"unknown router(s) {', '.join(unknown)}; "
                     f"choose from {', '.join(ROUTER_NAMES + ABLATIONS)}")
    try:
        scoring = scoring_settings(args.scoring)
    except (ValueError, ValidationError) as exc:
        parser.error(f"--scoring: {exc}")

    bars = [] if args.no_progress or config.clients > 0 else _progress_bars()
    started = time.perf_counter()
    jobs = args.jobs if args.jobs is not None else default_jobs(routers)
    results = compare(config, routers, scoring, bars[0] if bars else None, jobs)
    elapsed = time.perf_counter() - started
    summaries = [summarise(r) for r in results]

    if args.json:
        print(to_json(summaries))
    else:
        load = (f"{config.clients} closed-loop clients" if config.clients > 0
                else f"{config.total_rate:g} req/s")
        print(f"# {config.models} models, {config.workers} workers x "
              f"{config.runtimes_per_worker} runtimes, zipf {config.zipf}, {load}, "
              f"{config.duration_s:g} s (first {config.warmup_s:g} s not counted), seed "
              f"{config.seed}: {len(results[0].latency_s) if results else 0} requests "
              f"counted; {elapsed:.1f} s wall")
        print(format_table(summaries, closed_loop=config.clients > 0))
    if not args.no_plot and results:
        path = args.plot or f"sim-{config.seed}.png"
        title = (f"{config.models} models, {config.workers} workers, zipf {config.zipf}, "
                 f"seed {config.seed}")
        plot(results, path, title, config.duration_s / 2 if config.shift else None)
        print(f"plot: {path}", file=sys.stderr)
    return 0


def _progress_bars() -> list[Callable[[str, int], Callable[[int], None]]]:
    from tqdm import tqdm

    def start(router: str, total: int) -> Callable[[int], None]:
        bar = tqdm(total=total, desc=f"{router:>17}", unit="req", file=sys.stderr,
                   leave=True, mininterval=0.5)

        def advance(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return advance

    return [start]
