"""The model repository extension of the Open Inference Protocol, plus pin and unpin.

    POST /v2/repository/index                  the models: name, version, state, reason
    POST /v2/repository/models/{m}/load        warm it; answered once warm (or why not)
    POST /v2/repository/models/{m}/unload      drop it everywhere; its requests refused
    POST /v2/repository/models/{m}/pin         preload on every worker, never evict
    POST /v2/repository/models/{m}/unpin       evictable again

``load`` takes optional ``parameters`` in its JSON body (or the same names as query
parameters): ``workers`` (warm on that many workers, default 1), ``version`` (warm that
version and put it on the unversioned route once warm), ``pinned`` (pin it too), and
``config`` (tritonclient's ``load_model(config=...)``: its max_batch_size, dynamic
batching and version policy override the model's model.toml settings on every gateway
and worker until the next load, which without a config takes it back to model.toml's;
any other field must say what model.toml says, and each that does not is named in a
400: see oip/model_config.py).
With ``file:<path>`` parameters (tritonclient's ``load_model(files=...)``: each file's
bytes in base64; ``file:model.toml``, or Triton's ``file:1/model.toml`` naming version
1) the load first publishes that package as a new version (``gateway/publish.py``,
``publishing/``; ``signature`` carries its signature where ``publish.secret`` is set),
then warms it; a ``config`` is then checked against, and overrides, the package's
model.toml. A load's errors begin "failed to load '<model>'", as Triton's do.
``index`` takes ``ready`` (only models that take requests), and ``limit`` and
``cursor`` (gateway/pages.py), in its JSON body or as query parameters. Without
either it answers the protocol's JSON array, bounded to the first ``DEFAULT_LIMIT``
models (the header ``X-Next-Cursor`` carries the cursor of the rest); with either, an
object ``{"models": [...], "next_cursor": ...}``.
Errors are ``{"error": "..."}`` with the error's own status (gateway/http.py's ``v2_error``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from modelfleet.errors import (
    ModelfleetError,
    PackageNotPolled,
    PackageRejected,
    PayloadTooLarge,
    RequestRejected,
)
from modelfleet.gateway.control_plane import Outcome
from modelfleet.gateway.http import load_failed, v2_error
from modelfleet.gateway.pages import decode_cursor, encode_cursor, page_limit
from modelfleet.gateway.publish import FILE_PREFIX, files_of
from modelfleet.gateway.service import GatewayService
from modelfleet.oip.model_config import config_override, parse_config
from modelfleet.publishing.package import Package, split_version
from modelfleet.publishing.publisher import Publisher, counted
from modelfleet.repository import Catalog
from modelfleet.repository.catalog import CatalogEntry
from modelfleet.repository.manifest import Manifest
from modelfleet.tenancy.access import CALLER

MAX_CONTROL_BODY_BYTES = 64 * 1024


def control_router(service: GatewayService, publisher: Publisher | None = None) -> APIRouter:
    router = APIRouter(prefix="/v2/repository", tags=["model control"])
    plane = service.control
    # A load with files carries the package in base64 (4 bytes for 3) in its JSON body.
    load_body_bytes = MAX_CONTROL_BODY_BYTES if publisher is None else \
        publisher.limits.max_bytes * 4 // 3 + MAX_CONTROL_BODY_BYTES

    @router.post("/index")
    async def index(request: Request) -> Response:
        try:
            body = await _json_body(request)
            for name in ("ready", "limit", "cursor"):
                if name in request.query_params:
                    body.setdefault(name, request.query_params[name])
            ready = body.get("ready", False)
            if isinstance(ready, str) and ready.lower() in ("true", "false"):
                ready = ready.lower() == "true"
            if not isinstance(ready, bool):
                raise RequestRejected(f"'ready' must be true or false, got {ready!r}")
            paged = "limit" in body or "cursor" in body
            rows, last = plane.index(ready_only=ready, after=decode_cursor(body.get("cursor")),
                                     limit=page_limit(body.get("limit")))
            cursor = encode_cursor(last)
            if paged:
                return JSONResponse({"models": rows, "next_cursor": cursor})
            return JSONResponse(rows, headers={"X-Next-Cursor": cursor} if cursor else {})
        except ModelfleetError as exc:
            return v2_error(exc)

    @router.post("/models/{model}/load")
    async def load(model: str, request: Request) -> Response:
        try:
            params = await _parameters(request, load_body_bytes)
            outcome, pinned = await run_load(service, publisher, model, params)
            return JSONResponse({"name": outcome.model_id, "version": outcome.version,
                                 "warm_on": list(outcome.workers), "pinned": pinned})
        except ModelfleetError as exc:
            return v2_error(load_failed(model, exc))

    @router.post("/models/{model}/unload")
    async def unload(model: str, request: Request) -> Response:
        try:
            await _parameters(request)  # validated; unload_dependents has no meaning here
            outcome = await plane.unload(model)
            return JSONResponse({"name": outcome.model_id,
                                 "unloaded_on": list(outcome.workers)})
        except ModelfleetError as exc:
            return v2_error(exc)

    @router.post("/models/{model}/pin")
    async def pin(model: str) -> Response:
        return await _pin(model, True)

    @router.post("/models/{model}/unpin")
    async def unpin(model: str) -> Response:
        return await _pin(model, False)

    async def _pin(model: str, pinned: bool) -> Response:
        try:
            outcome = await plane.pin(model, pinned)
            return JSONResponse({"name": outcome.model_id, "version": outcome.version,
                                 "pinned": pinned, "workers": list(outcome.workers)})
        except ModelfleetError as exc:
            return v2_error(exc)

    return router


LOAD_PARAMETERS = frozenset({"workers", "version", "pinned", "config"})
FILE_PARAMETERS = frozenset({"signature"})  # with file:<path> parameters


def check_load_parameters(params: dict[str, Any]) -> None:
    """``RequestRejected`` naming what a load does not take (HTTP's and gRPC's alike)."""
    allowed = LOAD_PARAMETERS | FILE_PARAMETERS
    unknown = sorted(n for n in set(params) - allowed if not n.startswith(FILE_PREFIX))
    if unknown:
        raise RequestRejected(
            f"load takes the parameters workers, version, pinned, config, and "
            f"file:<path> with signature to publish a package; not {', '.join(unknown)}")


async def run_load(service: GatewayService, publisher: Publisher | None, model: str,
                   params: dict[str, Any]) -> tuple[Outcome, bool]:
    """A load with ``params`` (HTTP's and gRPC's): its files published first, then warm
    under its config; (the outcome, pinned). A package its files cannot make fails as
    Triton's load does, "failed to poll from model repository: <why>" (``polled``)."""
    check_load_parameters(params)
    workers = positive_int(params.get("workers", 1), "workers")
    version = params.get("version")
    if version is not None and not isinstance(version, str | int):
        raise RequestRejected(f"'version' must be a string, got {version!r}")
    pinned = flag(params.get("pinned", False), "pinned")
    files = any(n.startswith(FILE_PREFIX) for n in params)
    if "signature" in params and not files:
        raise RequestRejected("'signature' signs the package of file:<path> "
                              "parameters, and this load has none")
    if files and publisher is None:
        raise RequestRejected("this gateway publishes no packages")
    if files and publisher is not None:
        with counted():
            try:
                package = files_of(params, publisher.limits)
            except PackageRejected as exc:
                raise polled(exc) from None
            assert package is not None  # it has files
            version = await _publish(publisher, model, package, params)
    # After a publish, the catalog holds the package: its model.toml is the one a
    # config overrides.
    config = load_config(service.catalog, model, params["config"]) \
        if "config" in params else ""
    outcome = await service.control.load(model, None if version is None else str(version),
                                         workers, config)
    if pinned:
        await service.control.pin(model, True)
    return outcome, pinned


def polled(error: PackageRejected) -> PackageRejected:
    """``error`` of a load's files, as Triton words one that makes no package."""
    if type(error) is not PackageRejected:  # too large, signature: their own status
        return error
    return PackageNotPolled(f"failed to poll from model repository: {error.message}")


async def _publish(publisher: Publisher, model: str, package: Package,
                   params: dict[str, Any]) -> str | None:
    """Publish a load's files; the version to warm (None: the newest, as a plain load)."""
    folder, package = split_version(package)
    asked = params.get("version")
    if folder is not None and asked is not None and str(asked) != folder:
        raise RequestRejected(f"the files are in version folder '{folder}/' but the load "
                              f"asks for version '{asked}'")
    named = folder if folder is not None else None if asked is None else str(asked)
    signature = params.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise RequestRejected(f"'signature' must be a string, got {signature!r}")

    def accept(manifest: Manifest) -> None:
        """A config that does not map onto the package's model.toml is refused before
        anything is written."""
        if "config" in params:
            given = parse_config(params["config"])
            if "name" in given and given["name"] != model:
                raise RequestRejected(
                    f"the config names model {given['name']!r}, not {model!r}")
            config_override(given, CatalogEntry((manifest,)))

    published = await publisher.publish(model, package, CALLER.get(), named, signature,
                                        accept)
    return published.version if named is not None else None


def load_config(catalog: Catalog, model: str, config: object) -> str:
    """The control order a load's ``config`` gives (``ConfigOverride.to_json``: "" for a
    config that overrides nothing); ``RequestRejected`` naming what does not map."""
    given = parse_config(config)
    if "name" in given and given["name"] != model:
        raise RequestRejected(f"the config names model {given['name']!r}, not {model!r}")
    return config_override(given, catalog.original(model)).to_json()


async def _json_body(request: Request, limit: int = MAX_CONTROL_BODY_BYTES) -> dict[str, Any]:
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"a control request body is at most {limit} bytes"
                                  + ("" if limit == MAX_CONTROL_BODY_BYTES else
                                     " (publish.max_package_bytes, in base64)"))
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRejected(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestRejected("the body must be a JSON object")
    return body


async def _parameters(request: Request, limit: int = MAX_CONTROL_BODY_BYTES
                      ) -> dict[str, Any]:
    """The body's ``parameters`` object, with query parameters of the same names added."""
    params = (await _json_body(request, limit)).get("parameters", {})
    if not isinstance(params, dict):
        raise RequestRejected("'parameters' must be a JSON object")
    for name in ("workers", "version", "pinned", "signature"):  # tritonclient: query_params
        if name in request.query_params:
            params.setdefault(name, request.query_params[name])
    return params


def positive_int(value: object, name: str) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestRejected(f"'{name}' must be a whole number of at least 1, got {value!r}")
    return value


def flag(value: object, name: str) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise RequestRejected(f"'{name}' must be true or false, got {value!r}")
    return value
