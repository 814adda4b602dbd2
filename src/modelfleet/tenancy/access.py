"""Who may reach what: a key's principal, its role, and the models its tenant may use.

Pure: the gateway classifies a route and asks here. Roles are ordered: ``caller`` (its
tenant's models and those granted to it), ``operator`` (also the control API for its
own tenant's models: the repository index, load, unload, pin, publishing; and, if
configured, metrics), ``admin`` (fleet-wide: every tenant's models, the fleet and the dashboard).
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


    def may_control(self, owner: str | None) -> bool:
        """May this principal load, unload or pin a model owned by tenant ``owner`` (None:
        no such model)? An operator acts on its own tenant's models only (a grant lets a
        tenant use a model, not control it); an administrator on every model."""
        if self.role == "admin":
            return True
        return owner is not None and self.role == "operator" and owner == self.tenant.name

    def may_publish(self, model: str, owner: str | None) -> bool:
        """May this principal publish a version of ``model`` (owned by ``owner``; None: a
        new model)? An operator publishes its own tenant's models, and new ones whose
        names start with its tenant's name and a dash (``acme-``), so that tenants never
        race for a name; an administrator publishes any."""
        if self.role == "admin":
            return True
        if self.role != "operator":
            return False
        if owner is not None:
            return owner == self.tenant.name
        return model.startswith(f"{self.tenant.name}-")


# Who sent the request being handled (set by the gateway's auth layer around the route):
# the handler reads it once into the request's plan (gateway/resolve.py), whose task
# carries the caller's tenant and plan, so that a dead letter names the tenant whose
# request it was. None with auth off.
CALLER: ContextVar[Principal | None] = ContextVar("modelfleet_caller", default=None)
