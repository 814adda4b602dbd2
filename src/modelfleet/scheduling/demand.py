"""The priority of a model's demand: the highest plan priority among its recent callers.

Gateways note each caller's plan priority per model and announce the highest of the
last ``window_s`` with their demand events; workers note what is announced and score a
queue by the highest of their own window (``QueueView.priority``). Pure: time is an
argument.
"""

from __future__ import annotations


class DemandPriority:
    __slots__ = ("_seen", "_window_s")

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: dict[str, dict[int, float]] = {}  # model -> priority -> last seen

    def note(self, model_id: str, priority: object, now: float) -> None:
        """A caller (or an announcement) of ``priority`` for ``model_id`` at ``now``;
        anything but a non-negative int (a malformed event) counts as 0."""
        value = priority if isinstance(priority, int) and not isinstance(priority, bool) \
            and 0 <= priority <= 1000 else 0
        self._seen.setdefault(model_id, {})[value] = now

    def of(self, model_id: str, now: float) -> int:
        """The highest priority seen for ``model_id`` within the window (0 if none)."""
        seen = self._seen.get(model_id)
        if not seen:
            return 0
        for priority, at in list(seen.items()):
            if now - at > self._window_s:
                del seen[priority]
        if not seen:
            del self._seen[model_id]
            return 0
        return max(seen)
