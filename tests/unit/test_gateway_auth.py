"""The auth layer's route classes and access rule (pure parts; end to end in
tests/e2e/test_tenants.py)."""

from __future__ import annotations

import pytest

from modelfleet.gateway.auth import Route, classify
from modelfleet.tenancy.access import Principal
from modelfleet.tenancy.plans import BUILTIN
from modelfleet.tenancy.store import Tenant


@pytest.mark.parametrize(("method", "path", "route"), [
    ("GET", "/livez", Route("open")),
    ("GET", "/readyz", Route("open")),
    ("GET", "/v2/health/ready", Route("open")),
    ("GET", "/v2/health/live/", Route("open")),
    ("GET", "/v1/payloads/abc", Route("open")),
    ("GET", "/metrics", Route("open")),
    ("GET", "/v1/fleet", Route("admin")),
    ("GET", "/v1/fleet/summary", Route("admin")),
    ("GET", "/dashboard", Route("admin")),
    ("GET", "/dashboard/app.js", Route("admin")),
    ("POST", "/v2/repository/index", Route("index")),
    ("POST", "/v2/repository/models/x/load", Route("control", "x", load=True)),
    ("POST", "/v2/repository/models/x/pin", Route("control", "x")),
    ("POST", "/v2/repository/other", Route("operator")),
    ("GET", "/v2/models/stats", Route("catalog")),
    ("GET", "/v2/models/iris/stats", Route("model", "iris")),
    ("GET", "/v2/models/iris/config", Route("model", "iris")),
    ("GET", "/v1/models", Route("catalog")),
    ("GET", "/v1/models/", Route("catalog")),
    ("GET", "/v1/models/digits", Route("model", "digits")),
    ("POST", "/v1/models/digits/infer", Route("model", "digits", infer=True)),
    ("PUT", "/v1/models/digits/package", Route("publish", "digits")),
    ("GET", "/v1/models/digits/package", Route("model", "digits")),
    ("PUT", "/v2/models/digits/package", Route("model", "digits")),
    ("POST", "/v1/models/digits/versions/2/infer", Route("model", "digits", infer=True)),
    ("GET", "/v2/models/iris/ready", Route("model", "iris")),
    ("POST", "/v2/models/iris/versions/1/infer", Route("model", "iris", infer=True)),
    ("GET", "/v2", Route("key")),
    ("GET", "/openapi.json", Route("key")),
    ("GET", "/anything/else", Route("key")),
])
def test_every_path_has_a_class(method: str, path: str, route: Route) -> None:
    assert classify(method, path) == route


def test_metrics_need_the_operator_role_when_configured() -> None:
    assert classify("GET", "/metrics", protect_metrics=True) == Route("operator")


def principal(role: str, grants: frozenset[str] = frozenset()) -> Principal:
    return Principal("0123456789ab", role, Tenant("acme", "free", grants),  # type: ignore[arg-type]
                     BUILTIN["free"])


def test_callers_reach_their_tenants_models_and_granted_ones_only() -> None:
    caller = principal("caller", frozenset({"shared"}))
    assert caller.may_use("mine", "acme")
    assert caller.may_use("shared", "other")
    assert not caller.may_use("theirs", "other")
    assert not caller.may_use("missing", None)
    assert not principal("operator").may_use("theirs", "other")
    assert principal("admin").may_use("theirs", "other")
    assert principal("operator").has_role("operator") and not caller.has_role("operator")
    assert principal("admin").has_role("operator")


def test_an_operator_controls_its_own_tenants_models_only() -> None:
    operator = principal("operator", frozenset({"shared"}))
    assert operator.may_control("acme")  # its own tenant's
    assert not operator.may_control("other")  # not another tenant's...
    assert not operator.may_control(None)  # ...nor a model that does not exist
    assert not principal("caller").may_control("acme")  # a caller controls nothing
    assert principal("admin").may_control("other") and principal("admin").may_control(None)


@pytest.mark.parametrize(("mode", "host", "embedded", "on"), [
    ("auto", "127.0.0.1", True, False),   # serve on loopback: open, with a warning
    ("auto", "::1", True, False),
    ("auto", "0.0.0.0", True, True),      # serve reachable from elsewhere: keys
    ("auto", "127.0.0.1", False, True),   # a gateway: always keys unless told
    ("off", "0.0.0.0", False, False),
    ("on", "127.0.0.1", True, True),
])
def test_when_auth_is_on(mode: str, host: str, embedded: bool, on: bool) -> None:
    from modelfleet.gateway.auth import auth_enabled
    from modelfleet.settings import Settings

    base = Settings()
    settings = base.model_copy(update={
        "tenancy": base.tenancy.model_copy(update={"auth": mode}),
        "gateway": base.gateway.model_copy(update={"host": host})})
    assert auth_enabled(settings, embedded) is on
