"""The model configuration extension: a ``model.toml`` in the shape Triton's clients read.

``GET /v2/models/{m}/config`` answers what ``model_config`` builds (the JSON form of
Triton's ``ModelConfig``): tensors with ``TYPE_*`` data types, ``max_batch_size`` and
``dims`` without the batch dimension when every tensor's first dimension is -1 (a
batch of any size, as modelfleet's manifests declare it), ``dynamic_batching`` when the
model batches requests together, ``label_filename`` for outputs with labels, and the
version policy (``all``: every version in the repository can be addressed, unless a
load's config said otherwise).

``config_override`` reads the ``config`` that a ``load`` request carries (tritonclient's
``load_model(config=...)``, a JSON object or its text) into the override of the
model's model.toml settings it maps onto (``repository.overrides``):

- ``max_batch_size`` (a number or its text, as protobuf's JSON writes 64-bit
  integers): ``[batching] max_batch_size``, for a model whose tensors lead with a
  batch dimension (a model without one takes only 0);
- ``dynamic_batching.max_queue_delay_microseconds``: ``[batching] max_delay_ms``;
  ``dynamic_batching.preferred_batch_size``: only ``[max_batch_size]`` (the batcher
  fills batches up to max_batch_size; it honours no other preferred size);
- ``version_policy``: ``all``, ``latest`` (``num_versions``) or ``specific``
  (``versions``, each in the repository).

Every other field must say what the model says (``name``, the tensors, ``platform``
"" and ``backend`` "" or modelfleet's, empty ``parameters``): each that does not, or
that modelfleet does not know, is named in the ``RequestRejected``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from modelfleet.errors import RequestRejected
from modelfleet.repository.catalog import CatalogEntry
from modelfleet.repository.manifest import Manifest, TensorSpec
from modelfleet.repository.overrides import (
    ALL_VERSIONS,
    ConfigOverride,
    VersionPolicy,
    merged_batching,
)

TRITON_TYPES = {"BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
                "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
                "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
                "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING"}
BACKEND = "modelfleet_python"


def batched(manifest: Manifest) -> bool:
    """Does every tensor lead with a batch dimension of any size (-1)?"""
    specs = (*manifest.inputs, *manifest.outputs)
    return bool(specs) and all(spec.shape[:1] == (-1,) for spec in specs)


def _tensor(spec: TensorSpec, drop_batch: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if drop_batch else spec.shape)
    tensor: dict[str, Any] = {"name": spec.name,
                              "data_type": TRITON_TYPES.get(spec.datatype, spec.datatype),
                              "dims": dims}
    if spec.labels:
        tensor["label_filename"] = spec.labels
    return tensor


def policy_config(policy: VersionPolicy) -> dict[str, Any]:
    if policy.kind == "latest":
        return {"latest": {"num_versions": policy.latest}}
    if policy.kind == "specific":
        return {"specific": {"versions": [int(v) if v.isdigit() else v
                                          for v in policy.specific]}}
    return {"all": {}}


def model_config(manifest: Manifest, policy: VersionPolicy = ALL_VERSIONS) -> dict[str, Any]:
    """Triton's JSON model configuration for ``manifest``, served under ``policy``."""
    with_batch = batched(manifest)
    config: dict[str, Any] = {
        "name": manifest.name,
        "platform": "",
        "backend": BACKEND,
        "version_policy": policy_config(policy),
        "max_batch_size": manifest.batching.max_batch_size if with_batch else 0,
        "input": [{**_tensor(s, with_batch), "format": f"FORMAT_{s.format}"}
                  for s in manifest.inputs],
        "output": [_tensor(s, with_batch) for s in manifest.outputs],
        "parameters": {},
    }
    if manifest.batching.max_batch_size > 1:
        config["dynamic_batching"] = {
            "preferred_batch_size": [manifest.batching.max_batch_size],
            "max_queue_delay_microseconds": int(manifest.batching.max_delay_ms * 1000)}
    return config


def parse_config(value: object) -> dict[str, Any]:
    """A load request's ``config`` parameter: a JSON object, or its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestRejected(f"the 'config' parameter is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise RequestRejected("the 'config' parameter must be a JSON object (a model "
                              "configuration)")
    return value


def _same(given: Any, ours: Any) -> bool:
    """Equal, where a given object may leave out fields that ours has (Triton's defaults)."""
    if isinstance(given, dict) and isinstance(ours, dict):
        return all(k in ours and _same(v, ours[k]) for k, v in given.items()
                   if v not in ({}, [], "", None, 0) or k in ours)
    if isinstance(given, list) and isinstance(ours, list):
        return len(given) == len(ours) and all(_same(g, o) for g, o in zip(given, ours,
                                                                          strict=True))
    if isinstance(given, str) and isinstance(ours, int) and given.lstrip("-").isdigit():
        return int(given) == ours  # protobuf's JSON writes 64-bit integers as strings
    return bool(given == ours)


MAPPED = frozenset({"max_batch_size", "dynamic_batching", "version_policy"})


def config_override(given: dict[str, Any], entry: CatalogEntry) -> ConfigOverride:
    """The override of ``entry``'s model.toml settings that a load's ``config`` gives;
    ``RequestRejected`` naming every field that does not map onto them."""
    manifest = entry.manifest
    problems: list[str] = []
    ours = model_config(manifest)
    blank = {"backend": BACKEND} if given.get("backend") == "" else {}  # Triton's default
    differ = sorted(key for key, value in {**given, **blank}.items() if key not in MAPPED
                    and (key not in ours or not _same(value, ours[key])))
    if differ:
        problems.append(f"{', '.join(differ)} differ(s) from model '{manifest.name}' "
                        f"version {manifest.version}'s model.toml, or are not settings "
                        "modelfleet has")
    size = _max_batch_size(given, manifest, problems)
    delay = _dynamic_batching(given, manifest, size, problems)
    policy = _version_policy(given.get("version_policy"), entry, problems)
    # What model.toml (its newest version) says already is no override.
    override = ConfigOverride(None if size == manifest.batching.max_batch_size else size,
                              None if delay == manifest.batching.max_delay_ms else delay,
                              policy)
    if override.batching() and not problems:
        try:
            merged_batching(manifest.batching, override.batching())
        except ValidationError as exc:
            first = exc.errors()[0]
            problems.append(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    if problems:
        raise RequestRejected(
            f"the config does not map onto model '{manifest.name}''s model.toml: "
            f"{'; '.join(problems)}. A load's config may set max_batch_size, "
            "dynamic_batching (max_queue_delay_microseconds, preferred_batch_size "
            "[max_batch_size]) and version_policy; the rest is the model's model.toml in "
            f"the repository (GET /v2/models/{manifest.name}/config shows it)")
    return override


def _whole(value: object) -> int | None:
    """A whole number, or its text (protobuf's JSON writes 64-bit integers as strings)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _max_batch_size(given: dict[str, Any], manifest: Manifest, problems: list[str]
                    ) -> int | None:
    if "max_batch_size" not in given:
        return None
    size = _whole(given["max_batch_size"])
    if size is None:
        problems.append(f"max_batch_size must be a whole number, got "
                        f"{given['max_batch_size']!r}")
        return None
    if not batched(manifest):
        if size != 0:
            problems.append(f"max_batch_size {size}: the tensors of model "
                            f"'{manifest.name}' have no batch dimension (-1 first) in its "
                            "model.toml, so its max_batch_size is 0")
        return None
    if size < 1:
        problems.append(f"max_batch_size {size}: the tensors of model '{manifest.name}' "
                        "lead with a batch dimension in its model.toml; give 1 or more")
        return None
    return size


def _dynamic_batching(given: dict[str, Any], manifest: Manifest, size: int | None,
                      problems: list[str]) -> float | None:
    batching = given.get("dynamic_batching")
    if batching is None:
        return None
    if not isinstance(batching, dict):
        problems.append("dynamic_batching must be an object")
        return None
    if not batched(manifest):
        problems.append(f"dynamic_batching: model '{manifest.name}' has no batch dimension")
        return None
    unknown = sorted(set(batching) - {"preferred_batch_size", "max_queue_delay_microseconds"})
    unknown = [k for k in unknown if batching[k] not in ({}, [], "", None, 0, False)]
    if unknown:
        problems.append(f"dynamic_batching.{', dynamic_batching.'.join(unknown)}: not "
                        "settings of modelfleet's batcher")
    largest = size if size is not None else manifest.batching.max_batch_size
    preferred = batching.get("preferred_batch_size", [])
    sizes = [_whole(p) for p in preferred] if isinstance(preferred, list) else [None]
    if sizes and sizes != [largest]:
        problems.append(f"dynamic_batching.preferred_batch_size {preferred!r}: the batcher "
                        f"fills batches up to max_batch_size, so the one preferred size it "
                        f"honours is [{largest}]")
    if "max_queue_delay_microseconds" not in batching:
        return None
    micros = _whole(batching["max_queue_delay_microseconds"])
    if micros is None or micros < 0:
        problems.append("dynamic_batching.max_queue_delay_microseconds must be a whole "
                        f"number of at least 0, got {batching['max_queue_delay_microseconds']!r}")
        return None
    return micros / 1000


def _version_policy(value: object, entry: CatalogEntry, problems: list[str]
                    ) -> VersionPolicy | None:
    if value is None:
        return None
    kinds = sorted(value) if isinstance(value, dict) else []
    if len(kinds) != 1 or kinds[0] not in ("all", "latest", "specific") \
            or not isinstance(value, dict) or not isinstance(value[kinds[0]], dict):
        problems.append(f"version_policy {value!r}: one of {{\"all\": {{}}}}, "
                        "{\"latest\": {\"num_versions\": N}}, "
                        "{\"specific\": {\"versions\": [...]}}")
        return None
    kind, body = kinds[0], value[kinds[0]]
    if kind == "all":
        return None  # model.toml's way: every version
    if kind == "latest":
        count = _whole(body.get("num_versions"))
        if count is None or count < 1:
            problems.append("version_policy.latest.num_versions must be 1 or more, got "
                            f"{body.get('num_versions')!r}")
            return None
        return VersionPolicy("latest", latest=count)
    versions = body.get("versions")
    if not isinstance(versions, list) or not versions:
        problems.append("version_policy.specific.versions must name one version or more")
        return None
    have = [m.version for m in entry.versions]
    if any(_whole(v) is None for v in versions):
        problems.append(f"version_policy.specific.versions {versions!r}: versions are whole "
                        "numbers in Triton's configuration (a version named otherwise is "
                        "addressed by its name in the URL, and served under policy all)")
        return None
    named = [str(_whole(v)) for v in versions]
    missing = [v for v in named if v not in have]
    if missing:
        problems.append(f"version_policy.specific.versions {', '.join(missing)}: not in "
                        f"the repository (versions: {', '.join(have)})")
        return None
    return VersionPolicy("specific", specific=tuple(v for v in have if v in named))
