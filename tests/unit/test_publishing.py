"""Publishing through the gateway's real app, in process (httpx's ASGI transport), over a
real embedded broker and a real local repository: every way a package can be wrong gets
its own 4xx in the dialect of its path, and nothing of it reaches the repository; a good
one is a new version, in the catalog at once and announced to the fleet.

The entrypoint check runs a real throwaway interpreter (it is what it tests).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import tarfile
import zipfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from modelfleet.broker import Broker, create_broker
from modelfleet.errors import PackageRejected
from modelfleet.gateway.app import create_app
from modelfleet.gateway.service import GatewayService
from modelfleet.publishing.package import Limits, Package, checked_path, from_archive, sign
from modelfleet.publishing.publisher import Publisher
from modelfleet.publishing.push import archive
from modelfleet.publishing.settings import PublishSettings
from modelfleet.repository import Catalog, LocalStore
from modelfleet.repository.refresher import CatalogRefresher
from modelfleet.settings import BrokerSettings, Settings

MANIFEST = """\
name = "{name}"
entrypoint = "handler:Hello"
accepts = ["text/plain"]
tenant = "acme"
"""
HANDLER = """\
from modelfleet import Model

class Hello(Model):
    def predict(self, batch):
        return [{"hello": bytes(b).decode()} for b in batch]
"""
SECRET = "s3cret-s3cret-s3cret"


def files(name: str = "acme-hello", manifest: str = MANIFEST, handler: str = HANDLER,
          **more: bytes) -> dict[str, bytes]:
    return {"model.toml": manifest.format(name=name).encode(), "handler.py": handler.encode(),
            **{path.replace("__", "/"): data for path, data in more.items()}}


def tgz(contents: Mapping[str, bytes]) -> bytes:
    return archive(Package(dict(contents)))


def tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, content in files().items():
            info = tarfile.TarInfo(path)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        tar.addfile(member, io.BytesIO(data) if data else None)
    return buffer.getvalue()


@dataclass
class Gateway:
    client: httpx.AsyncClient
    root: Path
    catalog: Catalog
    events: list[dict[str, Any]]

    async def put(self, body: bytes, name: str = "acme-hello", **kwargs: Any
                  ) -> httpx.Response:
        return await self.client.put(f"/v1/models/{name}/package", content=body, **kwargs)

    def versions(self, name: str = "acme-hello") -> list[str]:
        folder = self.root / name
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@contextlib.asynccontextmanager
async def running(tmp_path: Path, publish: PublishSettings) -> AsyncIterator[Gateway]:
    root = tmp_path / "repo"
    root.mkdir()
    settings = Settings(broker=BrokerSettings(url="memory"), publish=publish)
    broker: Broker = create_broker(settings.broker)
    await broker.connect()
    store = LocalStore(root)
    catalog = Catalog.from_store(store)
    refresher = CatalogRefresher(store, catalog, 3600)  # never on its own in a test
    events: list[dict[str, Any]] = []
    listening = asyncio.Event()

    async def listen() -> None:
        stream = broker.events()
        listening.set()
        async for event in stream:
            events.append(event)

    tasks = [asyncio.create_task(refresher.run()), asyncio.create_task(listen())]
    await listening.wait()
    await asyncio.sleep(0)  # the listener's first __anext__: subscribed
    publisher = Publisher(settings.publish, store, catalog, refresher.refresh_now,
                          broker.publish_event, "this-gateway")
    service = GatewayService(settings, broker, catalog, bound_port=8000)
    transport = httpx.ASGITransport(app=create_app(service, publisher=publisher))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=60) as client:
            yield Gateway(client, root, catalog, events)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await broker.close()


SMALL = PublishSettings(max_package_bytes=64 * 1024, max_package_files=8, import_timeout_s=5)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with running(tmp_path, SMALL) as gateway:
        yield gateway


def v1_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return str(error["message"])


# -- a good package ----------------------------------------------------------------------

async def test_a_package_becomes_version_1_in_the_catalog_at_once_and_is_announced(
        gw: Gateway) -> None:
    answer = await gw.put(tgz(files()))
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert (body["name"], body["version"], body["files"], body["servable"]) == \
        ("acme-hello", "1", 2, True)
    assert gw.catalog.get("acme-hello").manifest.version == "1"  # no refresh waited for
    written = (gw.root / "acme-hello" / "1" / "model.toml").read_text()
    assert written.startswith('version = "1"')
    await asyncio.sleep(0.05)
    assert {"kind": "catalog_changed", "origin": "this-gateway", "model_id": "acme-hello",
            "version": "1"} in gw.events


async def test_publishing_again_adds_the_next_version_and_never_overwrites_one(
        gw: Gateway) -> None:
    assert (await gw.put(tgz(files()))).json()["version"] == "1"
    assert (await gw.put(tgz(files()))).json()["version"] == "2"
    assert (await gw.put(tgz(files()), params={"version": "7"})).json()["version"] == "7"
    assert (await gw.put(tgz(files()))).json()["version"] == "8"
    before = (gw.root / "acme-hello" / "2" / "handler.py").read_bytes()
    message = v1_error(await gw.put(tgz(files(handler=HANDLER + "# changed\n")),
                                    params={"version": "2"}), 409, "version_exists")
    assert "never changes" in message
    assert (gw.root / "acme-hello" / "2" / "handler.py").read_bytes() == before
    stated = MANIFEST + 'version = "8"\n'
    v1_error(await gw.put(tgz(files(manifest=stated))), 409, "version_exists")
    assert [m.version for m in gw.catalog.get("acme-hello").versions] == ["1", "2", "7", "8"]


async def test_a_new_version_keeps_its_models_tenant(gw: Gateway) -> None:
    assert (await gw.put(tgz(files()))).status_code == 201
    moved = MANIFEST.replace('tenant = "acme"', 'tenant = "other"')
    message = v1_error(await gw.put(tgz(files(manifest=moved))), 400, "invalid_package")
    assert "belongs to tenant 'acme'" in message
    assert gw.versions() == ["1"]


async def test_a_name_that_is_no_model_name_is_refused(gw: Gateway) -> None:
    message = v1_error(await gw.put(tgz(files()), name="Not_A_Name"), 400, "invalid_package")
    assert "is not a model name" in message


async def test_zip_archives_and_a_wrapping_folder_are_taken(gw: Gateway) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        for path, data in files().items():
            zipped.writestr(f"acme-hello/{path}", data)
    answer = await gw.put(buffer.getvalue())
    assert answer.status_code == 201, answer.text
    assert gw.versions() == ["1"]


# -- every way a package is wrong: a 4xx, and nothing in the repository ------------------

@pytest.mark.parametrize(("body", "status", "code", "says"), [
    (b"just some bytes", 400, "invalid_package", "not a tar, tar.gz or zip"),
    (b"\x1f\x8b" + b"\0" * 40, 400, "invalid_package", "cannot be read"),
    (tgz(files(**{"..__evil.py": b"x"})), 400, "invalid_package", "leaves the package"),
    (tgz({**files(), "/etc/evil.py": b"x"}), 400, "invalid_package", "absolute"),
    (tgz({**files(), "a/" + "\u00e9" * 128: b"x"}), 400, "invalid_package",
     "a part of 256 bytes: a file name is at most 255"),
    (tgz({"handler.py": HANDLER.encode()}), 400, "invalid_package", "no model.toml"),
    (tgz(files(manifest=MANIFEST + "pinned = true\n")), 400, "invalid_package",
     "field 'pinned'"),
    (tgz(files(manifest="name = [\n")), 400, "invalid_package", "not valid TOML"),
    (tgz(files(name="other-model")), 400, "invalid_package", "names model 'other-model'"),
    (tgz(files(manifest=MANIFEST.replace("handler:Hello", "missing:Hello"))), 400,
     "invalid_package", "has no missing.py"),
    (tgz(files(manifest=MANIFEST + 'version = "bad version"\n')), 400, "invalid_package",
     "field 'version'"),
    (tgz(files(handler="import no_such_module_anywhere\n")), 400, "invalid_package",
     "No module named 'no_such_module_anywhere'"),
    (tgz(files(handler="raise RuntimeError('boom at import')\n")), 400, "invalid_package",
     "boom at import"),
    (tgz(files(handler="class Hello:\n    pass\n")), 400, "invalid_package",
     "not a modelfleet.Model subclass"),
    (tgz(files(handler="def broken(:\n")), 400, "invalid_package", "SyntaxError"),
    (tgz(files(**{f"f{i}.bin": b"x" for i in range(8)})), 413, "package_too_large",
     "more than 8 files"),
    (tgz(files(**{"weights.bin": b"\0" * (65 * 1024)})), 413, "package_too_large",
     "more than 65536 bytes"),
])
async def test_a_wrong_package_is_refused_with_a_clear_4xx(
        gw: Gateway, body: bytes, status: int, code: str, says: str) -> None:
    refused = REGISTRY.get_sample_value("modelfleet_gateway_publishes_total",
                                        {"outcome": code}) or 0
    message = v1_error(await gw.put(body), status, code)
    assert says in message, message
    assert REGISTRY.get_sample_value("modelfleet_gateway_publishes_total",
                                     {"outcome": code}) == refused + 1
    assert gw.versions() == []
    assert "acme-hello" not in gw.catalog


@pytest.mark.parametrize("member", ["symlink", "hardlink", "fifo"])
async def test_links_and_special_files_in_an_archive_are_refused(gw: Gateway,
                                                                 member: str) -> None:
    info = tarfile.TarInfo("weights.bin")
    info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                 "fifo": tarfile.FIFOTYPE}[member]
    info.linkname = "/etc/passwd"
    message = v1_error(await gw.put(tar_with(info)), 400, "invalid_package")
    assert "plain files only" in message
    assert gw.versions() == []


async def test_a_symlink_in_a_zip_is_refused(gw: Gateway) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        for path, data in files().items():
            zipped.writestr(path, data)
        link = zipfile.ZipInfo("weights.bin")
        link.external_attr = (0o120777 << 16)
        zipped.writestr(link, "/etc/passwd")
    message = v1_error(await gw.put(buffer.getvalue()), 400, "invalid_package")
    assert "is a link" in message


async def test_an_import_that_hangs_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    settings = PublishSettings(import_timeout_s=1)
    async with running(tmp_path, settings) as gateway:
        hanging = "import time\ntime.sleep(600)\n" + HANDLER
        message = v1_error(await gateway.put(tgz(files(handler=hanging))), 400,
                           "invalid_package")
        assert "took longer than 1s" in message
        assert gateway.versions() == []


async def test_the_import_runs_without_the_gateways_secrets(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFLEET_PUBLISH__SECRET", "never-for-packages")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-for-packages")
    nosy = ("import os\nassert not [k for k in os.environ if 'SECRET' in k], "
            "'saw a secret'\n" + HANDLER)
    answer = await gw.put(tgz(files(handler=nosy)))
    assert answer.status_code == 201, answer.text


async def test_a_model_with_its_own_requirements_is_compiled_not_imported(
        gw: Gateway) -> None:
    isolated = MANIFEST + '[isolation]\nrequirements = ["somepackage==1.0"]\n'
    needs = "import somepackage_only_on_workers\n" + HANDLER
    answer = await gw.put(tgz(files(manifest=isolated, handler=needs)))
    assert answer.status_code == 201, answer.text
    message = v1_error(await gw.put(tgz(files(manifest=isolated, handler="def x(:\n"))),
                       400, "invalid_package")
    assert "does not compile" in message
    message = v1_error(await gw.put(tgz(files(manifest=isolated, handler="X = 1\n"))),
                       400, "invalid_package")
    assert "defines no class Hello" in message


# -- signatures ------------------------------------------------------------------------

async def test_with_a_secret_only_signed_packages_are_taken(tmp_path: Path) -> None:
    async with running(tmp_path, PublishSettings(secret=SECRET)) as gateway:
        package = files()
        message = v1_error(await gateway.put(tgz(package)), 403, "bad_signature")
        assert "signed packages only" in message
        forged = sign("another-secret-entirely", package)
        message = v1_error(await gateway.put(
            tgz(package), headers={"X-Modelfleet-Signature": forged}), 403, "bad_signature")
        assert "does not match" in message
        tampered = files(handler=HANDLER + "# tampered\n")
        v1_error(await gateway.put(tgz(tampered), headers={
            "X-Modelfleet-Signature": sign(SECRET, package)}), 403, "bad_signature")
        assert gateway.versions() == []
        answer = await gateway.put(tgz(package),
                                   headers={"X-Modelfleet-Signature": sign(SECRET, package)})
        assert answer.status_code == 201, answer.text


async def test_without_a_secret_a_signed_package_is_refused_not_trusted(gw: Gateway) -> None:
    package = files()
    message = v1_error(await gw.put(tgz(package), headers={
        "X-Modelfleet-Signature": sign(SECRET, package)}), 403, "bad_signature")
    assert "no publishing secret" in message


# -- the protocol's load with files --------------------------------------------------------

def load_body(contents: Mapping[str, bytes], **params: Any) -> dict[str, Any]:
    return {"parameters": {**{f"file:{path}": base64.b64encode(data).decode()
                              for path, data in contents.items()}, **params}}


async def test_load_with_files_publishes_the_version_folder_it_names(gw: Gateway) -> None:
    contents = {f"3/{path}": data for path, data in files().items()}
    answer = await gw.client.post("/v2/repository/models/acme-hello/load",
                                  json=load_body(contents))
    # Published; warming it needs a worker, and this gateway has none.
    assert answer.status_code == 503, answer.text
    assert "ready worker" in answer.json()["error"]
    assert gw.versions() == ["3"]
    assert gw.catalog.get("acme-hello").manifest.version == "3"


@pytest.mark.parametrize(("contents", "params", "says"), [
    ({"1/model.toml": b"x"}, {"version": "2"}, "version folder '1/' but the load asks"),
    ({"1/model.toml": b"x", "2/handler.py": b"x"}, {}, "no model.toml at its top"),
    ({"../model.toml": b"x"}, {}, "leaves the package"),
    # simple_grpc_model_control's: Triton's words, then why.
    ({"A" * 256: b"a"}, {"config": "{}"},
     "failed to poll from model repository: the package's path 'AAAA"),
    ({}, {"file:model.toml": "%%%not base64"}, "is not base64"),
    ({}, {"file:model.toml": 12}, "in base64 (a string)"),
    # The package's tensors have no batch dimension: no max_batch_size maps onto it.
    (files(), {"config": {"max_batch_size": 64}},
     "the config does not map onto model 'acme-hello''s model.toml"),
    ({}, {"signature": "ab" * 32}, "this load has none"),
])
async def test_load_with_wrong_files_is_a_v2_400(gw: Gateway, contents: dict[str, bytes],
                                                 params: dict[str, Any], says: str) -> None:
    answer = await gw.client.post("/v2/repository/models/acme-hello/load",
                                  json=load_body(contents, **params))
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]  # the protocol's {"error": "..."}
    assert gw.versions() == []


async def test_load_with_an_existing_version_is_a_v2_409(gw: Gateway) -> None:
    assert (await gw.put(tgz(files()))).status_code == 201
    answer = await gw.client.post("/v2/repository/models/acme-hello/load", json=load_body(
        {f"1/{path}": data for path, data in files().items()}))
    assert answer.status_code == 409, answer.text
    assert "never changes" in answer.json()["error"]


# -- the package's paths, as a unit --------------------------------------------------------

@pytest.mark.parametrize("path", ["/abs.py", "C:/x.py", "a/../../x", "..", "a\\b.py",
                                  "bad\x00name", ""])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(PackageRejected):
        checked_path(path)


def test_a_file_name_holds_255_bytes_and_no_more() -> None:
    assert checked_path("1/" + "a" * 255) == "1/" + "a" * 255
    with pytest.raises(PackageRejected, match="a part of 256 bytes"):
        checked_path("1/" + "a" * 256)
    with pytest.raises(PackageRejected, match="a part of 256 bytes"):
        checked_path("1/" + "\u00e9" * 128)  # 128 characters, 2 bytes each


def test_the_digest_is_the_content_whatever_carried_it() -> None:
    contents = files()
    as_tar = from_archive(tgz(contents), Limits(1 << 20, 10))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        for path, data in reversed(list(contents.items())):
            zipped.writestr(path, data)
    as_zip = from_archive(buffer.getvalue(), Limits(1 << 20, 10))
    assert as_tar.digest() == as_zip.digest() == Package(contents).digest()
    assert sign(SECRET, as_tar.files) == sign(SECRET, contents)
