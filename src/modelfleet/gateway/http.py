"""The one place where modelfleet errors become HTTP statuses, and the two error shapes.

/v1 answers ``{"error": {"code": ..., "message": ...}}``; every path under /v2 (the Open
Inference Protocol's) answers ``{"error": "<message>"}``, the protocol's shape, which
tritonclient and the KServe SDK read as the exception's message. ``error_body`` picks
the shape by path, so routing errors (404, 405), the auth layer's refusals and bugs of
ours are in the caller's dialect too.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from modelfleet.errors import ModelfleetError, NoCapacity

STATUS_BY_CODE: dict[str, int] = {
    "bad_request": 400,
    "invalid_package": 400,
    "package_not_polled": 400,
    "forbidden": 403,
    "bad_signature": 403,
    "version_exists": 409,
    "package_too_large": 413,
    "payload_fetch_forbidden": 400,
    "model_not_found": 404,
    "request_timeout": 408,
    "payload_too_large": 413,
    "unsupported_content_type": 415,
    "invalid_input": 422,
    "client_disconnected": 499,
    "model_error": 500,
    "model_load_failed": 500,
    "runtime_crashed": 500,
    "config_error": 500,
    "internal_error": 500,
    "payload_unavailable": 502,
    "no_capacity": 503,
    "model_unavailable": 503,
    "broker_unavailable": 503,
    "repository_unavailable": 503,
    "broker_error": 503,
    "shutting_down": 503,
    "too_many_connections": 503,
    "order_store_unavailable": 503,
    "deadline_exceeded": 504,
    "model_too_large": 507,
}


# Answers after which the connection is closed: the caller was too slow to be kept, or
# should come back through another gateway.
CLOSE_AFTER = frozenset({"request_timeout", "shutting_down"})


def error_response(error: ModelfleetError) -> JSONResponse:
    status = STATUS_BY_CODE.get(error.code, 500)
    headers = {}
    if status == 503:
        retry = error.retry_after_s if isinstance(error, NoCapacity) else 1
        headers["Retry-After"] = str(retry)
    if error.code in CLOSE_AFTER:
        headers["Connection"] = "close"
    return JSONResponse({"error": {"code": error.code, "message": error.message}},
                        status_code=status, headers=headers)


def is_v2(path: str) -> bool:
    """Is ``path`` under the Open Inference Protocol's /v2 prefix?"""
    return path == "/v2" or path.startswith("/v2/")


def error_body(status: int, code: str, message: str, path: str = "") -> JSONResponse:
    """An error answer in the dialect of ``path``: /v2's ``{"error": message}``, else /v1's."""
    if is_v2(path):
        return JSONResponse({"error": message}, status_code=status)
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


# Requests the caller must change: the spec's 400 (/v1 tells some of them apart).
BAD_REQUEST_CODES = frozenset({"bad_request", "invalid_input", "unsupported_content_type",
                               "payload_fetch_forbidden"})


def v2_error(error: ModelfleetError) -> JSONResponse:
    """A modelfleet error as the v2 API answers it."""
    status = 400 if error.code in BAD_REQUEST_CODES else STATUS_BY_CODE.get(error.code, 500)
    headers = {}
    if status == 503:
        headers["Retry-After"] = str(getattr(error, "retry_after_s", 1))
    if error.code in CLOSE_AFTER:
        headers["Connection"] = "close"
    return JSONResponse({"error": v2_message(error)}, status_code=status, headers=headers)


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
    # Its own class, so its status too (a code error_from_code does not know, such as
    # tenancy's "forbidden", would become a 500).
    message = f"failed to load '{model}': {error.message}"
    renamed = type(error).__new__(type(error))
    renamed.__dict__.update(error.__dict__)
    Exception.__init__(renamed, message)
    renamed.message = message
    return renamed
