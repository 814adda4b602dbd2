"""The ``tenancy`` section of the settings (``MODELFLEET_TENANCY__<FIELD>``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TenancySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # on: every route but the probes needs an API key. off: open (a warning at start-up).
    # auto: on for `gateway`; for `serve`, on unless it listens on loopback only.
    auth: Literal["auto", "on", "off"] = "auto"
    # Where keys, tenants and usage live: a SQLite file or a postgresql:// URL. Empty:
    # the dead-letter archive's database ($MODELFLEET_DLQ_DB, else
    # ~/.cache/modelfleet/dlq.sqlite3).
    db: str = ""
    # Rate and concurrency counters shared by every gateway. "memory": in this process
    # only (what `serve` uses: it is the only gateway).
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "modelfleet:"  # give each deployment sharing a Redis its own
    plans_file: str = ""  # TOML with [plans.<name>] tables (see modelfleet.tenancy.plans)
    # How long a gateway trusts what it read of a key or tenant: a revoked key stops
    # working within this long, with no restart.
    cache_ttl_s: float = Field(default=2.0, gt=0, le=60)
    usage_flush_s: float = Field(default=10.0, gt=0)  # usage buffered this long at most
    # With auth on, /metrics needs the operator role (it names tenants and models); an
    # operator who scrapes from a trusted network opens it with false.
    protect_metrics: bool = True
    # Tenants named in metric labels, the first ones seen; the rest count as "(other)".
    metric_tenants_max: int = Field(default=50, ge=0)
