"""Publishing through a running ``serve`` with auth on: ``modelfleet push`` and
tritonclient's ``load_model(files=...)`` publish a package that is served at once (the
repository refresh is an hour away), and each tenant's operator publishes its own
models only; another tenant's model is the same 404 as a missing one."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.http as triton

from tests.procs import EXAMPLES, MODELFLEET, ROOT, provision_key, serve

MANIFEST = """\
    name = "{name}"
    entrypoint = "handler:Hello"
    accepts = ["text/plain"]
    tenant = "{tenant}"
    """
HANDLER = """\
    from modelfleet import Model

    class Hello(Model):
        def predict(self, batch):
            return [{{"hello": bytes(b).decode(), "from": "{mark}"}} for b in batch]
    """


def package(folder: Path, name: str, tenant: str = "acme", mark: str = "v1") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(textwrap.dedent(MANIFEST).format(name=name,
                                                                        tenant=tenant))
    (folder / "handler.py").write_text(textwrap.dedent(HANDLER).format(mark=mark))
    return folder


def push(folder: Path, base: str, key: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MODELFLEET, "push", str(folder), "--gateway", base, "--key", key,
                           *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("publish")
    repo = tmp / "repo"
    shutil.copytree(EXAMPLES / "banner", repo / "banner")  # tenant "examples"
    db = tmp / "tenants.sqlite3"
    proc, base = serve(tmp, repo=repo, env={
        "MODELFLEET_TENANCY__AUTH": "on", "MODELFLEET_TENANCY__DB": str(db),
        "MODELFLEET_DLQ_DB": str(db), "MODELFLEET_REPO_REFRESH_S": "3600"})
    try:
        yield {"base": base, "tmp": str(tmp), "repo": str(repo),
               "acme_operator": provision_key(str(db), "operator", "acme"),
               "acme_caller": provision_key(str(db), "caller", "acme"),
               "examples_operator": provision_key(str(db), "operator", "examples"),
               "admin": provision_key(str(db), "admin", "ops")}
    finally:
        proc.stop()


def hello(fleet: dict[str, str], model: str, key: str = "acme_caller") -> httpx.Response:
    return httpx.post(f"{fleet['base']}/v1/models/{model}/infer", content=b"hi", timeout=60,
                      headers={"Authorization": f"Bearer {fleet[key]}",
                               "content-type": "text/plain"})


def test_a_pushed_model_is_served_at_once_and_a_second_push_is_its_next_version(
        fleet: dict[str, str]) -> None:
    folder = package(Path(fleet["tmp"]) / "acme-hello", "acme-hello")
    pushed = push(folder, fleet["base"], fleet["acme_operator"])
    assert pushed.returncode == 0, pushed.stderr
    assert "published acme-hello version 1" in pushed.stdout
    answer = hello(fleet, "acme-hello")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"hello": "hi", "from": "v1"}

    package(folder, "acme-hello", mark="v2")
    pushed = push(folder, fleet["base"], fleet["acme_operator"])
    assert pushed.returncode == 0, pushed.stderr
    assert "published acme-hello version 2" in pushed.stdout
    answer = httpx.post(f"{fleet['base']}/v1/models/acme-hello/versions/2/infer",
                        content=b"hi", timeout=60, headers={
                            "Authorization": f"Bearer {fleet['acme_caller']}",
                            "content-type": "text/plain"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["from"] == "v2"

    again = push(folder, fleet["base"], fleet["acme_operator"], "--version", "2")
    assert again.returncode == 1
    assert "409" in again.stderr and "never changes" in again.stderr
    assert sorted(p.name for p in (Path(fleet["repo"]) / "acme-hello").iterdir()) == \
        ["1", "2"]


def test_a_broken_package_is_refused_by_push_with_the_reason(fleet: dict[str, str]) -> None:
    folder = package(Path(fleet["tmp"]) / "acme-broken", "acme-broken")
    (folder / "handler.py").write_text("import not_installed_anywhere\n")
    pushed = push(folder, fleet["base"], fleet["acme_operator"])
    assert pushed.returncode == 1
    assert "400" in pushed.stderr and "not_installed_anywhere" in pushed.stderr
    assert not (Path(fleet["repo"]) / "acme-broken").exists()
    assert hello(fleet, "acme-broken").status_code == 404


def test_an_operator_publishes_only_its_own_tenants_models(fleet: dict[str, str]) -> None:
    tmp = Path(fleet["tmp"])
    # Another tenant's model, and a new model outside acme's names: the same 404 as for
    # a model that does not exist, so no name is confirmed.
    foreign = push(package(tmp / "banner", "banner", tenant="acme"), fleet["base"],
                   fleet["acme_operator"])
    unprefixed = push(package(tmp / "nobody-x", "nobody-x"), fleet["base"],
                      fleet["acme_operator"])
    assert foreign.returncode == unprefixed.returncode == 1
    assert "404" in foreign.stderr
    assert foreign.stderr.replace("banner", "X") == unprefixed.stderr.replace("nobody-x", "X")
    assert not (Path(fleet["repo"]) / "nobody-x").exists()
    assert sorted(p.name for p in (Path(fleet["repo"]) / "banner").iterdir()) == ["1"]
    # Its own prefix, but a manifest naming another tenant: refused, with the reason.
    other = push(package(tmp / "acme-other", "acme-other", tenant="examples"),
                 fleet["base"], fleet["acme_operator"])
    assert other.returncode == 1
    assert "403" in other.stderr and 'tenant = "acme"' in other.stderr
    # A plain load of a name acme could publish, that does not exist: the same 404 too.
    loads = [httpx.post(f"{fleet['base']}/v2/repository/models/{name}/load", json={},
                        timeout=60, headers={"Authorization": f"Bearer {fleet['acme_operator']}"})
             for name in ("acme-nothing-yet", "banner")]
    assert [answer.status_code for answer in loads] == [404, 404]
    assert loads[0].json()["error"].replace("acme-nothing-yet", "X") == \
        loads[1].json()["error"].replace("banner", "X")
    # A caller key publishes nothing.
    caller = push(package(tmp / "acme-caller", "acme-caller"), fleet["base"],
                  fleet["acme_caller"])
    assert caller.returncode == 1 and "403" in caller.stderr
    # The examples' operator publishes banner's next version; an admin any model.
    own = push(package(tmp / "banner-next", "banner", tenant="examples"), fleet["base"],
               fleet["examples_operator"])
    assert own.returncode == 0, own.stderr
    assert "published banner version 2" in own.stdout
    admin = push(package(tmp / "zeta", "zeta", tenant="zeta-team"), fleet["base"],
                 fleet["admin"])
    assert admin.returncode == 0, admin.stderr
    assert hello(fleet, "zeta", key="admin").status_code == 200


def test_tritonclient_load_model_with_files_publishes_and_warms(fleet: dict[str, str]
                                                                 ) -> None:
    client = triton.InferenceServerClient(
        url=fleet["base"].removeprefix("http://"), network_timeout=120,
        connection_timeout=120)
    headers = {"Authorization": f"Bearer {fleet['acme_operator']}"}
    manifest = textwrap.dedent(MANIFEST).format(name="acme-triton", tenant="acme")
    handler = textwrap.dedent(HANDLER).format(mark="triton")
    client.load_model("acme-triton", headers=headers, files={
        "file:1/model.toml": manifest.encode(), "file:1/handler.py": handler.encode()})
    index = {m["name"]: m for m in client.get_model_repository_index(headers=headers)}
    assert index["acme-triton"]["state"] == "READY"
    answer = hello(fleet, "acme-triton")
    assert answer.json() == {"hello": "hi", "from": "triton"}
    assert answer.headers["x-model-cold"] == "0"  # the load answered once it was warm
    with pytest.raises(triton.InferenceServerException, match="never changes"):
        client.load_model("acme-triton", headers=headers, files={
            "file:1/model.toml": manifest.encode(), "file:1/handler.py": handler.encode()})
    # Another tenant's package: refused as PUT refuses it (403), not a server error.
    theirs = textwrap.dedent(MANIFEST).format(name="acme-theirs", tenant="zeta-team")
    with pytest.raises(triton.InferenceServerException) as info:
        client.load_model("acme-theirs", headers=headers, files={
            "file:1/model.toml": theirs.encode(), "file:1/handler.py": handler.encode()})
    assert info.value.status() == "403"
    assert info.value.message().startswith("failed to load 'acme-theirs'")
    assert "publishes that tenant's models only" in info.value.message()
