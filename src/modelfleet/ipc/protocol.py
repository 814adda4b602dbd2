"""What the coordinator and a runtime agree on: the ``Runtime`` protocol, its ops, the environment.

Both sides import this module and nothing of each other: the worker never imports
the runtime's server (which would load the model host, the cache and the codecs into
the coordinator), and the runtime never imports the worker.

Two implementations of ``Runtime``: ``ipc.socket_runtime.SocketRuntime``, the
coordinator's end of a runtime process's socket (production), and
``runtime.inprocess.InProcessRuntime``, the same server code called in this process
(tests of the coordinator with the embedded broker, no processes). A ``Launcher``
starts one of either kind; the supervisor watches what it started the same way.

Every method raises ``RuntimeCrashed`` once the runtime is gone (its process died,
its socket closed), and the ``ModelfleetError`` the runtime answered otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from modelfleet.ipc.flight import Flight
from modelfleet.messages import EncodedReply

Op = Literal["load", "unload", "unpin", "infer", "health", "stats", "shutdown", "set_budgets",
            "budget", "cancel"]

# The runtime's settings, as JSON (``Settings.model_dump_json()``).
SETTINGS_ENV = "MODELFLEET_RUNTIME_SETTINGS"
# Top-level modules to import before serving (a standby runtime imports what the runtime
# it may replace had imported for its models, so that their reloads are quick).
PRELOAD_ENV = "MODELFLEET_RUNTIME_PRELOAD"
# How much the runtime lowers its CPU priority at start (``os.nice``): the quarantine
# runtime's suspect work yields the cores to the healthy models' runtimes.
NICE_ENV = "MODELFLEET_RUNTIME_NICE"
# The memory limit the runtime runs under, when the worker set one.
MEMORY_LIMIT_ENV = "MODELFLEET_MEMORY_LIMIT_BYTES"


@dataclass(frozen=True)
class InferCall:
    """One task for a runtime: its bytes as the broker carried them, and what the worker adds.

    ``worker_id`` and ``queue_wait_ms`` are stamped into the reply by the runtime, so
    that the reply crosses the coordinator without being decoded.
    """

    task: bytes  # messages.encode_task's bytes (Delivery.body), passed on unchanged
    delivery_count: int
    accepts: tuple[str, ...]
    worker_id: str
    queue_wait_ms: float
    # An operator's override of the model's [batching] (``ConfigOverride.batching``):
    # the runtime's batcher for it takes these; empty: the model.toml's own.
    batching: Mapping[str, int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    """One model load, as the runtime's host reports it."""

    model_id: str
    source: str  # "disk" (read from the package) or "host" (promoted from host memory)
    seconds: float
    size_bytes: int


@dataclass(frozen=True)
class RuntimeStats:
    """Residency by model id (versions folded), and what happened since the last ask."""

    device: tuple[str, ...] = ()
    host: tuple[str, ...] = ()  # resident in host memory only
    loading: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    device_budget_bytes: int = 0
    host_budget_bytes: int = 0
    device_used_bytes: int = 0
    host_used_bytes: int = 0
    loads: tuple[Load, ...] = ()
    evictions: tuple[tuple[str, str], ...] = ()  # (action, model id)
    load_failures: int = 0
    # By residency key ``model@version`` (the control agent rolls versions by these).
    resident_versions: tuple[str, ...] = ()  # on the device or in host memory
    pinned_versions: tuple[str, ...] = ()
    loading_versions: tuple[str, ...] = ()
    # Memory (a runtime in a process of its own; 0 otherwise): RSS now and at start-up
    # (before any model); the overhead (start-up + the models' framework imports); the
    # budget RSS is held to (device + host budgets); the line (overhead + budget x
    # (1 + rss_margin)); whether it is over and refusing loads; loads refused since the
    # last ask; the CUDA allocator's reserved / allocated bytes.
    rss_bytes: int = 0
    rss_startup_bytes: int = 0
    rss_overhead_bytes: int = 0
    memory_budget_bytes: int = 0
    rss_limit_bytes: int = 0
    over_memory_budget: bool = False
    loads_refused: int = 0
    device_reserved_bytes: int = 0
    device_allocated_bytes: int = 0


@dataclass(frozen=True)
class RuntimeHealth:
    pid: int
    loading: tuple[str, ...] = ()
    load_ages_s: Mapping[str, float] = field(default_factory=dict)
    frameworks: tuple[str, ...] = ()  # top-level modules its models imported


@dataclass(frozen=True)
class DeviceBudget:
    """A runtime's device budget and what holds it, read without draining ``stats``.

    A worker's shared runtimes split one budget (``worker/pool.py``): it moves their
    budgets with ``set_budgets`` and reads them back with the ``budget`` op.
    """

    budget_bytes: int
    used_bytes: int
    reserved_bytes: int  # loads in flight
    pinned_bytes: int
    device: tuple[str, ...] = ()  # model ids resident on the device


class Runtime(Protocol):
    """A runtime as the coordinator sees it: a place to run tasks and hold models."""

    @property
    def closed(self) -> bool: ...

    def crash_record(self) -> Flight | None:
        """Once closed: what ran on its threads when it died (predicts and loads: its
        flight record, ``ipc/flight.py``); None when it keeps none or it is open."""
        ...

    async def infer(self, call: InferCall, timeout_s: float | None = None) -> EncodedReply:
        """Run one task; the reply (errors of the task included) comes back encoded."""
        ...

    async def load(self, model_id: str, version: str, pinned: bool = False,
                   timeout_s: float | None = None) -> None:
        """Make the model resident (a no-op when it is)."""
        ...

    async def unload(self, model_id: str, timeout_s: float | None = None,
                     version: str | None = None) -> bool:
        """Drop every resident version of the model (or only ``version``); False when
        none was resident."""
        ...

    async def unpin(self, model_id: str, version: str, timeout_s: float | None = None) -> None:
        """Make a pinned version evictable again (a no-op when it is not pinned)."""
        ...

    async def stats(self, timeout_s: float | None = None) -> RuntimeStats: ...

    async def set_budgets(self, device_budget_bytes: int, host_budget_bytes: int | None = None,
                          timeout_s: float | None = None) -> None:
        """Change the runtime's budgets now (``host_budget_bytes`` None: unchanged); what
        no longer fits is evicted before this returns, and its memory line moves too."""
        ...

    async def budget(self, timeout_s: float | None = None) -> DeviceBudget:
        """The device budget and what holds it (read without draining ``stats``)."""
        ...

    async def health(self, timeout_s: float | None = None) -> RuntimeHealth:
        """Answered from the runtime's event loop, even while a long load runs."""
        ...

    async def cancel(self, request_id: str, timeout_s: float | None = None) -> bool:
        """Its caller hung up: drop the task before predict, stopping a fetch or
        preprocess under way (True when it was running there; one arriving after is
        dropped unrun too)."""
        ...

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Ask the runtime to stop serving (its process then exits)."""
        ...

    async def close(self) -> None:
        """Drop our end; calls in flight raise ``RuntimeCrashed``."""
        ...


class Started(Protocol):
    """A runtime a ``Launcher`` started, and the way to watch it end."""

    @property
    def runtime(self) -> Runtime: ...

    @property
    def pid(self) -> int: ...

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        ...

    async def wait_exit(self) -> int | None: ...

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM for a process)."""
        ...

    async def kill(self) -> None:
        """End it now (SIGKILL for a process) and drop our end; returns once it is gone."""
        ...


class Launcher(Protocol):
    """Starts runtimes: processes in production, in this process for tests."""

    async def launch(self, name: str, python: str, env: Mapping[str, str],
                     standby: bool = False) -> Started:
        """Start one and return once it answers ``health``; ``RuntimeCrashed`` if it cannot.

        ``standby``: a spare, started ahead of a crash (it says so in its logs).
        """
        ...

    def preload(self, modules: Sequence[str]) -> None:
        """What the runtimes' models import (``RuntimeHealth.frameworks``), for a launcher
        that imports it once ahead of its launches (a zygote); others ignore it."""
        ...


# --- on the wire: the socket carries these as msgpack maps ----------------------------

def stats_to_wire(stats: RuntimeStats) -> dict[str, Any]:
    return asdict(stats)


def stats_from_wire(data: Mapping[str, Any]) -> RuntimeStats:
    return RuntimeStats(
        device=tuple(data["device"]), host=tuple(data["host"]),
        loading=tuple(data["loading"]), pinned=tuple(data["pinned"]),
        device_budget_bytes=data["device_budget_bytes"],
        host_budget_bytes=data["host_budget_bytes"],
        device_used_bytes=data["device_used_bytes"], host_used_bytes=data["host_used_bytes"],
        loads=tuple(Load(**load) for load in data["loads"]),
        evictions=tuple((action, model) for action, model in data["evictions"]),
        load_failures=data["load_failures"],
        resident_versions=tuple(data.get("resident_versions", ())),
        pinned_versions=tuple(data.get("pinned_versions", ())),
        loading_versions=tuple(data.get("loading_versions", ())),
        **{name: data[name] for name in _MEMORY_FIELDS if name in data})


_MEMORY_FIELDS = ("rss_bytes", "rss_startup_bytes", "rss_overhead_bytes", "memory_budget_bytes",
                  "rss_limit_bytes",
                  "over_memory_budget", "loads_refused", "device_reserved_bytes",
                  "device_allocated_bytes")


def health_to_wire(health: RuntimeHealth) -> dict[str, Any]:
    return {**asdict(health), "load_ages_s": dict(health.load_ages_s)}


def health_from_wire(data: Mapping[str, Any]) -> RuntimeHealth:
    return RuntimeHealth(pid=data["pid"], loading=tuple(data["loading"]),
                         load_ages_s=dict(data["load_ages_s"]),
                         frameworks=tuple(data["frameworks"]))


def budget_to_wire(budget: DeviceBudget) -> dict[str, Any]:
    return asdict(budget)


def budget_from_wire(data: Mapping[str, Any]) -> DeviceBudget:
    return DeviceBudget(data["budget_bytes"], data["used_bytes"], data["reserved_bytes"],
                        data["pinned_bytes"], tuple(data["device"]))
