"""Publishing a model version over HTTP (``publishing/publisher.py`` does the work).

    PUT /v1/models/{m}/package     body: a tar, tar.gz or zip of the package's folder
                                   (model.toml at its top, or in its one top folder);
                                   ?version=V (else the manifest's, else the next);
                                   header X-Modelfleet-Signature: the HMAC-SHA256 hex
                                   where publish.secret is set
                                   201 {"name", "version", "sha256", "size_bytes",
                                        "files", "servable"}

The protocol's way, ``POST /v2/repository/models/{m}/load`` with ``file:<path>``
parameters (base64, as tritonclient.http's ``load_model(files=...)`` sends them; gRPC's
RepositoryModelLoad carries the bytes), is read here too (``files_of``) and answered by
``gateway/control.py``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from modelfleet.errors import ModelfleetError, PackageRejected
from modelfleet.gateway.body import read_body
from modelfleet.gateway.http import v1_error
from modelfleet.publishing.package import Limits, Package, from_archive, from_files
from modelfleet.publishing.publisher import Publisher, counted
from modelfleet.tenancy.access import CALLER

SIGNATURE_HEADER = "x-modelfleet-signature"
FILE_PREFIX = "file:"


def publish_router(publisher: Publisher) -> APIRouter:
    router = APIRouter(tags=["publishing"])

    @router.put("/v1/models/{model}/package", status_code=201)
    async def put_package(model: str, request: Request) -> Response:
        try:
            # The archive is at most as large as what it unpacks to, give or take its
            # headers: the unpacked limit bounds the body too.
            limit = publisher.limits.max_bytes + 1024 * 1024
            with counted():
                package = from_archive(await read_body(request, limit), publisher.limits)
                published = await publisher.publish(
                    model, package, CALLER.get(),
                    request.query_params.get("version") or None,
                    request.headers.get(SIGNATURE_HEADER))
            return JSONResponse(published.wire(), status_code=201)
        except ModelfleetError as exc:
            return v1_error(exc)

    return router


def files_of(params: Mapping[str, Any], limits: Limits) -> Package | None:
    """The package in a load's ``file:<path>`` parameters; None if none. A value is the
    file's bytes (gRPC's ``bytes_param``) or their base64 (HTTP's JSON)."""
    named = {key[len(FILE_PREFIX):]: value for key, value in params.items()
             if key.startswith(FILE_PREFIX)}
    if not named:
        return None
    files: dict[str, bytes] = {}
    for path, value in named.items():
        if isinstance(value, bytes):
            files[path] = value
            continue
        if not isinstance(value, str):
            raise PackageRejected(f"parameter 'file:{path}' must be the file's bytes in "
                                  "base64 (a string)")
        try:
            files[path] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PackageRejected(f"parameter 'file:{path}' is not base64: {exc}") from exc
    return from_files(files, limits)
