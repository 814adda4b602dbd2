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

    [[inputs]]                        # optional tensor signature: served on /v2 (OIP)
    name = "features"
    datatype = "FP32"                 # BOOL, UINT8..64, INT8..64, FP16/32/64, BYTES
    shape = [-1, 4]                   # -1: a dimension of any size
    # format = "NCHW"                 # an image input's layout, NCHW or NHWC (3 dims past
    #                                 # the batch): what image clients read in its config

    [[outputs]]
    name = "probabilities"
    datatype = "FP32"
    shape = [-1, 3]
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from modelfleet.errors import ManifestError
from modelfleet.oip import OIP_CONTENT_TYPE, Datatype
from modelfleet.repository import plain_toml

MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,127}$")
VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
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


class TensorSpec(_Strict):
    """One input or output of a model's tensor signature (Open Inference Protocol v2)."""

    name: str = Field(min_length=1, max_length=256)
    datatype: Datatype
    shape: tuple[int, ...] = Field(strict=False)  # TOML arrays are lists; -1: any size
    # An output's class labels, one per line, in a file of the package (the classification
    # extension answers "value:index:label"); read by ``load_manifest``, beside the package.
    labels: str | None = Field(default=None, min_length=1, max_length=256)
    label_names: tuple[str, ...] = Field(default=(), strict=False, exclude=True)
    # An image input's layout (Triton's ModelInput.format), shown by the model
    # configuration extension; inputs only.
    format: Literal["NONE", "NHWC", "NCHW"] = "NONE"

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError("labels names a file inside the package folder")
        return value

    @field_validator("shape")
    @classmethod
    def _shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < -1 for d in value):
            raise ValueError("dimensions are sizes >= 0, or -1 for any size")
        return value


def _unique_names(specs: tuple[TensorSpec, ...], what: str) -> None:
    names = [spec.name for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{what} name(s) {twice} declared more than once")


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
    inputs: tuple[TensorSpec, ...] = Field(default=(), strict=False)
    outputs: tuple[TensorSpec, ...] = Field(default=(), strict=False)

    @model_validator(mode="before")
    @classmethod
    def _signature_accepts_v2(cls, data: object) -> object:
        # A model with a tensor signature also takes v2 requests (the gateway's check of
        # the content type is the same for both APIs).
        if isinstance(data, dict) and (data.get("inputs") or data.get("outputs")):
            accepts = data.get("accepts", ["application/json"])
            if isinstance(accepts, list) and OIP_CONTENT_TYPE not in accepts:
                data = {**data, "accepts": [*accepts, OIP_CONTENT_TYPE]}
        return data

    @model_validator(mode="after")
    def _signature(self) -> Manifest:
        if self.inputs or self.outputs:  # most manifests declare no tensors
            self._check_tensors()
        if OIP_CONTENT_TYPE in self.accepts and not self.inputs:
            raise ValueError(f"accepts lists {OIP_CONTENT_TYPE} but the model declares no "
                             "tensor signature ([[inputs]] and [[outputs]])")
        return self

    def _check_tensors(self) -> None:
        if bool(self.inputs) != bool(self.outputs):
            raise ValueError("a tensor signature declares both [[inputs]] and [[outputs]] "
                             "(at least one of each)")
        _unique_names(self.inputs, "input")
        _unique_names(self.outputs, "output")
        for spec in self.outputs:
            if spec.format != "NONE":
                raise ValueError(f"output '{spec.name}': format is an input's image layout")
        for spec in self.inputs:
            image_dims = spec.shape[1:] if spec.shape[:1] == (-1,) else spec.shape
            if spec.format != "NONE" and len(image_dims) != 3:
                raise ValueError(f"input '{spec.name}': format {spec.format} is the layout "
                                 f"of 3 dimensions (past a -1 batch), not {list(spec.shape)}")

    @property
    def has_signature(self) -> bool:
        """Declares its tensors: served on the Open Inference Protocol v2 routes."""
        return bool(self.inputs)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not MODEL_ID.match(value):
            raise ValueError("must match [a-z0-9][a-z0-9_.-]* (lower case, at most 128 chars)")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not VERSION.match(value):
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
        unknown = [v for v in value if v not in (*CONTENT_TYPES, OIP_CONTENT_TYPE)]
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
    # Most manifests are plain TOML, read several times faster than tomllib reads them;
    # tomllib reads the rest, and reports what is not TOML.
    data = plain_toml.loads(text)
    if data is None:
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
    """The manifest of a package on disk, with its outputs' label files read."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(str(path), "(file)", f"cannot read: {exc.strerror}") from exc
    return with_label_names(parse_manifest(text, str(path)), path.parent)


def with_label_names(manifest: Manifest, package_dir: Path) -> Manifest:
    """``manifest`` with each output's ``labels`` file read into its ``label_names``."""
    if not any(spec.labels for spec in manifest.outputs):
        return manifest
    outputs = []
    for index, spec in enumerate(manifest.outputs):
        if spec.labels is None:
            outputs.append(spec)
            continue
        where = package_dir / spec.labels
        try:
            lines = where.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(str(package_dir / "model.toml"), f"outputs.{index}.labels",
                                f"cannot read {spec.labels}: {exc}") from exc
        outputs.append(spec.model_copy(update={"label_names": tuple(
            line.strip() for line in lines)}))
    return manifest.model_copy(update={"outputs": tuple(outputs)})
