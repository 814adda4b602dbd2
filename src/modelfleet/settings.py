"""Every setting of modelfleet, built once at the command-line edge and passed down.

Sources, later ones winning: defaults here; environment variables
``MODELFLEET_<SECTION>__<FIELD>`` (e.g. ``MODELFLEET_GATEWAY__PORT=8080``); the
command-line flags. ``MODELFLEET_BROKER``, ``MODELFLEET_REPO`` and
``MODELFLEET_SECRET`` are short forms for the most common ones. Settings are frozen:
nothing changes a value after start-up.

A setting that does not exist is an error, never ignored: an unknown keyword, and an
environment variable under the ``MODELFLEET_`` prefix that names no setting
(``unknown_settings``: ``MODELFLEET_<SECTION>__<FIELD>`` whose section or field is not
one, or ``MODELFLEET_<NAME>`` that is no top-level setting). The few ``MODELFLEET_``
variables that are not settings are named in ``NOT_SETTINGS`` (each read where it says),
with the prefixes of the tests' services and the example models' own knobs
(``NOT_SETTINGS_PREFIXES``); a variable of your own takes another prefix.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from modelfleet.control.settings import ControlSettings
from modelfleet.publishing.settings import PublishSettings
from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.tenancy.settings import TenancySettings

MiB = 1024 * 1024
GiB = 1024 * MiB


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BrokerSettings(_Section):
    url: str = "memory"  # "memory" (embedded) or amqp://user:pass@host:port/vhost
    delivery_limit: int = Field(default=3, ge=0)  # redeliveries before dead-lettering
    # An idle model queue vanishes after this long (a task waiting in it keeps it alive):
    # the live queue count follows demand, not every model ever asked for.
    queue_idle_expiry_s: float = Field(default=300, gt=0)
    # How many live model queues the broker is sized for (RabbitMQ: see README "The broker
    # at scale"); modelfleet_broker_live_queues is logged as a warning from
    # live_queues_warn_fraction of it.
    max_live_queues: int = Field(default=5_000, ge=1)
    live_queues_warn_fraction: float = Field(default=0.8, gt=0, le=1)
    declare_timeout_s: float = Field(default=5, gt=0)
    connect_timeout_s: float = Field(default=5, gt=0)
    reconnect_max_backoff_s: float = Field(default=5, gt=0)
    queue_prefix: str = "model."
    # Names shared by one deployment; give each deployment on a vhost its own.
    events_exchange: str = "modelfleet.events"
    dead_letter_queue: str = "modelfleet.dead-letters"
    # The embedded broker's dead-letter queue holds at most this many (oldest dropped);
    # serve archives them as they come (see modelfleet.dlq.embedded).
    dead_letter_max: int = Field(default=10_000, ge=1)
    # RabbitMQ only: replies larger than this are zstd-compressed on their way through it.
    compress_threshold_bytes: int = Field(default=16 * 1024, ge=0)


class GatewaySettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    public_url: str = ""  # how runtimes reach this gateway; default http://host:port
    # The Open Inference Protocol over gRPC (inference.GRPCInferenceService) on this port
    # of ``host``, beside HTTP; None: off. 0: any free port (logged).
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    grpc_max_message_bytes: int = Field(default=64 * MiB, gt=0)
    max_body_bytes: int = Field(default=20 * MiB, gt=0)
    default_timeout_s: float = Field(default=30, gt=0)
    max_timeout_s: float = Field(default=120, gt=0)
    inline_threshold_bytes: int = Field(default=64 * 1024, ge=0)
    payload_store_bytes: int = Field(default=512 * MiB, gt=0)
    max_parked_requests: int = Field(default=10_000, gt=0)
    # Demand per model is announced at once, then at most once per interval while
    # requests wait: how soon a worker that pulls nothing of it learns of new work.
    demand_announce_interval_s: float = Field(default=0.25, gt=0)
    worker_stale_after_s: float = Field(default=10, gt=0)
    # The cold lane (broker cold_lane): a request for a model whose queue no live
    # worker pulls, and that no worker holds (or the fleet is one worker), goes to a
    # queue every worker takes from while it has a permit free, instead of waiting for
    # a worker to notice its model's queue. At most this many of one model's requests at
    # a time from this gateway go there (and no more than its fan-out cap); the rest
    # wait in the model's own queue, announced, where the scoring and its caps decide
    # who pulls it. 0: no cold lane.
    cold_lane_per_model: int = Field(default=4, ge=0)
    # modelfleet_fleet_desired_workers sizes the fleet so that this share of its permits
    # is in use when the backlog is served (the KEDA ScaledObject scales on it).
    target_permit_utilization: float = Field(default=0.8, gt=0, le=1)
    fleet_metrics_models: int = Field(default=20, ge=1)  # top-N models labelled, rest "other"
    # /v1/fleet/summary and the dashboard: the N most active queues, and per worker the
    # first N names of each model list; the rest as counts (a bounded page at any size).
    fleet_summary_models: int = Field(default=50, ge=1)
    # After SIGTERM: readiness says 503 and new work is refused at once; requests in
    # flight get this long to be answered, then a 503 shutting_down (with Retry-After).
    drain_timeout_s: float = Field(default=5, gt=0)
    # A connection must deliver a request's headers this long after it opened (or after
    # the previous answer on it); the whole body within body_read_timeout_s. 408 if not.
    header_read_timeout_s: float = Field(default=10, gt=0)
    body_read_timeout_s: float = Field(default=60, gt=0)
    # A kept-alive connection with no request begun closes after this long. Longer than
    # the idle expiry of the clients and proxies in front (httpx 5 s, aiohttp 15 s, an AWS
    # load balancer 60 s): a server that closes first races a client reusing the
    # connection, which then gets a reset instead of an answer.
    keep_alive_timeout_s: float = Field(default=75, gt=0)
    max_connections: int = Field(default=1000, gt=0)  # open at once; more get 503 at once
    max_header_bytes: int = Field(default=16 * 1024, ge=1024)  # a request's head; 431 above
    max_headers: int = Field(default=100, ge=8)  # header fields in one request; 431 above


class RuntimeSettings(_Section):
    device_budget_bytes: int = Field(default=2 * GiB, gt=0)
    host_budget_bytes: int = Field(default=4 * GiB, ge=0)
    max_concurrent_loads: int = Field(default=2, ge=1)
    # Threads of each runtime's numerical libraries; 0: cores / worker.shared_runtimes.
    compute_threads: int = Field(default=0, ge=0)
    eviction_policy: str = "tinylfu"  # tinylfu | gdsf | lru
    url_fetch_max_bytes: int = Field(default=20 * MiB, gt=0)
    url_fetch_timeout_s: float = Field(default=10, gt=0)
    # "host:port", "a.b.c.d/nn:port" or "[v6 or v6/nn]:port" exempt from the private-address
    # ban, on that port only (see fetch_allow_entry).
    url_fetch_allow: tuple[str, ...] = ()
    memory_limit_bytes: int | None = None  # default per-runtime limit for isolated models
    disk_cache_dir: str = ""
    disk_cache_bytes: int = Field(default=10 * GiB, gt=0)
    venv_dir: str = ""
    ping_interval_s: float = Field(default=2, gt=0)
    ping_timeout_s: float = Field(default=10, gt=0)
    start_timeout_s: float = Field(default=60, gt=0)
    load_timeout_s: float = Field(default=600, gt=0)  # a load running longer is hung
    # Memory (README "Memory: the budget is the RSS"): glibc's mmap threshold fixed at this
    # many bytes in each runtime process (0: glibc's dynamic default), malloc_trim after
    # evictions, and loads refused while RSS > start-up RSS + budgets + the larger of
    # budgets x rss_margin and rss_margin_floor_bytes (a small or pooled budget, even 0,
    # still leaves room for what a runtime allocates besides models).
    malloc_mmap_threshold_bytes: int = Field(default=1 * MiB, ge=0)
    trim_after_eviction: bool = True
    rss_margin: float = Field(default=0.25, ge=0)
    rss_margin_floor_bytes: int = Field(default=32 * MiB, ge=0)

    @field_validator("url_fetch_allow")
    @classmethod
    def _entries_name_a_port(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        for entry in entries:
            fetch_allow_entry(entry)
        return entries


def fetch_allow_entry(entry: str) -> tuple[str, int]:
    """``(host or network, port)`` of a ``runtime.url_fetch_allow`` entry; ValueError if it
    names no port. A bare host once exempted every port on it, the gateway's own
    /metrics included."""
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
    else:
        host, sep, port = entry.rpartition(":")
        sep = "" if ":" in host else sep  # a bare IPv6 address: the port is ambiguous
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"url_fetch_allow entry {entry!r} must name a host and a port: "
                         "'host:port', 'a.b.c.d/nn:port' or '[v6addr]:port' (an entry "
                         "without a port would open every port on that host)")
    return host.lower(), int(port)


class WorkerSettings(_Section):
    worker_id: str = ""  # default: hostname-pid
    permits: int = Field(default=16, ge=1)  # in-flight tasks per worker
    shared_runtimes: int = Field(default=1, ge=1)  # runtime processes for non-isolated models
    rescore_interval_s: float = Field(default=1.0, gt=0)
    # A re-score woken by an event waits a random pause of up to this long, so that
    # workers that all saw one announcement do not decide in the same instant.
    rescore_jitter_s: float = Field(default=0.01, ge=0)
    state_interval_s: float = Field(default=1.0, gt=0)
    # A cold take of a capped queue waits its turn: the workers that said they have a
    # permit free rank alike for each model (scheduling.keep_rank), the best ``cap`` of
    # them take it at once and each next ``cap`` this much later (at most
    # scheduling.MAX_TAKE_TURNS turns), after a fresh count. Workers that all heard one
    # announcement then do not all take a cap-1 queue in the same instant, each load
    # the model and share its tasks. 0: no turns.
    cold_take_turn_s: float = Field(default=0.1, ge=0)
    cold_lane: bool = True  # take tasks from the cold lane (gateway.cold_lane_per_model)
    # Unacked tasks each cold lane may hand this worker (running or waiting for a
    # permit); 0: follow the permits: the lane's tasks running here plus the free
    # permits, at least the shared runtimes' load slots, at most worker.permits.
    cold_lane_prefetch: int = Field(default=0, ge=0)
    drain_timeout_s: float = Field(default=5, gt=0)
    restart_backoff_max_s: float = Field(default=10, gt=0)
    # After a crash, a shared runtime keeps a started spare process this long (0: never):
    # the next crash then costs a swap, not an interpreter start.
    standby_keep_s: float = Field(default=300, ge=0)
    # Keep that spare from the start, not only after a first crash: the first crash is a
    # swap too (bystanders stall ~0.5 s instead of a restart and their models' imports),
    # at the cost of one more interpreter per shared runtime that has imported what its
    # models import (~100 MB RSS with scikit-learn, measured), outside the runtime budget;
    # with runtime_zygote (below) the spare is a fork of the zygote: only what it writes.
    standby_eager: bool = False
    # Fork runtimes from a zygote (worker/zygote_launcher.py): one process per worker that
    # has imported the runtime's code and its models' frameworks, so that a restart after a
    # crash costs a fork and the models' reloads, not an interpreter start and its imports
    # (a spare, above, is then a fork too), and the frameworks' pages are shared by the
    # runtimes. Off: each runtime is an interpreter of its own. Isolated models with their
    # own requirements always are. On by default (README "Restarts that cost a fork": the
    # stalls that had it turned off were the suspect gate's and the counting's, fixed).
    runtime_zygote: bool = True
    demand_window_s: float = Field(default=60, gt=0)  # how long a demand announcement counts
    # Suspect work (a redelivered task, a task in a predict that ran when its runtime
    # died, or any task of a model whose code ran in a crash lately) runs on a quarantine
    # runtime beside the shared ones, so that its crash takes no healthy model down. A
    # model is sent there for this long after its crash, and a quarantine runtime that
    # does not stand (quarantine_standing) is stopped after this long unused.
    quarantine_idle_s: float = Field(default=60, gt=0)
    # Start the quarantine runtime with the worker and keep it (a bare interpreter, ~50 MB
    # RSS), rather than at the first suspect and stopping it after quarantine_idle_s.
    quarantine_standing: bool = True
    # A task that crashed the quarantine runtime (where it ran alone) this many times is
    # dead-lettered as deterministic (at most broker.delivery_limit + 1 crashes).
    quarantine_crash_limit: int = Field(default=1, ge=1)
    # The quarantine runtime's CPU priority below the shared ones' (os.nice, 0: the same):
    # its pills' restarts yield the cores to the healthy models' reloads.
    quarantine_nice: int = Field(default=10, ge=0, le=19)
    isolated_idle_stop_s: float = Field(default=600, gt=0)  # an unused own runtime is stopped
    # One device budget for all shared runtimes, split among them by what each holds
    # (worker/pool.py). 0: runtime.device_budget_bytes x shared_runtimes, as before.
    device_budget_bytes: int = Field(default=0, ge=0)
    # Tasks in flight for one model per runtime holding it at which it gets one more
    # runtime (a replica); 0: permits / shared_runtimes. Dropped again once its tasks fell
    # to half of what its other runtimes take, for replica_keep_s.
    replica_at_tasks: int = Field(default=0, ge=0)
    replica_keep_s: float = Field(default=10, ge=0)
    # CUDA devices this worker has (the GPU pool's overlay sets it to the node's
    # nvidia.com/gpu count). 0, a CPU worker: it never pulls a model whose manifest says
    # device = "cuda", and the gateway answers such a model 503 while no live worker
    # has a device. Declared, not probed: no torch import, nothing guessed at startup.
    gpus: int = Field(default=0, ge=0)


class _EnvSource(EnvSettingsSource):
    """``MODELFLEET_BROKER=amqp://...`` is the broker's URL, not a JSON ``broker`` section."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if field_name == "broker" and isinstance(value, str) and not value.lstrip().startswith("{"):
            return {"url": value}
        return super().decode_complex_value(field_name, field, value)


class Settings(BaseSettings):
    # extra="forbid": an unknown keyword is an error (environment variables: see
    # ``unknown_settings``, which the CLI checks at start-up).
    model_config = SettingsConfigDict(
        env_prefix="MODELFLEET_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    repo: str = "examples/models"
    # Where this machine keeps what it makes: the artifact disk cache, model venvs, the
    # embedded deployment's database, the parsed manifests (catalog/) (MODELFLEET_STATE_DIR).
    state_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "modelfleet")
    repo_refresh_s: float = Field(default=30, gt=0)  # new and removed models picked up
    secret: str = Field(default_factory=lambda: secrets.token_hex(16))
    broker: BrokerSettings = BrokerSettings()
    gateway: GatewaySettings = GatewaySettings()
    worker: WorkerSettings = WorkerSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    scheduling: ScoringSettings = ScoringSettings()
    tenancy: TenancySettings = TenancySettings()  # API keys, plans, limits, usage
    control: ControlSettings = ControlSettings()
    publish: PublishSettings = PublishSettings()  # modelfleet push, load with files
    # Per-model counters and histograms (gateway and worker): the first N models seen
    # get their own ``model`` label, every later one counts as model="other".
    metrics_models: int = Field(default=20, ge=1)
    log_level: str = "info"
    # "json": one JSON object per log line, and one line per request (gateway) and per
    # task (worker) with its ids, status and phase timings (MODELFLEET_LOG_FORMAT=json).
    log_format: Literal["text", "json"] = "text"

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvSource(settings_cls), dotenv_settings, file_secret_settings)

    @property
    def disk_cache_path(self) -> Path:
        """Where a remote repository's packages are cached (``runtime.disk_cache_dir``)."""
        configured = self.runtime.disk_cache_dir
        return Path(configured).expanduser() if configured else self.state_dir / "disk-cache"


# MODELFLEET_ variables that are not settings, and who reads them.
NOT_SETTINGS: frozenset[str] = frozenset({
    "MODELFLEET_DLQ_DB",  # the deployment's database (database.py; an older name)
    "MODELFLEET_KEY",  # modelfleet push: the API key (publishing/push.py)
    "MODELFLEET_HEALTHCHECK_URL",  # the image's HEALTHCHECK (Containerfile)
    "MODELFLEET_RUNTIME_SETTINGS",  # a worker to its runtime processes (ipc/protocol.py)
    "MODELFLEET_RUNTIME_PRELOAD",  # the same
    "MODELFLEET_RUNTIME_NICE",  # the same: its CPU priority (the quarantine runtime's)
    "MODELFLEET_RUNTIME_FLIGHT",  # the same: its flight record's path (ipc/flight.py)
    "MODELFLEET_MEMORY_LIMIT_BYTES",  # a runtime to its model: its memory limit (the same)
    "MODELFLEET_DASHBOARD_SCREENSHOT",  # tests/e2e/test_dashboard.py: keep its screenshot
})
# The tests' own services (MODELFLEET_TEST_AMQP, _POSTGRES, _REDIS) and the example
# models' knobs (MODELFLEET_EXAMPLE_SLOWLOAD_S...).
NOT_SETTINGS_PREFIXES: tuple[str, ...] = ("MODELFLEET_TEST_", "MODELFLEET_EXAMPLE_")


def unknown_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``MODELFLEET_`` environment variables that name no setting (and are not one of
    ``NOT_SETTINGS``)."""
    environ = os.environ if environ is None else environ
    unknown = []
    for name in sorted(environ):
        upper = name.upper()  # the environment source reads names in any case
        if not upper.startswith("MODELFLEET_") or upper in NOT_SETTINGS \
                or upper.startswith(NOT_SETTINGS_PREFIXES):
            continue
        path = upper.removeprefix("MODELFLEET_").lower().split("__")
        model: Any = Settings
        for part in path:
            fields = getattr(model, "model_fields", None)
            if fields is None or part not in fields:
                unknown.append(name)
                break
            model = fields[part].annotation
    return unknown
