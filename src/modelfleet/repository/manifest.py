"""The ``model.toml`` schema, and its validation with errors that name file and field.

Example::

    name = "digits"                   # model id: [a-z0-9][a-z0-9_.-]*
    version = "1"
    entrypoint = "handler:Digits"     # module:Class inside the package folder
    accepts = ["image/png", "image/jpeg"]
    device = "cpu"                    # "cpu" or "cuda"
    memory_estimate_mb = 4            # used only before the first load measures it
    timeout_s = 30                    # default deadline (else the gateway's default)
    tenant = "examples"
    plan = "free"                     # free | pro | enterprise

    [batching]
    max_batch_size = 8
    max_delay_ms = 2

    [isolation]
    requirements = ["numpy==1.26.4"]  # non-empty: own runtime process and venv
    memory_limit_mb = 2048

    [fanout]
    max_workers = 2                   # how many workers may consume this queue
    pinned = false                    # preloaded on every worker, never evicted
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from modelfleet.errors import ManifestError

MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,127}$")
CONTENT_TYPES = ("image/png", "image/jpeg", "application/json", "text/plain",
                 "application/octet-stream")

Plan = Literal["free", "pro", "enterprise"]


class _Strict(BaseModel):
    # strict: `pinned = "yes"` or `timeout_s = true` is an error, not silently coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Batching(_Strict):
    max_batch_size: int = Field(default=1, ge=1, le=1024)
    max_delay_ms: float = Field(default=0.0, ge=0, le=1000)


class Isolation(_Strict):
    requirements: tuple[str, ...] = Field(default=(), strict=False)  # TOML arrays are lists
    memory_limit_mb: int | None = Field(default=None, ge=16)


class Fanout(_Strict):
    max_workers: int = Field(default=2, ge=1)
    pinned: bool = False


class Manifest(_Strict):
    name: str
    version: str = "1"
    entrypoint: str
    accepts: tuple[str, ...] = Field(default=("application/json",), strict=False)
    device: Literal["cpu", "cuda"] = "cpu"
    memory_estimate_mb: float = Field(default=64, gt=0)
    timeout_s: float | None = Field(default=None, gt=0)
    tenant: str = "default"
    plan: Plan = "free"
    description: str = ""
    batching: Batching = Batching()
    isolation: Isolation = Isolation()
    fanout: Fanout = Fanout()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not MODEL_ID.match(value):
            raise ValueError("must match [a-z0-9][a-z0-9_.-]* (lower case, at most 128 chars)")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", value):
            raise ValueError("must be letters, digits, '.', '_' or '-'")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
            raise ValueError("must be 'module:Class', e.g. 'handler:MyModel'")
        return value

    @field_validator("accepts")
    @classmethod
    def _accepts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [v for v in value if v not in CONTENT_TYPES]
        if unknown or not value:
            raise ValueError(f"content types must be a non-empty subset of {list(CONTENT_TYPES)}")
        return value

    @property
    def model_id(self) -> str:
        return self.name

    @property
    def memory_estimate_bytes(self) -> int:
        return int(self.memory_estimate_mb * 1024 * 1024)

    @property
    def memory_limit_bytes(self) -> int | None:
        limit = self.isolation.memory_limit_mb
        return None if limit is None else limit * 1024 * 1024

    @property
    def isolated(self) -> bool:
        """Own requirements or an own memory limit: the model gets a runtime process of its own."""
        return bool(self.isolation.requirements) or self.isolation.memory_limit_mb is not None


def parse_manifest(text: str, path: str) -> Manifest:
    """Validate the TOML text of a manifest; ``path`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(path, "(toml)", f"not valid TOML: {exc}") from exc
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        problem = first["msg"].removeprefix("Value error, ")
        if where == "version" and first["type"] == "string_type":
            problem += ' (quote it: version = "1")'
        if first["type"] == "extra_forbidden":
            problem = "unknown field (check the spelling against the manifest reference)"
        raise ManifestError(path, where, problem) from exc


def load_manifest(path: Path) -> Manifest:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(str(path), "(file)", f"cannot read: {exc.strerror}") from exc
    return parse_manifest(text, str(path))
