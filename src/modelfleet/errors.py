"""The exception tree of modelfleet.

Every error that crosses a boundary (HTTP, broker, runtime IPC) is one of these,
translated once where the foreign error first appears (``raise X(...) from exc``).
Each carries a stable ``code``: the wire form that travels in a Reply and that
the gateway maps to an HTTP status. HTTP status codes live only in the gateway.

    ModelfleetError                     code
    ├── ConfigError                     config_error
    │   └── ManifestError               invalid_manifest
    ├── ModelNotFound                   model_not_found
    ├── ModelUnavailable                model_unavailable  (unloaded by an operator)
    ├── RequestRejected                 (client's fault: 4xx family)
    │   ├── PayloadTooLarge             payload_too_large
    │   ├── UnsupportedContentType      unsupported_content_type
    │   ├── InvalidInput                invalid_input      (raised by model handlers)
    │   ├── PayloadFetchForbidden       payload_fetch_forbidden
    │   └── PackageRejected             invalid_package    (a published model package)
    │       ├── PackageTooLarge         package_too_large
    │       ├── SignatureRejected       bad_signature
    │       ├── VersionExists           version_exists
    │       └── PackageNotPolled        package_not_polled (a load's files make no package)
    ├── RepositoryUnavailable           repository_unavailable (a write to the store failed)
    ├── DeadlineExceeded                deadline_exceeded
    ├── NoCapacity                      no_capacity
    ├── ModelLoadFailed                 model_load_failed
    ├── ModelTooLarge                   model_too_large
    ├── ModelFailed                     model_error        (handler raised unexpectedly)
    ├── RuntimeCrashed                  runtime_crashed
    ├── PayloadUnavailable              payload_unavailable
    ├── ClientGone                      client_disconnected
    └── BrokerError                     broker_error
        └── BrokerUnavailable           broker_unavailable
"""

from __future__ import annotations


class ModelfleetError(Exception):
    """Root of every modelfleet error. ``str(err)`` says what was wrong and what to do."""

    code = "internal_error"

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


class ModelUnavailable(ModelfleetError):
    """An operator unloaded the model (the control API); it serves again once loaded."""

    code = "model_unavailable"


class RequestRejected(ModelfleetError):
    """The caller sent something we will not process; retrying it unchanged won't help."""

    code = "bad_request"


class PayloadTooLarge(RequestRejected):
    code = "payload_too_large"


class UnsupportedContentType(RequestRejected):
    code = "unsupported_content_type"


class InvalidInput(RequestRejected):
    """Raise from a handler's preprocess/predict/postprocess to reject the input (HTTP 422)."""

    code = "invalid_input"


class PayloadFetchForbidden(RequestRejected):
    code = "payload_fetch_forbidden"


class PackageRejected(RequestRejected):
    """A model package sent to be published is not one (the message says what is wrong)."""

    code = "invalid_package"


class PackageTooLarge(PackageRejected):
    """More bytes or files than ``publish.max_package_bytes`` / ``max_package_files``."""

    code = "package_too_large"


class SignatureRejected(PackageRejected):
    """A package's signature is missing or does not match ``publish.secret``."""

    code = "bad_signature"


class VersionExists(PackageRejected):
    """That version of the model is in the repository already: versions never change."""

    code = "version_exists"


class PackageNotPolled(PackageRejected):
    """A load's ``file:`` parameters make no package (a path no file can have...).
    Worded as Triton words it, "failed to poll from model repository: ...": HTTP answers
    it 400 like any package refused, gRPC INTERNAL, as Triton does (its
    simple_grpc_model_control example checks both)."""

    code = "package_not_polled"


class RepositoryUnavailable(ModelfleetError):
    """The model repository could not be written (a publish); nothing was published."""

    code = "repository_unavailable"


class DeadlineExceeded(ModelfleetError):
    code = "deadline_exceeded"


class NoCapacity(ModelfleetError):
    code = "no_capacity"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadFailed(ModelfleetError):
    code = "model_load_failed"


class ModelTooLarge(ModelfleetError):
    code = "model_too_large"


class ModelFailed(ModelfleetError):
    code = "model_error"


class RuntimeCrashed(ModelfleetError):
    code = "runtime_crashed"


class PayloadUnavailable(ModelfleetError):
    code = "payload_unavailable"


class ClientGone(ModelfleetError):
    """The caller hung up before its answer was ready."""

    code = "client_disconnected"


class BrokerError(ModelfleetError):
    code = "broker_error"


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
    if isinstance(err, NoCapacity):
        err.retry_after_s = 1
    return err
