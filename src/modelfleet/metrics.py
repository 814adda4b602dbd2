"""Every Prometheus metric of modelfleet, defined once.

Each process exposes the metrics of the parts it runs (gateway, worker) on its own
``/metrics``; runtime processes report to their coordinator, which mirrors their
numbers here, so a scrape of the worker sees its runtimes too.

Every per-model counter is bounded (``modelfleet.labels``): the worker's
``*_total{model}`` counters take their ``model`` label through ``WORKER_MODELS``, the
first ``metrics_models`` models seen (``bound_models``, called once at start-up), the
rest counted as model="other"; the gateway's go through its request observer's.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from modelfleet.labels import ModelLabels

WORKER_MODELS = ModelLabels()


def bound_models(limit: int) -> None:
    """How many models keep their own label in the worker's per-model counters."""
    WORKER_MODELS.limit = limit


class _ModelCounter(Counter):
    """A counter whose first label is a model id, bounded by ``WORKER_MODELS``: its
    callers pass the model id and never see the bound."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        if labelvalues:
            labelvalues = (WORKER_MODELS(str(labelvalues[0])), *labelvalues[1:])
        elif "model" in labelkwargs:
            labelkwargs["model"] = WORKER_MODELS(str(labelkwargs["model"]))
        return super().labels(*labelvalues, **labelkwargs)


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 120)

# -- gateway ------------------------------------------------------------------------
REQUESTS = Counter("modelfleet_gateway_requests_total",
                   "Inference requests answered by this gateway, by model (the first N "
                   "models seen, the rest as 'other') and HTTP status",
                   ["model", "status"])
REQUEST_SECONDS = Histogram("modelfleet_gateway_request_seconds",
                            "Time from request received to answer sent, by model (the first "
                            "N models seen, the rest as 'other')", ["model"],
                            buckets=_LATENCY_BUCKETS)
PARKED = Gauge("modelfleet_gateway_parked_requests", "Requests waiting for their reply")
CLIENT_DISCONNECTS = Counter("modelfleet_gateway_client_disconnects_total",
                             "Callers that hung up before their answer was ready")
OPEN_CONNECTIONS = Gauge("modelfleet_gateway_open_connections",
                         "HTTP connections open on this gateway")
CONNECTIONS_REFUSED = Counter("modelfleet_gateway_connections_refused_total",
                              "Connections refused (503) beyond gateway.max_connections")
IDLE_CONNECTIONS_CLOSED = Counter(
    "modelfleet_gateway_idle_connections_closed_total",
    "Kept-alive connections with no request begun closed to make room for a new one "
    "over gateway.max_connections")
READ_TIMEOUTS = Counter("modelfleet_gateway_read_timeouts_total",
                        "Requests whose headers or body did not arrive in time", ["phase"])
LATE_REPLIES = Counter("modelfleet_gateway_late_replies_total",
                       "Replies that found no waiting request (duplicate or after deadline)")
PUBLISHES = Counter("modelfleet_gateway_publishes_total",
                    "Model packages sent to this gateway to be published, by outcome: "
                    "published, or the error code that refused it (invalid_package, "
                    "package_too_large, bad_signature, version_exists, model_not_found, "
                    "forbidden, ...)", ["outcome"])
CONTROL_COMMANDS = Counter("modelfleet_control_commands_total",
                           "Control API commands this gateway ran (load, unload, pin, "
                           "unpin, route), by outcome: ok, failed, timed_out, not_kept "
                           "(given, but the database refused to keep it)",
                           ["action", "outcome"])
PAYLOAD_STORE_BYTES = Gauge("modelfleet_gateway_payload_store_bytes",
                            "Bytes of request payloads held for workers to fetch")
PAYLOAD_FETCHES = Counter("modelfleet_gateway_payload_fetches_total",
                          "Payload fetches from runtimes, by outcome", ["outcome"])
PHASE_SECONDS = Histogram("modelfleet_phase_seconds",
                          "Per-phase latency of every request, by outcome: the workers' phases "
                          "when a reply came back, and 'total' (at the gateway) always; model "
                          "bounded (first N models, the rest 'other')",
                          ["model", "phase", "outcome"], buckets=_LATENCY_BUCKETS)

# -- worker -------------------------------------------------------------------------
TASKS = _ModelCounter("modelfleet_worker_tasks_total",
                "Tasks settled by this worker, by model and outcome", ["model", "outcome"])
EXPIRED_TASKS = _ModelCounter("modelfleet_worker_expired_tasks_total",
                        "Tasks dropped unrun because their deadline had passed", ["model"])
DEAD_LETTERS_DROPPED = Counter(
    "modelfleet_dead_letters_dropped_total",
    "Dead letters the embedded broker dropped because its bounded queue was full")
CANCELLED_TASKS = _ModelCounter("modelfleet_worker_cancelled_tasks_total",
                          "Tasks dropped or abandoned because their caller hung up", ["model"])
PERMITS_IN_USE = Gauge("modelfleet_worker_permits_in_use", "In-flight tasks on this worker")
IDLE_PERMIT_SECONDS = Counter(
    "modelfleet_worker_idle_permit_seconds_while_backlog_total",
    "Free permits x seconds while a queue this worker could serve had tasks waiting "
    "(work-conserving pulling keeps it near zero; compare with permit_seconds_total)")
PERMIT_SECONDS = Counter("modelfleet_worker_permit_seconds_total",
                         "Permits x seconds this worker has existed (the idle counter's base)")
PERMITS_CAP = Gauge("modelfleet_worker_permits_cap", "Most in-flight tasks this worker takes")
SUBSCRIPTIONS = Gauge("modelfleet_worker_subscriptions", "Model queues this worker consumes")
QUEUE_BACKLOG = Gauge("modelfleet_queue_backlog", "Ready messages per model queue (as seen by "
                      "this worker's discovery; a queue it no longer considers is removed)",
                      ["model"])
COLD_LANE_TASKS = Counter("modelfleet_worker_cold_lane_tasks_total",
                          "Tasks this worker took from the cold lane (models no worker held)")
COLD_LANE_PASSED_ON = Counter("modelfleet_worker_cold_lane_passed_on_total",
                              "Cold-lane tasks this worker could not run, moved to their "
                              "model's own queue")
GATEWAY_COLD_LANE = Counter("modelfleet_gateway_cold_lane_tasks_total",
                            "Requests this gateway sent to the cold lane (their model held, "
                            "pulled and loaded by no worker)")
SUBSCRIBE_EVENTS = Counter("modelfleet_worker_subscription_changes_total",
                           "Subscribe and unsubscribe decisions", ["change", "warmth"])
VERSION_CHANGES = Counter("modelfleet_worker_version_changes_total",
                          "Model versions this worker warmed (a new version), failed to warm, "
                          "unpinned or released (the route left them), or dropped (unloaded "
                          "by an operator)", ["action"])
RUNTIME_RESTARTS = Counter("modelfleet_runtime_restarts_total",
                           "Runtime processes restarted after a crash or hang", ["reason"])
RUNTIMES_READY = Gauge("modelfleet_runtimes_ready", "Runtime processes ready to take work")
RUNTIME_DEVICE_BUDGET = Gauge("modelfleet_runtime_device_budget_bytes",
                              "Each shared runtime's part of the worker's pooled device "
                              "budget, as last moved", ["runtime"])
MODEL_REPLICAS = Gauge("modelfleet_worker_model_replicas",
                       "Extra runtimes holding a hot model (copies beyond the first)")
REDELIVERED = _ModelCounter("modelfleet_worker_tasks_handed_back_total",
                      "Tasks handed back to the broker (runtime crashed or hung)", ["model"])
CRASH_BYSTANDERS = _ModelCounter(
    "modelfleet_worker_crash_bystanders_total",
    "Tasks handed back from a runtime that died, cleared by its flight record (their "
    "model's code was not running): they run again at once, not in quarantine", ["model"])
DEAD_LETTERED = _ModelCounter("modelfleet_worker_dead_lettered_total",
                        "Tasks this worker sent to the dead-letter queue", ["model", "reason"])

# -- model cache (mirrored from runtimes) --------------------------------------------
RESIDENT_MODELS = Gauge("modelfleet_resident_models", "Models resident, by tier", ["tier"])
RESIDENT_BYTES = Gauge("modelfleet_resident_bytes", "Bytes of resident models, by tier",
                       ["tier"])
MODEL_LOADS = Counter("modelfleet_model_loads_total",
                      "Model loads, by source: 'repository' and 'disk' (the worker's disk "
                      "cache) read storage; 'host' is a promotion from host memory (a copy)",
                      ["source"])
MODEL_LOAD_BYTES = Counter("modelfleet_model_load_bytes_total",
                           "Bytes of models loaded (as measured at each load), by source as "
                           "modelfleet_model_loads_total labels it; divide by requests for "
                           "bytes loaded per request", ["source"])
MODEL_LOAD_SECONDS = Histogram("modelfleet_model_load_seconds", "Model load duration, by source",
                               ["source"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                                    30, 60, 120, 300))
MODEL_LOAD_FAILURES = Counter("modelfleet_model_load_failures_total", "Model loads that failed")
MODEL_LOAD_RATE = Gauge("modelfleet_model_loads_per_minute",
                        "Model loads from storage (repository or disk) in the last 60 s: the "
                        "cache's health signal (a count that will not settle over a sustained "
                        "load rate is churn); promotions from host memory are not loads")
MODEL_PROMOTION_RATE = Gauge("modelfleet_model_promotions_per_minute",
                             "Promotions from host memory to the device in the last 60 s "
                             "(a copy, not a load)")
EVICTIONS = Counter("modelfleet_evictions_total",
                    "Evictions from the device, by action: 'demote' (to host memory) or 'drop'",
                    ["action"])

# -- broker (gateways and workers alike) -----------------------------------------------
# Counted by the process from what it declared, consumes and saw expire (no broker API
# lists queues without walking them): each process's count is a lower bound of the
# node's, the max() across processes a better one (see README "The broker at scale").
BROKER_LIVE_QUEUES = Gauge("modelfleet_broker_live_queues",
                           "Model queues alive on the broker, as far as this process knows")
BROKER_MAX_LIVE_QUEUES = Gauge("modelfleet_broker_max_live_queues",
                               "Live model queues the broker is sized for (broker.max_live_queues)")

# -- fleet, as one gateway sees it (autoscaling signals; see README "Metrics") --------
# Every gateway computes the same fleet-wide figures from the workers' published state
# and the broker's exact queue counts: aggregate them across gateways with max(), not sum().
FLEET_WORKERS = Gauge("modelfleet_fleet_workers", "Live workers (state seen recently)")
FLEET_BACKLOG = Gauge("modelfleet_fleet_backlog",
                      "Tasks ready in each model queue, fleet-wide (top N models labelled, the "
                      "rest summed as model='other')", ["model"])
FLEET_TOTAL_BACKLOG = Gauge("modelfleet_fleet_total_backlog",
                            "Tasks ready in all model queues with demand, fleet-wide")
FLEET_OLDEST_WAITING = Gauge("modelfleet_fleet_oldest_waiting_seconds",
                             "Age of the oldest request this gateway still waits on, per model "
                             "(top N labelled, the rest as model='other', their maximum)",
                             ["model"])
FLEET_PERMITS_IN_USE = Gauge("modelfleet_fleet_permits_in_use",
                             "Permits in use over all live workers")
FLEET_PERMITS_CAP = Gauge("modelfleet_fleet_permits_cap", "Permits of all live workers")
FLEET_PERMIT_UTILIZATION = Gauge("modelfleet_fleet_permit_utilization",
                                 "Permits in use / permits of all live workers (0..1)")
FLEET_DESIRED_WORKERS = Gauge(
    "modelfleet_fleet_desired_workers",
    "Workers the fleet needs: ceil((permits in use + backlog) / (permits per worker x "
    "target utilization)); what the KEDA ScaledObject scales on")

# -- runtime memory (mirrored from each runtime's stats; see README "Memory: the budget is
# the RSS"). Labelled by runtime name: a worker has a handful of runtimes.
RUNTIME_RSS = Gauge("modelfleet_runtime_rss_bytes", "Resident set size of each runtime process "
                    "at the last ask", ["runtime"])
RUNTIME_BUDGET = Gauge("modelfleet_runtime_budget_bytes",
                       "The memory budget each runtime's RSS is held to: its device plus host "
                       "budgets", ["runtime"])
RUNTIME_RSS_STARTUP = Gauge("modelfleet_runtime_rss_startup_bytes",
                            "RSS of each runtime at start-up, after imports and before any "
                            "model", ["runtime"])
RUNTIME_RSS_OVERHEAD = Gauge("modelfleet_runtime_rss_overhead_bytes",
                             "The fixed overhead beside each runtime's budget: its start-up "
                             "RSS plus what the first import of its models' frameworks added",
                             ["runtime"])
RUNTIME_RSS_LIMIT = Gauge("modelfleet_runtime_rss_limit_bytes",
                          "The RSS above which a runtime refuses loads: overhead + budget x "
                          "(1 + runtime.rss_margin)", ["runtime"])
RUNTIME_OVER_BUDGET = Gauge("modelfleet_runtime_over_memory_budget",
                            "1 while a runtime is over its RSS limit (refusing loads, "
                            "shedding models), else 0", ["runtime"])
RUNTIME_LOADS_REFUSED = Counter("modelfleet_runtime_loads_refused_total",
                                "Model loads a runtime refused because it was over its memory "
                                "budget", ["runtime"])
RUNTIME_DEVICE_RESERVED = Gauge("modelfleet_runtime_device_reserved_bytes",
                                "Bytes the CUDA caching allocator holds in each runtime "
                                "(0 without CUDA)", ["runtime"])

MEMORY_RETRIES = Counter(
    "modelfleet_worker_memory_retries_total",
    "Tasks a shared runtime refused for memory (its RSS guard: no_capacity; a budget moved "
    "away under a concurrent miss: model_too_large) asked again shortly, by code",
    ["code"])

TENANT_REQUESTS = Counter("modelfleet_tenant_requests_total",
                          "Inference requests per tenant (the first tenancy.metric_tenants_max "
                          "seen; the rest as '(other)') and usage outcome",
                          ["tenant", "outcome"])
AUTH_REFUSALS = Counter("modelfleet_gateway_auth_refusals_total",
                        "Requests refused by the auth layer, by status", ["status"])
