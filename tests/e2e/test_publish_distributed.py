"""Done when: a model published with ``modelfleet push`` is served from an S3 API store by
a fresh ``gateway`` + ``worker`` (separate processes joined by a real RabbitMQ), and a
second gateway serves it too, none of them waiting for its repository refresh (an hour).

The store is moto's S3 server on loopback, read and written by the real s3fs client;
the gateways take signed packages only (``publish.secret``), and push signs with it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import s3fs
import tritonclient.http as triton
from moto import server as moto_server

from modelfleet.publishing.package import sign
from tests.conftest import rabbitmq_url, require_rabbitmq
from tests.procs import EXAMPLES, MODELFLEET, ROOT, Proc, gateway, worker
from tests.waiting import eventually_blocking

pytestmark = pytest.mark.rabbitmq
BUCKET = "published-models"
SECRET = "a-publishing-secret-of-some-length"


@pytest.fixture
def s3_env() -> Iterator[dict[str, str]]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        yield env
    finally:
        server.stop()


def _seed(env: dict[str, str]) -> None:
    """The bucket, holding the examples' banner (a fleet's repository is never empty)."""
    fs = s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL_S3"], key="test",
                           secret="test")
    fs.mkdir(BUCKET)
    fs.put(str(EXAMPLES / "banner" / "1") + "/", f"{BUCKET}/models/banner/1", recursive=True)


def test_a_pushed_model_is_served_by_every_gateway_from_s3_without_a_refresh(
        tmp_path: Path, s3_env: dict[str, str], procs: list[Proc]) -> None:
    require_rabbitmq()
    _seed(s3_env)
    repo = f"s3://{BUCKET}/models"
    unique = uuid.uuid4().hex[:8]
    # Queues and the events exchange of our own: other tests' fleets on the same RabbitMQ
    # (with workers named w1 too) neither hear our orders nor answer them.
    common = {**s3_env, "MODELFLEET_BROKER__QUEUE_PREFIX": f"e2e{unique}.",
              "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"e2e{unique}.events",
              "MODELFLEET_REPO_REFRESH_S": "3600", "MODELFLEET_PUBLISH__SECRET": SECRET,
              "MODELFLEET_TENANCY__DB": str(tmp_path / "tenants.sqlite3")}

    def env_of(name: str) -> dict[str, str]:
        return {**common, "MODELFLEET_RUNTIME__DISK_CACHE_DIR": str(tmp_path / name)}

    first, first_base = gateway(tmp_path, rabbitmq_url(), env_of("gw1"), "gw1",
                                repo=repo)
    procs.append(first)
    second, second_base = gateway(tmp_path, rabbitmq_url(), env_of("gw2"), "gw2",
                                  repo=repo)
    procs.append(second)
    serving, _ = worker(tmp_path, rabbitmq_url(), env_of("w1"), "w1",
                        repo=repo)
    procs.append(serving)

    folder = tmp_path / "greeter"
    folder.mkdir()
    (folder / "model.toml").write_text(textwrap.dedent("""\
        name = "greeter"
        entrypoint = "handler:Greeter"
        accepts = ["text/plain"]
        tenant = "examples"
        """))
    (folder / "handler.py").write_text(textwrap.dedent("""\
        from modelfleet import Model

        class Greeter(Model):
            def predict(self, batch):
                return [{"greeting": "hello, " + bytes(b).decode()} for b in batch]
        """))
    unsigned = subprocess.run([*MODELFLEET, "push", str(folder), "--gateway", first_base],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={k: v for k, v in os.environ.items()
                                   if k != "MODELFLEET_PUBLISH__SECRET"})
    assert unsigned.returncode == 1 and "signed packages only" in unsigned.stderr

    pushed = subprocess.run([*MODELFLEET, "push", str(folder), "--gateway", first_base],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "MODELFLEET_PUBLISH__SECRET": SECRET})
    assert pushed.returncode == 0, pushed.stderr
    assert "published greeter version 1" in pushed.stdout
    fs = s3fs.S3FileSystem(endpoint_url=s3_env["AWS_ENDPOINT_URL_S3"], key="test",
                           secret="test")
    assert fs.exists(f"{BUCKET}/models/greeter/1/model.toml")  # in the bucket itself

    # The publishing gateway answered once its own catalog held the model: no wait there
    # (the worker heard of it on the broker, and pulls once it knows it).
    answer = httpx.post(f"{first_base}/v1/models/greeter/infer", content=b"fleet",
                        headers={"content-type": "text/plain"}, timeout=60)
    assert answer.status_code == 200, answer.text + serving.log()[-3000:]
    assert answer.json() == {"greeting": "hello, fleet"}
    answer = _served(second_base, first, second, serving)
    assert answer.json() == {"greeting": "hello, fleet"}
    assert "repository: 1 added (greeter)" in second.log()  # told, not a refresh's turn

    # Version 2 through the other gateway, as tritonclient publishes (signed: the query
    # parameter), warmed by the load on the worker that had not scanned for it yet.
    handler = (folder / "handler.py").read_text().replace("hello, ", "hello again, ")
    files = {"model.toml": (folder / "model.toml").read_bytes(),
             "handler.py": handler.encode()}
    client = triton.InferenceServerClient(url=second_base.split("@", 1)[1],
                                          network_timeout=120, connection_timeout=120)
    client.load_model("greeter", headers={"Authorization": f"Bearer {second.api_key}"},
                      query_params={"signature": sign(SECRET, files)},
                      files={f"file:2/{path}": data for path, data in files.items()})
    answer = httpx.post(f"{first_base}/v1/models/greeter/versions/2/infer", content=b"fleet",
                        headers={"content-type": "text/plain"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"greeting": "hello again, fleet"}


def _served(base: str, *procs: Proc) -> httpx.Response:
    """The first answer that is not a 404: the other processes heard of the model from
    the broker, not from a refresh (an hour away), so this takes a moment at most."""
    def answered() -> httpx.Response | None:
        answer = httpx.post(f"{base}/v1/models/greeter/infer", content=b"fleet",
                            headers={"content-type": "text/plain"}, timeout=60)
        if answer.status_code == 404:
            return None
        assert answer.status_code == 200, answer.text
        return answer

    found: httpx.Response = eventually_blocking(  # far less than the hour a refresh takes
        answered, 60, what=f"greeter served at {base}", every_s=0.2,
        state=lambda: "the logs:\n" + "\n".join(p.log()[-3000:] for p in procs))
    return found
