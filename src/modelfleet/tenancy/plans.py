"""Plans: what a tenant may use. Three built in; more (or changed ones) in a TOML file.

    # plans.toml (settings: tenancy.plans_file, env MODELFLEET_TENANCY__PLANS_FILE)
    [plans.team]
    requests_per_s = 20        # sustained request rate per tenant, all gateways together
    burst = 40                 # requests allowed at once above the rate
    max_concurrent = 8         # requests of the tenant in flight at once, all gateways
    priority = 1               # higher wins a worker's scarce permits and load slots
    fanout_multiplier = 1.5    # a model's [fanout] max_workers is multiplied by this

A plan named like a built-in one replaces it. ``requests_per_s = 0`` or
``max_concurrent = 0`` means no such limit.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelfleet.errors import ConfigError

if TYPE_CHECKING:
    from modelfleet.settings import Settings


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    requests_per_s: float = Field(default=5.0, ge=0)
    burst: int = Field(default=10, ge=1)
    max_concurrent: int = Field(default=4, ge=0)
    priority: int = Field(default=0, ge=0, le=100)
    fanout_multiplier: float = Field(default=1.0, gt=0)


BUILTIN: dict[str, Plan] = {
    "free": Plan(name="free", requests_per_s=5, burst=10, max_concurrent=4, priority=0,
                 fanout_multiplier=1.0),
    "pro": Plan(name="pro", requests_per_s=50, burst=100, max_concurrent=32, priority=1,
                fanout_multiplier=2.0),
    "enterprise": Plan(name="enterprise", requests_per_s=1000, burst=2000, max_concurrent=512,
                       priority=2, fanout_multiplier=4.0),
}


def load_plans(path: str | Path | None) -> dict[str, Plan]:
    """The built-in plans, with those of the TOML file at ``path`` (if any) on top.

    Raises ConfigError naming the file and the plan for anything it cannot use.
    """
    plans = dict(BUILTIN)
    if not path:
        return plans
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the plans file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the plans file {path} is not valid TOML: {exc}") from exc
    table = data.get("plans")
    if not isinstance(table, Mapping) or set(data) - {"plans"}:
        raise ConfigError(f"the plans file {path} must hold only [plans.<name>] tables")
    for name, fields in table.items():
        if not isinstance(fields, Mapping):
            raise ConfigError(f"{path}: plans.{name} must be a table")
        try:
            plans[name] = Plan(name=name, **fields)
        except (ValidationError, TypeError) as exc:
            raise ConfigError(f"{path}: plans.{name}: {_first_problem(exc)}") from exc
    return plans


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"field '{'.'.join(map(str, first['loc']))}': {first['msg']}"
    return str(exc)


def with_plans_file(settings: Settings) -> Settings:
    """``settings`` whose queue scoring uses the plans file's fan-out multipliers and
    priorities (for workers: a plans file that changes ``pro`` changes its queues too).
    Without a plans file, unchanged (the built-in plans match the scoring defaults)."""
    if not settings.tenancy.plans_file:
        return settings
    plans = load_plans(settings.tenancy.plans_file)
    scoring = settings.scheduling
    return settings.model_copy(update={"scheduling": scoring.model_copy(update={
        "plan_fanout_multiplier": {**scoring.plan_fanout_multiplier,
                                   **{name: p.fanout_multiplier for name, p in plans.items()}},
        "plan_priority": {**scoring.plan_priority,
                          **{name: p.priority for name, p in plans.items()}},
    })})
