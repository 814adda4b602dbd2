"""The model configuration extension: a ``model.toml`` in the shape Triton's clients read.

``GET /v2/models/{m}/config`` answers what ``model_config`` builds (the JSON form of
Triton's ``ModelConfig``): tensors with ``TYPE_*`` data types, ``max_batch_size`` and
``dims`` without the batch dimension when every tensor's first dimension is -1 (a
batch of any size, as modelfleet's manifests declare it), ``dynamic_batching`` when the
model batches requests together, ``label_filename`` for outputs with labels, and a
version policy of ``all`` (every version in the repository can be addressed).

``config_conflicts`` checks a ``config`` that a ``load`` request carries (tritonclient's
``load_model(config=...)``): modelfleet takes a model's configuration from its
``model.toml`` in the repository, so a config is accepted where it says what the
manifest says, and each field that differs is named in the refusal.
"""

from __future__ import annotations

import json
from typing import Any

from modelfleet.errors import RequestRejected
from modelfleet.repository.manifest import Manifest, TensorSpec

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


def model_config(manifest: Manifest) -> dict[str, Any]:
    """Triton's JSON model configuration for ``manifest``."""
    with_batch = batched(manifest)
    config: dict[str, Any] = {
        "name": manifest.name,
        "platform": "",
        "backend": BACKEND,
        "version_policy": {"all": {}},
        "max_batch_size": manifest.batching.max_batch_size if with_batch else 0,
        "input": [{**_tensor(s, with_batch), "format": "FORMAT_NONE"}
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


def config_conflicts(given: dict[str, Any], manifest: Manifest) -> list[str]:
    """The fields of ``given`` that say something else than the manifest does."""
    ours = model_config(manifest)
    ours_lax = {**ours, "platform": given.get("platform", ""),
                "backend": given.get("backend", BACKEND)}  # what runs it is ours to say
    return sorted(key for key, value in given.items()
                  if key not in ours_lax or not _same(value, ours_lax[key]))
