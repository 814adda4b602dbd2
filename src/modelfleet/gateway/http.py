"""Errors as the gateway answers them: one renderer per dialect, and nothing else decides.

Each modelfleet error carries its HTTP ``status``, its ``retry_after_s`` (Retry-After)
where it has one, and any headers of its own (``modelfleet.errors``). A dialect decides
only how that status and the message are written:

- /v1 (``v1_error``): ``{"error": {"code": ..., "message": ...}}`` with the error's
  status (``v1_status``);
- /v2, the Open Inference Protocol's (``v2_error``): ``{"error": "<message>"}``, which
  tritonclient and the KServe SDK read as the exception's message, with the spec's 400
  for every request the caller must change (/v1 tells 415 and 422 apart: ``v2_status``);
- gRPC: the status code of the /v2 status (``grpc_status`` in
  ``gateway/grpc_api/servicer.py``).

``error_response`` picks the dialect by path, so routing errors (404, 405), the auth
layer's refusals, the edge's raw answers (``raw_error``) and bugs of ours are in the
caller's dialect too. Errors the gateway itself answers with (no route, a payload URL
refused) are modelfleet errors like the others (below).
"""

from __future__ import annotations

import http
from collections.abc import Mapping

from fastapi.responses import JSONResponse

from modelfleet.errors import ModelfleetError, RequestRejected


class NoRoute(ModelfleetError):
    """No route has this path (the framework's 404)."""

    code = "not_found"
    status = 404


class MethodNotAllowed(ModelfleetError):
    """The path has a route, not for this method (the framework's 405, with Allow)."""

    code = "method_not_allowed"
    status = 405


class HTTPError(ModelfleetError):
    """Any other status the framework raised (``status`` is the instance's own)."""

    code = "http_error"


class PayloadURLRefused(ModelfleetError):
    """A payload URL that is unsigned, tampered with or expired."""

    code = "forbidden"
    status = 403


class PayloadGone(ModelfleetError):
    """A payload already fetched for its answer, or expired."""

    code = "payload_gone"
    status = 404


class HeaderFieldsTooLarge(RequestRejected):
    """More header fields or bytes than ``gateway.max_headers`` / ``max_header_bytes``."""

    code = "request_header_fields_too_large"
    status = 431


class TooManyConnections(ModelfleetError):
    """This gateway holds ``gateway.max_connections`` open already."""

    code = "too_many_connections"
    status = 503
    retry_after_s = 1


def with_status(error: ModelfleetError, status: int,
                headers: Mapping[str, str] | None = None) -> ModelfleetError:
    """``error`` with a status (and headers) of its own, for a status given from outside
    (the framework's ``HTTPException``)."""
    error.status = status
    if headers:
        error.http_headers = {**error.http_headers, **headers}
    return error


def v1_status(error: ModelfleetError) -> int:
    """The status /v1 answers ``error`` with: its own."""
    return error.status


def v2_status(error: ModelfleetError) -> int:
    """The status /v2 (and so gRPC) answers ``error`` with: the spec's 400 for a request
    the caller must change, where /v1 tells an unsupported type (415) and an invalid
    input (422) apart; else the error's own."""
    return 400 if error.status in (415, 422) else error.status


def _headers(error: ModelfleetError) -> dict[str, str]:
    headers = dict(error.http_headers)
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if error.closes_connection:
        headers["Connection"] = "close"
    return headers


def v1_error(error: ModelfleetError) -> JSONResponse:
    """A modelfleet error as /v1 answers it."""
    return JSONResponse({"error": {"code": error.code, "message": error.message}},
                        status_code=v1_status(error), headers=_headers(error))


def v2_error(error: ModelfleetError) -> JSONResponse:
    """A modelfleet error as /v2 answers it."""
    return JSONResponse({"error": v2_message(error)}, status_code=v2_status(error),
                        headers=_headers(error))


def is_v2(path: str) -> bool:
    """Is ``path`` under the Open Inference Protocol's /v2 prefix?"""
    return path == "/v2" or path.startswith("/v2/")


def error_response(error: ModelfleetError, path: str = "") -> JSONResponse:
    """``error`` in the dialect of ``path``: /v2's under /v2, else /v1's."""
    return v2_error(error) if is_v2(path) else v1_error(error)


def closing_error(error: ModelfleetError, path: str = "") -> JSONResponse:
    """``error_response``, and the connection closed after it (the edge's answers)."""
    response = error_response(error, path)
    response.headers["connection"] = "close"
    return response


def raw_error(error: ModelfleetError, path: str = "") -> bytes:
    """``closing_error`` as a whole HTTP/1.1 answer, for the edge to write to a socket
    itself (before or beside the ASGI app)."""
    response = closing_error(error, path)
    status = response.status_code
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:  # 499, ours
        phrase = ""
    head = [f"HTTP/1.1 {status} {phrase}".rstrip()]
    head += [f"{name.decode('latin-1')}: {value.decode('latin-1')}"
             for name, value in response.raw_headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body


def v2_message(error: ModelfleetError) -> str:
    """The message /v2 (and gRPC) gives: the protocol's own words where clients check them
    (Triton's examples look for "Request for unknown model"), then ours."""
    if error.code == "model_not_found" and not error.message.startswith("failed to load"):
        return f"Request for unknown model: {error.message}"  # (a load's: Triton's words)
    return error.message


def load_failed(model: str, error: ModelfleetError) -> ModelfleetError:
    """``error`` of a load, its message begun as Triton's are ("failed to load '<m>'":
    Triton's clients and examples look for it), the same for a model that is missing
    and one of another tenant (whose name must not leak)."""
    if error.message.startswith("failed to load"):
        return error
    message = f"failed to load '{model}': {error.message}"
    worded = type(error).__new__(type(error))  # its class: its code, status, Retry-After
    worded.__dict__.update(error.__dict__)
    Exception.__init__(worded, message)
    worded.message = message
    return worded
