"""The exception tree of modelfleet.

Every error that crosses a boundary (HTTP, broker, runtime IPC) is one of these,
translated once where the foreign error first appears (``raise X(...) from exc``).
Each carries a stable ``code``: the wire form that travels in a Reply. Each also
carries its HTTP ``status`` and, where the caller should come back, ``retry_after_s``
(the Retry-After header, in seconds; None: no header): the gateway's renderers
(``modelfleet.gateway.http``, one per dialect: /v1, /v2, gRPC) read them and nothing
else decides a status. Errors defined elsewhere (tenancy, the gateway's own, the
stores') carry theirs the same way.

    ModelfleetError                     code                        status
    ├── ConfigError                     config_error                500
    │   └── ManifestError               invalid_manifest            500
    ├── ModelNotFound                   model_not_found             404
    ├── ModelUnavailable                model_unavailable           503 (unloaded by an operator)
    ├── RequestRejected                 bad_request                 400 (client's fault: 4xx)
    │   ├── PayloadTooLarge             payload_too_large           413
    │   ├── UnsupportedContentType      unsupported_content_type    415
    │   ├── InvalidInput                invalid_input               422 (raised by handlers)
    │   ├── PayloadFetchForbidden       payload_fetch_forbidden     400
    │   └── PackageRejected             invalid_package             400 (a published package)
    │       ├── PackageTooLarge         package_too_large           413
    │       ├── SignatureRejected       bad_signature               403
    │       ├── VersionExists           version_exists              409
    │       └── PackageNotPolled        package_not_polled          400 (a load's files: no package)
    ├── RepositoryUnavailable           repository_unavailable      503 (a store write failed)
    ├── DeadlineExceeded                deadline_exceeded           504
    ├── NoCapacity                      no_capacity                 503
    ├── ModelLoadFailed                 model_load_failed           500
    ├── ModelTooLarge                   model_too_large             507
    ├── ModelFailed                     model_error                 500 (handler raised)
    ├── RuntimeCrashed                  runtime_crashed             500
    ├── PayloadUnavailable              payload_unavailable         502
    ├── ClientGone                      client_disconnected         499
    └── BrokerError                     broker_error                503
        └── BrokerUnavailable           broker_unavailable          503

Every 503 has a Retry-After (``tests/unit/test_error_statuses.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class ModelfleetError(Exception):
    """Root of every modelfleet error. ``str(err)`` says what was wrong and what to do."""

    code = "internal_error"
    status: int = 500  # the HTTP status (an instance may carry its own: gateway/http.py)
    retry_after_s: int | None = None  # seconds for Retry-After; None: no header
    # More headers every answer of this error carries (Unauthenticated's challenge).
    http_headers: Mapping[str, str] = {}
    closes_connection: ClassVar[bool] = False  # the caller should come back on a new one

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(ModelfleetError):
    code = "config_error"


class ManifestError(ConfigError):
    """A model.toml that does not validate; names the file and the field."""

    code = "invalid_manifest"

    def __init__(self, path: str, field: str, problem: str) -> None:
        super().__init__(f"{path}: field '{field}': {problem}")
        self.path = path
        self.field = field
        self.problem = problem


class ModelNotFound(ModelfleetError):
    code = "model_not_found"
    status = 404


class ModelUnavailable(ModelfleetError):
    """An operator unloaded the model (the control API); it serves again once loaded."""

    code = "model_unavailable"
    status = 503
    retry_after_s = 1


class RequestRejected(ModelfleetError):
    """The caller sent something we will not process; retrying it unchanged won't help."""

    code = "bad_request"
    status = 400


class PayloadTooLarge(RequestRejected):
    code = "payload_too_large"
    status = 413


class UnsupportedContentType(RequestRejected):
    code = "unsupported_content_type"
    status = 415


class InvalidInput(RequestRejected):
    """Raise from a handler's preprocess/predict/postprocess to reject the input (HTTP 422)."""

    code = "invalid_input"
    status = 422


class PayloadFetchForbidden(RequestRejected):
    code = "payload_fetch_forbidden"


class PackageRejected(RequestRejected):
    """A model package sent to be published is not one (the message says what is wrong)."""

    code = "invalid_package"


class PackageTooLarge(PackageRejected):
    """More bytes or files than ``publish.max_package_bytes`` / ``max_package_files``."""

    code = "package_too_large"
    status = 413


class SignatureRejected(PackageRejected):
    """A package's signature is missing or does not match ``publish.secret``."""

    code = "bad_signature"
    status = 403


class VersionExists(PackageRejected):
    """That version of the model is in the repository already: versions never change."""

    code = "version_exists"
    status = 409


class PackageNotPolled(PackageRejected):
    """A load's ``file:`` parameters make no package (a path no file can have...).
    Worded as Triton words it, "failed to poll from model repository: ...": HTTP answers
    it 400 like any package refused, gRPC INTERNAL, as Triton does (its
    simple_grpc_model_control example checks both)."""

    code = "package_not_polled"


class RepositoryUnavailable(ModelfleetError):
    """The model repository could not be written (a publish); nothing was published."""

    code = "repository_unavailable"
    status = 503
    retry_after_s = 1


class DeadlineExceeded(ModelfleetError):
    code = "deadline_exceeded"
    status = 504


class NoCapacity(ModelfleetError):
    code = "no_capacity"
    status = 503
    retry_after_s = 1

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadFailed(ModelfleetError):
    code = "model_load_failed"


class ModelTooLarge(ModelfleetError):
    code = "model_too_large"
    status = 507


class ModelFailed(ModelfleetError):
    code = "model_error"


class RuntimeCrashed(ModelfleetError):
    code = "runtime_crashed"


class PayloadUnavailable(ModelfleetError):
    code = "payload_unavailable"
    status = 502


class ClientGone(ModelfleetError):
    """The caller hung up before its answer was ready."""

    code = "client_disconnected"
    status = 499


class BrokerError(ModelfleetError):
    code = "broker_error"
    status = 503
    retry_after_s = 1


class BrokerUnavailable(BrokerError):
    code = "broker_unavailable"


_BY_CODE: dict[str, type[ModelfleetError]] = {}


def _index(cls: type[ModelfleetError]) -> None:
    _BY_CODE.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _index(sub)


_index(ModelfleetError)


def error_from_code(code: str, message: str) -> ModelfleetError:
    """Rebuild an error that travelled as (code, message), e.g. in a Reply."""
    cls = _BY_CODE.get(code, ModelfleetError)
    if cls is ManifestError:
        return ConfigError(message)
    err = cls.__new__(cls)
    ModelfleetError.__init__(err, message)
    return err
