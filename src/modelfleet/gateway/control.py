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
400: see oip/model_config.py). A load's errors begin "failed to load '<model>'", as
Triton's do.
``index`` takes ``ready`` (only models that take requests), and ``limit`` and
``cursor`` (gateway/pages.py), in its JSON body or as query parameters. Without
either it answers the protocol's JSON array, bounded to the first ``DEFAULT_LIMIT``
models (the header ``X-Next-Cursor`` carries the cursor of the rest); with either, an
object ``{"models": [...], "next_cursor": ...}``.
Errors are ``{"error": "..."}`` with the status the error's code maps to.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from modelfleet.errors import ModelfleetError, RequestRejected
from modelfleet.gateway.http import load_failed, v2_error
from modelfleet.gateway.pages import decode_cursor, encode_cursor, page_limit
from modelfleet.gateway.service import GatewayService
from modelfleet.oip.model_config import config_override, parse_config
from modelfleet.repository import Catalog

MAX_CONTROL_BODY_BYTES = 64 * 1024


def control_router(service: GatewayService) -> APIRouter:
    router = APIRouter(prefix="/v2/repository", tags=["model control"])
    plane = service.control

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
            params = await _parameters(request)
            check_load_parameters(params)
            config = load_config(service.catalog, model, params["config"]) \
                if "config" in params else ""
            workers = positive_int(params.get("workers", 1), "workers")
            version = params.get("version")
            if version is not None and not isinstance(version, str | int):
                raise RequestRejected(f"'version' must be a string, got {version!r}")
            pinned = flag(params.get("pinned", False), "pinned")
            outcome = await plane.load(model, None if version is None else str(version),
                                       workers, config)
            if pinned:
                await plane.pin(model, True)
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


def check_load_parameters(params: dict[str, Any]) -> None:
    """``RequestRejected`` naming what a load does not take (tritonclient's ``files=``
    among them: not how models are made here)."""
    unknown = sorted(set(params) - LOAD_PARAMETERS)
    if not unknown:
        return
    files = [name for name in unknown if name.startswith("file:")]
    named = [name for name in unknown if name not in files]
    if files:
        named.append(f"files ({len(files)} 'file:' parameter(s))")
    raise RequestRejected(
        f"load takes the parameters workers, version, pinned and config; not "
        f"{', '.join(named)}: a load does not take model files (a model's package is "
        "published to the repository, and its settings are given with config)")


def load_config(catalog: Catalog, model: str, config: object) -> str:
    """The control order a load's ``config`` gives (``ConfigOverride.to_json``: "" for a
    config that overrides nothing); ``RequestRejected`` naming what does not map."""
    given = parse_config(config)
    if "name" in given and given["name"] != model:
        raise RequestRejected(f"the config names model {given['name']!r}, not {model!r}")
    return config_override(given, catalog.original(model)).to_json()


async def _json_body(request: Request) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_CONTROL_BODY_BYTES:
            raise RequestRejected(f"a control request body is at most "
                                  f"{MAX_CONTROL_BODY_BYTES} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRejected(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestRejected("the body must be a JSON object")
    return body


async def _parameters(request: Request) -> dict[str, Any]:
    """The body's ``parameters`` object, with query parameters of the same names added."""
    params = (await _json_body(request)).get("parameters", {})
    if not isinstance(params, dict):
        raise RequestRejected("'parameters' must be a JSON object")
    for name in ("workers", "version", "pinned"):
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
