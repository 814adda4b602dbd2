// The fleet page: polls /v1/fleet/summary and draws it. No framework, no build step.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 900, H = 260, PAD = { left: 48, right: 72, top: 14, bottom: 26 };
let last = null;
let timer = null;

function text(id, value) {
  const el = document.getElementById(id);
  if (el) el.textContent = value === null || value === undefined ? "–" : String(value);
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "–" : String(value);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function renderTotals(t) {
  for (const [key, value] of Object.entries(t)) {
    text("total-" + key.replaceAll("_", "-"), value);
  }
}

function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of workers) {
    const row = document.createElement("tr");
    row.dataset.worker = w.worker_id;
    const resident = w.resident || {}, loads = w.loads || {}, ev = w.evictions || {};
    const rb = w.resident_bytes || {}, counts = w.counts || {};
    cell(row, w.worker_id);
    cell(row, w.ready ? "yes" : "no", w.ready ? "" : "no");
    cell(row, (w.permits_in_use ?? 0) + " / " + (w.permits_cap ?? 0), "permits");
    const subs = w.subscriptions || [], moreSubs = (counts.subscriptions ?? subs.length) - subs.length;
    cell(row, (subs.join(", ") || "–") + (moreSubs > 0 ? " … +" + moreSubs : ""), "subscriptions");
    cell(row, counts.device ?? (resident.device || []).length, "num device-models")
      .title = (resident.device || []).join(", ");
    cell(row, bytes(rb.device || 0), "num");
    cell(row, counts.host ?? (resident.host || []).length, "num host-models")
      .title = (resident.host || []).join(", ");
    cell(row, bytes(rb.host || 0), "num");
    cell(row, ((loads.repository || 0) + (loads.disk || 0)) + " / " + (loads.host || 0),
         "num loads");
    cell(row, (ev.demote || 0) + " / " + (ev.drop || 0), "num evictions");
    cell(row, (w.runtimes || []).map(r => r.name + ":" + r.state).join(", "));
    body.appendChild(row);
  }
}

function renderQueues(queues, omitted) {
  const body = document.querySelector("#queues tbody");
  body.replaceChildren();
  for (const q of queues) {
    const row = document.createElement("tr");
    row.dataset.model = q.model;
    cell(row, q.model);
    cell(row, q.backlog, "num backlog");
    cell(row, q.consumers, "num consumers");
    cell(row, q.oldest_waiting_s == null ? "–" : q.oldest_waiting_s.toFixed(1) + " s",
         "num oldest");
    cell(row, (q.warm_on || []).join(", ") || "–", "warm-on");
    body.appendChild(row);
  }
  if (omitted && omitted.queues > 0) {  // the summary is bounded: the tail as counts
    const row = document.createElement("tr");
    row.className = "omitted";
    cell(row, "… " + omitted.queues + " more");
    cell(row, omitted.backlog, "num backlog");
    cell(row, omitted.consumers, "num consumers");
    cell(row, "–");
    cell(row, "–");
    body.appendChild(row);
  }
}

function syncScope(workers) {
  const select = document.getElementById("scope");
  const have = new Set([...select.options].map(o => o.value));
  for (const w of workers) {
    if (!have.has(w.worker_id)) {
      const option = document.createElement("option");
      option.value = option.textContent = w.worker_id;
      select.appendChild(option);
    }
  }
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

function renderChart(rate) {
  const scope = document.getElementById("scope").value;
  const chart = document.getElementById("chart");
  chart.replaceChildren();
  const points = (rate.points || []).map(p => {
    const s = scope ? (p.workers[scope] || null) : p.fleet;
    return s && { at: p.at, resident: s.resident_device + s.resident_host,
                  loads: s.loads_per_min, promotions: s.promotions_per_min,
                  loadCount: s.loads, promotionCount: s.promotions };
  }).filter(Boolean);
  const now = points.length ? points[points.length - 1] : null;
  text("rate-resident", now ? now.resident : null);
  text("rate-loads", now ? now.loads : null);
  text("rate-promotions", now ? now.promotions : null);
  text("window-loads", points.reduce((n, p) => n + p.loadCount, 0));
  text("window-promotions", points.reduce((n, p) => n + p.promotionCount, 0));
  const span = points.length ? Math.round(points[points.length - 1].at - points[0].at) : 0;
  text("window-span", Math.floor(span / 60) + " min " + (span % 60) + " s");
  chart.dataset.points = String(points.length);
  const x0 = PAD.left, x1 = W - PAD.right, y0 = H - PAD.bottom, y1 = PAD.top;
  svg("line", { x1: x0, y1: y0, x2: x1, y2: y0, stroke: "#c4c9d4" }, chart);
  if (points.length < 1) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7385" }, chart);
    t.textContent = "waiting for the workers' first two state samples…";
    return;
  }
  const tMin = points[0].at, tMax = Math.max(points[points.length - 1].at, tMin + 1);
  const maxRes = Math.max(1, ...points.map(p => p.resident));
  // The rate axis gets headroom (a round number above 1.5 x the peak), the residency
  // axis none: equal numbers of models and loads per minute do not draw one line.
  const peak = Math.max(1, ...points.map(p => Math.max(p.loads, p.promotions))) * 1.5;
  const step = Math.pow(10, Math.floor(Math.log10(peak)));
  const maxRate = [1, 2, 2.5, 5, 10].map(m => m * step).find(v => v >= peak);
  const xs = t => x0 + (x1 - x0) * (t - tMin) / (tMax - tMin);
  const yRes = v => y0 - (y0 - y1) * v / maxRes;
  const yRate = v => y0 - (y0 - y1) * v / maxRate;
  const line = (key, y, color, cls, dash) => svg("polyline", {
    points: points.map(p => xs(p.at).toFixed(1) + "," + y(p[key]).toFixed(1)).join(" "),
    fill: "none", stroke: color, "stroke-width": dash ? 2 : 3, class: cls,
    "stroke-dasharray": dash ? "6 4" : "none" }, chart);
  // Rates dashed on their own (right) scale, residency solid on top: when both lines
  // meet, both stay visible.
  line("promotions", yRate, "#2f9e44", "series-promotions", true);
  line("loads", yRate, "#e8590c", "series-loads", true);
  line("resident", yRes, "#3867d6", "series-resident", false);
  const label = (x, y, s, anchor, color) => {
    const t = svg("text", { x, y, "text-anchor": anchor, fill: color, "font-size": 11 }, chart);
    t.textContent = s;
  };
  label(x0 - 6, y1 + 8, String(maxRes), "end", "#3867d6");
  label(x0 - 6, y0, "0", "end", "#3867d6");
  label(x1 + 6, y1 + 8, maxRate.toFixed(1) + "/min", "start", "#e8590c");
  label(x1 + 6, y0, "0", "start", "#e8590c");
  const width = Math.round(tMax - tMin);
  label(x0, H - 8, "-" + Math.floor(width / 60) + "m" + (width % 60) + "s", "start", "#6b7385");
  label(x1, H - 8, "now", "end", "#6b7385");
}

function render(summary) {
  last = summary;
  renderTotals(summary.totals);
  syncScope(summary.workers);
  renderWorkers(summary.workers);
  renderQueues(summary.queues, summary.queues_omitted);
  renderChart(summary.load_rate);
  const status = document.getElementById("status");
  status.textContent = (summary.broker_error ? "broker: " + summary.broker_error + " · " : "")
    + "updated " + new Date(summary.at * 1000).toLocaleTimeString();
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  try {
    const scope = document.getElementById("scope").value;
    const url = "/v1/fleet/summary" + (scope ? "?worker=" + encodeURIComponent(scope) : "");
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (err) {
    document.getElementById("status").textContent = "cannot reach the gateway: " + err.message;
  } finally {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }
}

// /dashboard?worker=ID opens with that worker's panel (a link an operator can share).
const asked = new URLSearchParams(location.search).get("worker");
if (asked) {
  const option = document.createElement("option");
  option.value = option.textContent = asked;
  document.getElementById("scope").appendChild(option);
  document.getElementById("scope").value = asked;
}

// A new scope needs that worker's series: poll now rather than at the next tick.
document.getElementById("scope").addEventListener("change", () => {
  if (last) renderChart({ points: [] });
  clearTimeout(timer);
  poll();
});
poll();
