"""The peers bench's markdown table, from the results dictionary ``run.py`` builds."""

from __future__ import annotations

import math
from typing import Any

from stats import ratio

MODELFLEETS = ("modelfleet", "modelfleet-amqp", "modelfleet-fits")


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


def render(results: dict[str, Any]) -> str:
    rows = {s["system"]: s.get("summary", {}) for s in results.get("systems", [])}
    d = results.get("durations", {})
    m = results.get("machine", {})
    c = results.get("catalog", {})
    lines = [
        f"## modelfleet and its peers — {c.get('models')} MLPs, "
        f"{(c.get('total_bytes') or 0) / 2**20:.0f} MiB in all; "
        f"{m.get('nproc')} cores, {m.get('ram_gib')} GiB; load generator on the same machine"
        + (" (QUICK: smoke run, figures mean nothing)" if results.get("quick") else "")
        + (" (INTERRUPTED: partial)" if results.get("interrupted") else ""),
        "",
        f"zipf-32: 32 keep-alive clients, Zipf s=1.0 over the 50 models, "
        f"{fmt(d.get('zipf_warmup_s'), 0)} s warm-up + {fmt(d.get('zipf_measure_s'), 0)} s "
        f"measured; warm-c1 / warm-c32: model-00, {fmt(d.get('c1_s'), 0)} s / "
        f"{fmt(d.get('c32_s'), 0)} s. errors = non-200 / client timeouts; loads = model loads "
        f"in the zipf-32 window; RSS = peak of the server's process tree.",
        "",
    ]
    body = []
    for name, r in rows.items():
        if name == "amqp-rtt":
            continue
        if r.get("error") and r.get("zipf_rps") is None:
            body.append([name, *(["failed"] + ["-"] * 7)])
            continue
        errors = "-" if r.get("zipf_errors") is None else \
            f"{r.get('zipf_errors')} / {r.get('zipf_timeouts')}"
        body.append([name, fmt(r.get("zipf_rps")), fmt(r.get("zipf_p50_ms")),
                     fmt(r.get("zipf_p99_ms")), errors, fmt(r.get("zipf_loads")),
                     fmt(r.get("c1_p50_ms"), 2), fmt(r.get("c32_rps")), fmt(r.get("rss_mb"))])
    lines += _table(["system", "zipf-32 req/s", "p50 ms", "p99 ms", "errors", "loads",
                     "warm c1 p50 ms", "warm c32 req/s", "RSS MB"], body)

    plain = rows.get("plain")
    if plain and plain.get("zipf_rps") is not None:
        lines += ["", "Ratios to `plain` (req/s: higher is better; latency and RSS: lower is "
                  "better):", ""]
        body = []
        for name, r in rows.items():
            if name in ("plain", "amqp-rtt"):
                continue
            body.append([name, fx(ratio(r.get("zipf_rps"), plain.get("zipf_rps"))),
                         fx(ratio(r.get("zipf_p99_ms"), plain.get("zipf_p99_ms"))),
                         fx(ratio(r.get("c1_p50_ms"), plain.get("c1_p50_ms"))),
                         fx(ratio(r.get("c32_rps"), plain.get("c32_rps"))),
                         fx(ratio(r.get("rss_mb"), plain.get("rss_mb")))])
        lines += _table(["system", "zipf req/s", "zipf p99", "warm c1 p50", "warm c32 req/s",
                         "RSS"], body)

    peers = [p for p in ("mlserver", "ray") if rows.get(p, {}).get("zipf_rps") is not None]
    ours = [n for n in MODELFLEETS if rows.get(n, {}).get("zipf_rps") is not None]
    if peers and ours:
        lines += ["", "modelfleet against the peers on zipf-32 (req/s ratio >1 and p99 ratio "
                  "<1 favour modelfleet):", ""]
        header = ["system"]
        for p in peers:
            header += [f"req/s ÷ {p}", f"p99 ÷ {p}"]
        body = []
        for n in ours:
            r = rows[n]
            cells = [n]
            for p in peers:
                cells += [fx(ratio(r.get("zipf_rps"), rows[p].get("zipf_rps"))),
                          fx(ratio(r.get("zipf_p99_ms"), rows[p].get("zipf_p99_ms")))]
            body.append(cells)
        lines += _table(header, body)

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
        notes.append(f"- {n}: " + "; ".join(parts))
    for name, r in rows.items():
        if r.get("error"):
            notes.append(f"- {name}: {str(r['error']).splitlines()[0][:200]}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
