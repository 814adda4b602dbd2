"""Who may reach what: a key's principal, its role, and the models its tenant may use.

Pure: the gateway classifies a route and asks here. Roles are ordered: ``caller`` (its
tenant's models and those granted to it), ``operator`` (also the fleet, the control
API, the dashboard and, if configured, metrics), ``admin`` (also every tenant's models).
"""

from __future__ import annotations

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
