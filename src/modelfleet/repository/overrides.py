"""An operator's override of a model's ``model.toml`` settings, given with a load.

``POST /v2/repository/models/{m}/load`` with a ``config`` parameter (tritonclient's
``load_model(config=...)``; ``oip.model_config.config_override`` reads it) may set,
for every version of the model:

- ``max_batch_size`` and ``max_delay_ms``: ``[batching]``, what the runtime's batcher
  groups and waits for;
- ``versions``: which versions are served (Triton's version policy): all of them
  (``all``, model.toml's way), the newest N (``latest``), or the ones named
  (``specific``); requests for any other version are refused as not found.

Fields left out keep what model.toml says. The override travels as the JSON text
``to_json`` writes (a control order, ``control.state``: "" is no override), so that
every gateway and worker applies the same one (``Catalog.configure``), and it is kept
with the other orders in the deployment's database.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelfleet.repository.manifest import Batching, Manifest

PolicyKind = Literal["all", "latest", "specific"]


@dataclass(frozen=True)
class VersionPolicy:
    kind: PolicyKind = "all"
    latest: int = 0  # kind "latest": how many of the newest versions
    specific: tuple[str, ...] = ()  # kind "specific": the versions served

    def served(self, versions: Sequence[str]) -> tuple[str, ...]:
        """Which of ``versions`` (oldest first) this policy serves, oldest first."""
        if self.kind == "latest":
            return tuple(versions[-self.latest:])
        if self.kind == "specific":
            return tuple(v for v in versions if v in self.specific)
        return tuple(versions)

    def wire(self) -> dict[str, Any]:
        if self.kind == "latest":
            return {"latest": self.latest}
        if self.kind == "specific":
            return {"specific": list(self.specific)}
        return {"all": True}

    def describe(self) -> str:
        if self.kind == "latest":
            return f"the newest {self.latest}"
        if self.kind == "specific":
            return f"only {', '.join(self.specific)}"
        return "all"


ALL_VERSIONS = VersionPolicy()


@dataclass(frozen=True)
class ConfigOverride:
    max_batch_size: int | None = None
    max_delay_ms: float | None = None
    versions: VersionPolicy | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.max_batch_size, self.max_delay_ms,
                                           self.versions))

    @property
    def policy(self) -> VersionPolicy:
        return self.versions or ALL_VERSIONS

    def batching(self) -> dict[str, int | float]:
        """The ``[batching]`` fields it sets (what a worker tells its runtime)."""
        found: dict[str, int | float] = {}
        if self.max_batch_size is not None:
            found["max_batch_size"] = self.max_batch_size
        if self.max_delay_ms is not None:
            found["max_delay_ms"] = self.max_delay_ms
        return found

    def apply(self, manifest: Manifest) -> Manifest:
        """``manifest`` with this override's ``[batching]`` fields."""
        batching = self.batching()
        if not batching:
            return manifest
        return manifest.model_copy(update={"batching": merged_batching(manifest.batching,
                                                                        batching)})

    def to_json(self) -> str:
        """The control order's value: "" when it overrides nothing."""
        if not self:
            return ""
        wire: dict[str, Any] = {**self.batching()}
        if self.versions is not None:
            wire["versions"] = self.versions.wire()
        return json.dumps(wire, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ConfigOverride | None:
        """The override a control order carries; None for "" and for text that is not
        one (a newer release's: the model then serves as model.toml says)."""
        if not text:
            return None
        try:
            wire = json.loads(text)
            size, delay, versions = (wire.get("max_batch_size"), wire.get("max_delay_ms"),
                                     wire.get("versions"))
            policy = None
            if isinstance(versions, dict) and "latest" in versions:
                policy = VersionPolicy("latest", latest=int(versions["latest"]))
            elif isinstance(versions, dict) and "specific" in versions:
                policy = VersionPolicy("specific",
                                       specific=tuple(str(v) for v in versions["specific"]))
            elif isinstance(versions, dict) and "all" in versions:
                policy = ALL_VERSIONS
            if policy is not None and policy.kind == "latest" and policy.latest < 1:
                return None
            override = cls(None if size is None else int(size),
                           None if delay is None else float(delay), policy)
            if override.batching():
                Batching.model_validate(override.batching(), strict=False)
        except (ValueError, TypeError, AttributeError):
            return None
        return override or None


def merged_batching(batching: Batching, fields: dict[str, int | float]) -> Batching:
    """``batching`` with ``fields`` set (each within model.toml's bounds)."""
    return Batching.model_validate({**batching.model_dump(), **fields}, strict=False)
