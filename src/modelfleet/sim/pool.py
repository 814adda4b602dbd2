"""One device budget per worker, shared by its runtimes (``modelfleet.worker.pool``), as
the simulator runs it: the pool's periodic resync and its room for a miss, carried out
with the worker's own ``spread.split_budget``.

- Every ``rescore_s`` (the worker's ``rescore_interval_s``) each runtime's budget is cut
  to what it holds (resident + reserved) and the free rest goes to the runtime with the
  most free bytes now (``BudgetPool.resync``); budgets are lowered before others are
  raised, and what no longer fits is evicted at once.
- Before a load, if its runtime's own budget cannot hold the model, the pool's free
  bytes go there, the others giving bytes back if short (``BudgetPool.make_room``).
"""

from __future__ import annotations

from collections.abc import Callable

from modelfleet.sim.worker import SimRuntime, SimWorker
from modelfleet.worker.spread import RuntimeView, split_budget


def runtime_view(runtime: SimRuntime) -> RuntimeView:
    """The runtime as the worker's pool reads it (its ``budget`` op): budget, bytes used,
    reserved and pinned, and what is resident on the device."""
    snap = runtime.cache.snapshot()
    return RuntimeView(runtime.name, budget_bytes=snap.device_budget_bytes,
                       used_bytes=snap.device_used_bytes,
                       reserved_bytes=snap.device_reserved_bytes,
                       pinned_bytes=runtime.cache.pinned_device_bytes,
                       resident=frozenset(snap.device))


def apply_split(worker: SimWorker, grow: SimRuntime | None, need_bytes: int,
                evicted: Callable[[SimRuntime, int], None]) -> None:
    """Re-split the worker's pool (``BudgetPool._apply``); ``evicted(runtime, count)``
    for the evictions a lowered budget made."""
    runtimes = worker.runtimes
    pool = sum(r.cache.device_budget_bytes for r in runtimes)
    budgets = split_budget(pool, [runtime_view(r) for r in runtimes],
                           grow.name if grow is not None else None, need_bytes)
    by_name = {r.name: r for r in runtimes}
    moves = sorted((budget - by_name[name].cache.device_budget_bytes, name)
                   for name, budget in budgets.items()
                   if budget != by_name[name].cache.device_budget_bytes)
    for _, name in moves:  # lower first, then raise
        runtime = by_name[name]
        evictions = runtime.cache.set_budgets(budgets[name])
        runtime.cache_changes += 1
        if evictions:
            evicted(runtime, len(evictions))


def needs_room(runtime: SimRuntime, size_bytes: int) -> bool:
    """Can the runtime's own budget not hold the model (``BudgetPool.make_room``)?"""
    return runtime.cache.device_budget_bytes < size_bytes
