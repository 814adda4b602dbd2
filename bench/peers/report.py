"""The peers bench's markdown table, from the results dictionary ``run.py`` builds."""

from __future__ import annotations

import math
from typing import Any

from stats import ratio

MODELFLEETS = ("modelfleet", "modelfleet-amqp", "modelfleet-fits", "modelfleet-mapped")
# Rows that do not use the shared load code, shown apart (issue 20) with this note.
APART = {"modelfleet-mapped": (
    "not the shared load code: its handlers map their four `.npy` arrays with "
    "`ctx.map_array` (no copy; pages read on first touch), so its MB loaded/req are bytes "
    "mapped, not read; compare it with `modelfleet`, the same settings with the shared code")}


def label(name: str) -> str:
    return f"{name} †" if name in APART else name


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def fx(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def mb(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value / 1e6:,.{digits}f}"


def rss_cell(r: dict[str, Any], kind: str = "rss") -> str:
    parts = [r.get(f"{kind}_start_mb"), r.get(f"{kind}_max_mb"), r.get(f"{kind}_end_mb")]
    if all(v is None for v in parts):
        return fmt(r.get("rss_mb")) if kind == "rss" else "-"
    return " / ".join(fmt(v) for v in parts)


def render(results: dict[str, Any]) -> str:
    rows = {s["system"]: s.get("summary", {}) for s in results.get("systems", [])}
    d = results.get("durations", {})
    m = results.get("machine", {})
    c = results.get("catalog", {})
    n_models = c.get("models")
    warm = any(r.get("c1_p50_ms") is not None or r.get("c32_rps") is not None
               for r in rows.values())
    sizes = ""
    if c.get("min_bytes") and c.get("max_bytes"):
        sizes = f" of {c['min_bytes'] / 1e3:,.0f} KB-{c['max_bytes'] / 1e6:,.1f} MB"
    lines = [
        f"## modelfleet and its peers — {fmt(n_models)} MLPs{sizes}, "
        f"{(c.get('total_bytes') or 0) / 2**20:,.0f} MiB in all; "
        f"{m.get('nproc')} cores, {m.get('ram_gib')} GiB; load generator on the same machine"
        + (" (QUICK: smoke run, figures mean nothing)" if results.get("quick") else "")
        + (" (INTERRUPTED: partial)" if results.get("interrupted") else ""),
        "",
        f"zipf-32: 32 keep-alive clients, Zipf s=1.0 over the {fmt(n_models)} models, "
        f"{fmt(d.get('zipf_warmup_s'), 0)} s warm-up + {fmt(d.get('zipf_measure_s'), 0)} s "
        "measured"
        + (f"; warm-c1 / warm-c32: the rank-0 model, {fmt(d.get('c1_s'), 0)} s / "
           f"{fmt(d.get('c32_s'), 0)} s" if warm else "")
        + ". errors = non-200 / client timeouts; loads = model loads in the zipf-32 window; "
        "MB loaded/req = bytes the loads in the window read, per request; CPU ms/req = the "
        "server's process tree's CPU seconds over the window per answer (a RabbitMQ broker's "
        "own not counted); RSS = the process tree's, sampled every 0.5 s: at ready / max / "
        "at the end; PSS = the same for the tree's proportional set size (a page shared by "
        "n processes counted 1/n in each: what the tree holds).",
        "",
    ]
    header = ["system", "zipf-32 req/s", "p50 ms", "p99 ms", "errors", "loads",
              "MB loaded/req", "CPU ms/req", "RSS MB start / max / end",
              "PSS MB start / max / end"]
    if warm:
        header += ["warm c1 p50 ms", "warm c32 req/s"]
    header += ["start-up s"]
    body = []
    for name, r in rows.items():
        if name == "amqp-rtt":
            continue
        if r.get("error") and r.get("zipf_rps") is None:
            why = "not available" if r.get("not_available") else "failed"
            body.append([label(name), *([why] + ["-"] * (len(header) - 2))])
            continue
        errors = "-" if r.get("zipf_errors") is None else \
            f"{r.get('zipf_errors')} / {r.get('zipf_timeouts')}"
        cells = [label(name), fmt(r.get("zipf_rps")), fmt(r.get("zipf_p50_ms")),
                 fmt(r.get("zipf_p99_ms")), errors, fmt(r.get("zipf_loads")),
                 mb(r.get("zipf_bytes_per_request"), 3), fmt(r.get("zipf_cpu_ms_per_request")),
                 rss_cell(r), rss_cell(r, "pss")]
        if warm:
            cells += [fmt(r.get("c1_p50_ms"), 2), fmt(r.get("c32_rps"))]
        cells += [fmt(r.get("startup_s"))]
        body.append(cells)
    lines += _table(header, body)
    for name, note in APART.items():
        if name in rows:
            lines += ["", f"† {name}: {note}."]

    plain = rows.get("plain")
    if plain and plain.get("zipf_rps") is not None:
        lines += ["", "Ratios to `plain` (req/s: higher is better; latency and RSS: lower is "
                  "better):", ""]
        body = []
        for name, r in rows.items():
            if name in ("plain", "amqp-rtt"):
                continue
            cells = [label(name), fx(ratio(r.get("zipf_rps"), plain.get("zipf_rps"))),
                     fx(ratio(r.get("zipf_p99_ms"), plain.get("zipf_p99_ms")))]
            if warm:
                cells += [fx(ratio(r.get("c1_p50_ms"), plain.get("c1_p50_ms"))),
                          fx(ratio(r.get("c32_rps"), plain.get("c32_rps")))]
            cells += [fx(ratio(r.get("rss_mb"), plain.get("rss_mb")))]
            body.append(cells)
        lines += _table(["system", "zipf req/s", "zipf p99",
                         *(["warm c1 p50", "warm c32 req/s"] if warm else []), "RSS"], body)

    peers = [p for p in ("mlserver", "ray") if rows.get(p, {}).get("zipf_rps") is not None]
    ours = [n for n in MODELFLEETS if rows.get(n, {}).get("zipf_rps") is not None]
    if peers and ours:
        lines += ["", "modelfleet against the peers on zipf-32, measured side by side in this "
                  "run (req/s ratio >1, p99, CPU per request and RSS ratios <1 favour "
                  "modelfleet; RSS and PSS = the max):", ""]
        header = ["system"]
        for p in peers:
            header += [f"req/s ÷ {p}", f"p99 ÷ {p}", f"CPU/req ÷ {p}", f"RSS ÷ {p}",
                       f"PSS ÷ {p}"]
        body = []
        for n in ours:
            r = rows[n]
            cells = [label(n)]
            for p in peers:
                q = rows[p]
                cells += [fx(ratio(r.get("zipf_rps"), q.get("zipf_rps"))),
                          fx(ratio(r.get("zipf_p99_ms"), q.get("zipf_p99_ms"))),
                          fx(ratio(r.get("zipf_cpu_ms_per_request"),
                                   q.get("zipf_cpu_ms_per_request"))),
                          fx(ratio(r.get("rss_max_mb") or r.get("rss_mb"),
                                   q.get("rss_max_mb") or q.get("rss_mb"))),
                          fx(ratio(r.get("pss_max_mb"), q.get("pss_max_mb")))]
            body.append(cells)
        lines += _table(header, body)

    budget = c.get("pooled_budget_bytes")
    optimum_lines = []
    for n, r in rows.items():
        if r.get("zipf_optimum_bytes_per_request") is None or n not in MODELFLEETS:
            continue
        measured = r.get("zipf_bytes_per_request")
        optimum_lines.append(
            f"- {n}: {mb(measured, 3)} MB loaded per request; static optimum "
            f"{mb(r['zipf_optimum_bytes_per_request'], 3)} MB (LP bound "
            f"{mb(r.get('zipf_optimum_bound_bytes_per_request'), 3)}; with no reserve "
            f"{mb(r.get('zipf_optimum_no_reserve_bytes_per_request'), 3)}): measured ÷ "
            f"optimum = {fx(ratio(measured, r['zipf_optimum_bytes_per_request']))}"
            + (f"; modelfleet_model_load_bytes_total says "
               f"{mb(r['zipf_bytes_per_request_metric'], 3)} MB"
               if r.get("zipf_bytes_per_request_metric") is not None else ""))
    if optimum_lines:
        lines += ["", "Bytes loaded per request against the static optimum for the same trace "
                  f"(the best fixed resident set in the pooled budget, {mb(budget, 0)} MB = "
                  "both runtimes' budgets, less one reservation of the largest model; each model "
                  "requested in the window but not in the warm-up loaded at least once; "
                  "bench/peers/optimum.py):", "",
                  *optimum_lines]

    rtt, amqp = rows.get("amqp-rtt", {}), rows.get("modelfleet-amqp", {})
    if rtt.get("c1_p50_ms") is not None:
        lines += ["", f"Bare aio-pika round trip (confirmed publish to a quorum queue, "
                  f"consumer replies, c1): p50 {fmt(rtt['c1_p50_ms'], 2)} ms, "
                  f"p99 {fmt(rtt.get('c1_p99_ms'), 2)} ms."]
        if amqp.get("c1_p50_ms") is not None:
            lines[-1] += (f" modelfleet-amqp warm c1 p50 {fmt(amqp['c1_p50_ms'], 2)} ms = "
                          f"{fx(ratio(amqp['c1_p50_ms'], rtt['c1_p50_ms']))} that.")

    notes = []
    for n in MODELFLEETS:
        r = rows.get(n)
        if not r or r.get("zipf_rps") is None:
            continue
        parts = [f"503s in zipf-32: {fmt(r.get('zipf_503'))}"]
        idle = r.get("zipf_idle_permit_s_while_backlog")
        parts.append("idle permit-seconds while backlog: "
                     + ("metric absent" if idle is None else fmt(idle, 2)))
        broker_cpu = r.get("zipf_broker_cpu_ms_per_request")
        if broker_cpu is not None:
            parts.append(f"RabbitMQ's own CPU per request (not in the table): "
                         f"{fmt(broker_cpu, 1)} ms")
        notes.append(f"- {n}: " + "; ".join(parts))
        for part, phases in sorted((r.get("zipf_phases") or {}).items()):
            spent = ", ".join(f"{k} {fmt(v, 1)}" for k, v in phases["phase_ms"].items())
            notes.append(f"  - {'slowest 1 %' if part == 'tail' else 'all answers'} "
                         f"({phases['n']:,}): {fmt(phases['latency_ms'], 1)} ms at the "
                         f"client, {100 * phases['cold_share']:.0f} % cold; server phases, "
                         f"mean ms: {spent}")
    for name, r in rows.items():
        if r.get("error"):
            notes.append(f"- {name}: {str(r['error']).splitlines()[0][:200]}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
