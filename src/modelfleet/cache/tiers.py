"""The host-memory tier: where models evicted from the device wait, warm.

A demoted model comes back with a copy, not a reload. The host tier has its
own budget and its own policy; it only ever receives models from the device
(demotions) and gives them back (promotions) or drops them.
"""

from __future__ import annotations

from modelfleet.cache.policy import EvictionPolicy
from modelfleet.cache.types import Eviction


class HostTier:
    """Accounting of host-resident models. Used by ``ModelCache``; pure.

    Models being promoted are *protected*: their bytes stay counted (the copy
    to the device has not happened yet) and they are never chosen as victims.
    """

    def __init__(self, budget_bytes: int, policy: EvictionPolicy) -> None:
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.used_bytes = 0
        self.demotions = 0
        self.drops = 0
        self._resident: dict[str, int] = {}
        self._protected: set[str] = set()

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._resident

    def size_of(self, model_id: str) -> int:
        return self._resident[model_id]

    def resident(self) -> dict[str, int]:
        """A copy of model id -> bytes."""
        return dict(self._resident)

    def ids(self) -> frozenset[str]:
        """The model ids resident here."""
        return frozenset(self._resident)

    def protect(self, model_id: str) -> None:
        """A promotion of ``model_id`` started: keep it until ``forget`` or ``unprotect``."""
        self._protected.add(model_id)

    def unprotect(self, model_id: str) -> None:
        """The promotion failed; ``model_id`` is an ordinary host resident again."""
        self._protected.discard(model_id)

    def forget(self, model_id: str) -> None:
        """The promotion of ``model_id`` finished: its host copy is freed, no eviction."""
        self._protected.discard(model_id)
        self.policy.forget(model_id)
        self.used_bytes -= self._resident.pop(model_id)

    def remove(self, model_id: str, reason: str) -> Eviction:
        """Explicitly drop ``model_id`` from host memory."""
        self._protected.discard(model_id)
        self.policy.forget(model_id)
        size = self._resident.pop(model_id)
        self.used_bytes -= size
        self.drops += 1
        return Eviction(model_id, size, "drop", "host", reason)

    def set_budget(self, budget_bytes: int) -> list[Eviction]:
        """A new budget; drops the lowest-ranked unprotected residents until they fit."""
        self.budget_bytes = budget_bytes
        actions: list[Eviction] = []
        while self.used_bytes > budget_bytes:
            dropped = self.shed("the host budget was lowered")
            if dropped is None:
                break
            actions.append(dropped)
        return actions

    def shed(self, reason: str) -> Eviction | None:
        """Drop the lowest-ranked unprotected resident; None if there is none."""
        victim = self.policy.victim(set(self._protected))
        if victim is None:
            return None
        self.policy.evict(victim)
        size = self._resident.pop(victim)
        self.used_bytes -= size
        self.drops += 1
        return Eviction(victim, size, "drop", "host", reason)

    def demote(
        self, model_id: str, size_bytes: int, reload_cost_s: float, reason: str
    ) -> list[Eviction] | None:
        """Take ``model_id`` from the device if the host tier can hold it.

        Returns the host drops that make room followed by the demotion, or None
        (nothing changed) when it should be dropped instead: too big, every
        resident protected, or ranked below everything the host would give up
        for it (the policy sees it admitted, as the lowest, and it loses).
        """
        if size_bytes > self.budget_bytes:
            return None
        self.policy.admit(model_id, size_bytes, reload_cost_s)
        free = self.budget_bytes - self.used_bytes
        excluded = set(self._protected)
        victims: list[str] = []
        while free < size_bytes:
            victim = self.policy.victim(excluded)
            if victim is None or victim == model_id:
                self.policy.forget(model_id)
                return None
            victims.append(victim)
            excluded.add(victim)
            free += self._resident[victim]
        actions: list[Eviction] = []
        for victim in victims:
            self.policy.evict(victim)
            size = self._resident.pop(victim)
            self.used_bytes -= size
            self.drops += 1
            actions.append(
                Eviction(
                    victim, size, "drop", "host", f"making room in host memory for {model_id!r}"
                )
            )
        self._resident[model_id] = size_bytes
        self.used_bytes += size_bytes
        self.demotions += 1
        actions.append(Eviction(model_id, size_bytes, "demote", "device", reason))
        return actions
