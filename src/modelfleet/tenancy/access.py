"""Who may reach what: a key's principal, its role, and the models its tenant may use.

Pure: the gateway classifies a route and asks here. Roles are ordered: ``caller`` (its
tenant's models and those granted to it), ``operator`` (also the fleet, the control
API, the dashboard and, if configured, metrics), ``admin`` (also every tenant's models).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from modelfleet.tenancy.keys import RANK, Role
from modelfleet.tenancy.plans import Plan
from modelfleet.tenancy.store import Tenant


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a key of a tenant, with a role and the tenant's plan."""

    key_id: str
    role: Role
    tenant: Tenant
    plan: Plan

    def has_role(self, needed: Role) -> bool:
        return RANK[self.role] >= RANK[needed]

    def may_use(self, model: str, owner: str | None) -> bool:
        """May this principal reach ``model``, owned by tenant ``owner`` (None: no such
        model)? Unknown models and other tenants' ungranted ones look alike (404 both)."""
        if owner is None:
            return self.role == "admin"
        return (self.role == "admin" or owner == self.tenant.name
                or model in self.tenant.grants)


# Who sent the request being handled (set by the gateway's auth layer around the route):
# the task it makes carries the caller's tenant and plan, so that a dead letter names the
# tenant whose request it was. None with auth off.
CALLER: ContextVar[Principal | None] = ContextVar("modelfleet_caller", default=None)


def task_tenant(owner: str, owner_plan: str) -> tuple[str, str]:
    """(tenant, plan) a task carries: the caller's when known, else the model owner's."""
    caller = CALLER.get()
    return (owner, owner_plan) if caller is None else (caller.tenant.name, caller.plan.name)


def caller_priority() -> int:
    """The plan priority of the caller being handled (0 with auth off)."""
    caller = CALLER.get()
    return 0 if caller is None else caller.plan.priority
