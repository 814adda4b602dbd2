"""How long this worker's permits sat free while a task it could run was waiting.

Work-conserving pulling promises that a worker with a free permit never leaves such a
task waiting; this meter is how that promise is checked in production and in the
benchmark. It integrates free permits over time, counting only the stretches in which
the last observation saw a waiting task this worker could take (see
``scheduling.work_waiting``). Observations come at every re-score and every permit
taken or returned, so the integral is exact between them.
"""

from __future__ import annotations

from collections.abc import Callable

from modelfleet import metrics


class IdleMeter:
    def __init__(self, permits_cap: int, clock: Callable[[], float]) -> None:
        self._cap = permits_cap
        self._clock = clock
        self._since = clock()
        self._free = permits_cap
        self._waiting = False
        self.idle_permit_s = 0.0
        self.permit_s = 0.0

    def observe(self, free_permits: int | None = None, waiting: bool | None = None) -> None:
        """Close the stretch since the last observation; then take the new values."""
        now = self._clock()
        elapsed = max(now - self._since, 0.0)
        self._since = now
        self.permit_s += self._cap * elapsed
        metrics.PERMIT_SECONDS.inc(self._cap * elapsed)
        if self._waiting and self._free > 0:
            self.idle_permit_s += self._free * elapsed
            metrics.IDLE_PERMIT_SECONDS.inc(self._free * elapsed)
        if free_permits is not None:
            self._free = free_permits
        if waiting is not None:
            self._waiting = waiting

    @property
    def waiting(self) -> bool:
        """Did the last observation see a task this worker could run waiting?"""
        return self._waiting
