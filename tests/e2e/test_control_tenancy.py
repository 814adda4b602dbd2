"""Tenancy on the control plane: an operator key acts on its own tenant's models only, on
every control route and over gRPC too; another tenant's model answers as a missing one
(404, its name not confirmed); an administrator acts fleet-wide."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import grpc
import httpx
import pytest

from modelfleet.gateway.grpc_api import inference_pb2 as pb
from tests.procs import EXAMPLES, free_port, provision_key, serve, write_package

ACME_MANIFEST = """\
    name = "acme-echo"
    entrypoint = "handler:Echo"
    tenant = "acme"
    accepts = ["text/plain"]
    """
ACME_HANDLER = """\
    from modelfleet import Model

    class Echo(Model):
        def predict(self, batch):
            return [{"echo": bytes(b).decode()} for b in batch]
    """
CONTROL = [("load", {}), ("unload", {}), ("pin", None), ("unpin", None)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One ``serve`` with auth on: examples' iris and acme's acme-echo, keys of each role."""
    tmp = tmp_path_factory.mktemp("control-tenancy")
    repo = tmp / "repo"
    shutil.copytree(EXAMPLES / "iris", repo / "iris")
    write_package(repo, "acme-echo", ACME_MANIFEST, ACME_HANDLER)
    db = tmp / "tenants.sqlite3"
    grpc_port = free_port()
    proc, base = serve(tmp, repo=repo, env={
        "MODELFLEET_TENANCY__AUTH": "on", "MODELFLEET_TENANCY__DB": str(db),
        "MODELFLEET_DLQ_DB": str(db), "MODELFLEET_GATEWAY__GRPC_PORT": str(grpc_port)})
    try:
        yield {"base": base, "grpc": f"127.0.0.1:{grpc_port}",
               "examples_operator": provision_key(str(db), "operator", "examples"),
               "acme_operator": provision_key(str(db), "operator", "acme"),
               "acme_caller": provision_key(str(db), "caller", "acme"),
               "admin": provision_key(str(db), "admin", "ops")}
    finally:
        proc.stop()


def control(fleet: dict[str, str], key: str, model: str, action: str) -> httpx.Response:
    return httpx.post(f"{fleet['base']}/v2/repository/models/{model}/{action}", timeout=120,
                      headers={"Authorization": f"Bearer {fleet[key]}"}, json={})


def acme_echo(fleet: dict[str, str]) -> int:
    return httpx.post(f"{fleet['base']}/v1/models/acme-echo/infer", content=b"hi",
                      timeout=60, headers={"Authorization": f"Bearer {fleet['acme_caller']}",
                                           "content-type": "text/plain"}).status_code


@pytest.mark.parametrize(("action", "_"), CONTROL)
def test_an_operator_gets_404_on_another_tenants_model(fleet: dict[str, str], action: str,
                                                       _: object) -> None:
    foreign = control(fleet, "examples_operator", "acme-echo", action)
    missing = control(fleet, "examples_operator", "no-such-model", action)
    assert foreign.status_code == missing.status_code == 404, foreign.text
    # The same words as for a model that does not exist: the name is not confirmed.
    assert foreign.json()["error"].replace("acme-echo", "X") == \
        missing.json()["error"].replace("no-such-model", "X")
    assert acme_echo(fleet) == 200  # acme's caller is still served


def test_an_operator_controls_its_own_tenants_models(fleet: dict[str, str]) -> None:
    assert control(fleet, "acme_operator", "acme-echo", "load").status_code == 200
    assert control(fleet, "acme_operator", "acme-echo", "unload").status_code == 200
    assert acme_echo(fleet) == 503  # unloaded by its own operator: refused
    assert control(fleet, "acme_operator", "acme-echo", "load").status_code == 200
    assert acme_echo(fleet) == 200
    assert control(fleet, "acme_operator", "iris", "unload").status_code == 404


def test_the_index_lists_an_operators_own_tenants_models_only(fleet: dict[str, str]) -> None:
    def names(key: str) -> set[str]:
        answer = httpx.post(f"{fleet['base']}/v2/repository/index", json={},
                            headers={"Authorization": f"Bearer {fleet[key]}"}, timeout=30)
        assert answer.status_code == 200, answer.text
        return {row["name"] for row in answer.json()}

    assert names("examples_operator") == {"iris"}
    assert names("acme_operator") == {"acme-echo"}
    assert names("admin") == {"iris", "acme-echo"}


def test_an_administrator_acts_fleet_wide(fleet: dict[str, str]) -> None:
    assert control(fleet, "admin", "acme-echo", "pin").status_code == 200
    assert control(fleet, "admin", "acme-echo", "unpin").status_code == 200
    fleet_view = httpx.get(f"{fleet['base']}/v1/fleet", timeout=30,
                           headers={"Authorization": f"Bearer {fleet['admin']}"})
    assert fleet_view.status_code == 200
    for key in ("acme_operator", "acme_caller"):  # the fleet shows every tenant's models
        refused = httpx.get(f"{fleet['base']}/v1/fleet", timeout=30,
                            headers={"Authorization": f"Bearer {fleet[key]}"})
        assert refused.status_code == 403


def test_statistics_and_config_follow_the_same_rules(fleet: dict[str, str]) -> None:
    assert acme_echo(fleet) == 200
    headers = {"Authorization": f"Bearer {fleet['examples_operator']}"}
    every = httpx.get(f"{fleet['base']}/v2/models/stats", headers=headers, timeout=30)
    assert every.status_code == 200
    assert "acme-echo" not in {s["name"] for s in every.json()["model_stats"]}
    for path in ("/v2/models/acme-echo/stats", "/v2/models/acme-echo/config"):
        answer = httpx.get(f"{fleet['base']}{path}", headers=headers, timeout=30)
        assert answer.status_code == 404 and isinstance(answer.json()["error"], str)
    admin = {"Authorization": f"Bearer {fleet['admin']}"}
    stats = httpx.get(f"{fleet['base']}/v2/models/stats", headers=admin, timeout=30).json()
    assert "acme-echo" in {s["name"] for s in stats["model_stats"]}


def grpc_call(fleet: dict[str, str], key: str, method: str, request: object,
              response: type) -> object:
    with grpc.insecure_channel(fleet["grpc"]) as channel:
        stub = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                   request_serializer=type(request).SerializeToString,
                                   response_deserializer=response.FromString)
        return stub(request, timeout=120,
                    metadata=(("authorization", f"Bearer {fleet[key]}"),))


def test_grpc_control_is_scoped_the_same_way(fleet: dict[str, str]) -> None:
    for method, request, response in (
            ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="acme-echo"),
             pb.RepositoryModelUnloadResponse),
            ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="acme-echo"),
             pb.RepositoryModelLoadResponse)):
        with pytest.raises(grpc.RpcError) as info:
            grpc_call(fleet, "examples_operator", method, request, response)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    index = grpc_call(fleet, "acme_operator", "RepositoryIndex", pb.RepositoryIndexRequest(),
                      pb.RepositoryIndexResponse)
    assert [m.name for m in index.models] == ["acme-echo"]  # type: ignore[attr-defined]
    assert acme_echo(fleet) == 200
