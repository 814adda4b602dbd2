"""The model cache: which models are resident where, and which to give up first.

Pure accounting and policy: no I/O, no asyncio, no clocks except the one
injected. The runtime process and the fleet simulator run this same code.

    from modelfleet.cache import ModelCache, POLICIES

    cache = ModelCache(device_budget_bytes=16 << 30, host_budget_bytes=64 << 30,
                       policy=POLICIES["gdsf"]())

See ``ModelCache`` for the reserve / commit / release protocol around a load.
"""

from modelfleet.cache.cost import DEFAULT_COSTS, LoadCostModel
from modelfleet.cache.model_cache import ModelCache
from modelfleet.cache.policy import (
    POLICIES,
    AdmissionPolicy,
    EvictionPolicy,
    GdsfPolicy,
    LruPolicy,
    TinyLfuPolicy,
)
from modelfleet.cache.sketch import FrequencySketch
from modelfleet.cache.types import (
    CacheSnapshot,
    Eviction,
    EvictionAction,
    LoadSource,
    Reservation,
    Tier,
)

__all__ = [
    "DEFAULT_COSTS",
    "POLICIES",
    "AdmissionPolicy",
    "CacheSnapshot",
    "Eviction",
    "EvictionAction",
    "EvictionPolicy",
    "FrequencySketch",
    "GdsfPolicy",
    "LoadCostModel",
    "LoadSource",
    "LruPolicy",
    "ModelCache",
    "Reservation",
    "Tier",
    "TinyLfuPolicy",
]
