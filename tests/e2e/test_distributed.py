"""Gateways and workers as separate processes, joined only by a real RabbitMQ."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from modelfleet.devtools.rabbit_node import RabbitNode
from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.procs import ROOT, Proc, gateway, worker
from tests.waiting import eventually_blocking

pytestmark = pytest.mark.rabbitmq
SEVEN = (ROOT / "examples" / "seven.png").read_bytes()


@pytest.fixture
def env() -> dict[str, str]:
    require_rabbitmq()
    # Queues and events of our own: nothing from another test or deployment interferes.
    return {**own_deployment(f"e2e{uuid.uuid4().hex[:8]}"),
            "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.5"}


def start_gateway(tmp_path: Path, env: dict[str, str], procs: list[Proc], name: str,
                  url: str = "") -> str:
    proc, base = gateway(tmp_path, url or rabbitmq_url(), env, name)
    procs.append(proc)
    return base


def start_worker(tmp_path: Path, env: dict[str, str], procs: list[Proc], name: str,
                 url: str = "") -> Proc:
    proc, _ = worker(tmp_path, url or rabbitmq_url(), env, name)
    procs.append(proc)
    return proc


def gauge(base: str, name: str) -> float | None:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def late_replies(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("modelfleet_gateway_late_replies_total "):
            return float(line.split()[1])
    return 0.0


def test_two_gateways_two_workers(tmp_path: Path, env: dict[str, str],
                                  procs: list[Proc]) -> None:
    gateways = [start_gateway(tmp_path, env, procs, f"gw{i}") for i in range(2)]
    probes = []
    for i in range(2):
        proc, probe = worker(tmp_path, rabbitmq_url(), env, f"w{i}")
        procs.append(proc)
        probes.append(probe)

    async def burst() -> list[tuple[int, httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as client:
            calls = []
            for i in range(60):
                base = gateways[i % 2]
                if i % 2:
                    calls.append(client.post(f"{base}/v1/models/digits/infer", content=SEVEN,
                                             headers={"content-type": "image/png"}))
                else:
                    calls.append(client.post(f"{base}/v1/models/iris/infer",
                                             json={"features": [5.1, 3.5, 1.4, 0.2]}))
            return list(enumerate(await asyncio.gather(*calls)))

    for i, response in asyncio.run(burst()):
        assert response.status_code == 200, response.text
        assert (response.json()["digit"] == 7) if i % 2 else \
            (response.json()["class"] == "setosa")
    # Every reply reached the gateway holding its request: none arrived anywhere else.
    assert [late_replies(base) for base in gateways] == [0.0, 0.0]
    workers = {w["worker_id"] for w in httpx.get(f"{gateways[0]}/v1/fleet").json()["workers"]}
    assert workers == {"w0", "w1"}
    # Each gateway published to its one model's queue (iris, digits) and to the cold lane
    # its first requests took (no worker held the model yet), and says so; so do the
    # workers, for the queues they consume (README "The broker at scale").
    assert [gauge(base, "modelfleet_broker_live_queues") for base in gateways] == [2.0, 2.0]
    for probe in probes:
        assert (gauge(probe, "modelfleet_broker_live_queues") or 0) >= 1
        assert gauge(probe, "modelfleet_broker_max_live_queues") == 5000


def test_killed_worker_mid_request_is_redelivered(tmp_path: Path, env: dict[str, str],
                                                  procs: list[Proc]) -> None:
    base = start_gateway(tmp_path, env, procs, "gw")
    # slowload's load outlasts a second worker's start-up (a few seconds on a busy
    # machine): the request is still in flight on "doomed" when it is killed. It is held
    # until then (the release file; at most 25 s, inside the request's 40 s), and the
    # survivor's load of it ends at once.
    release = tmp_path / "release"
    env = {**env, "MODELFLEET_EXAMPLE_SLOWLOAD_S": "25",
           "MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE": str(release)}
    doomed = start_worker(tmp_path, env, procs, "doomed")

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            # slowload's load is held: the request is in flight on "doomed" meanwhile.
            pending = asyncio.ensure_future(client.post(
                f"{base}/v1/models/slowload/infer", json={"n": 1},
                headers={"x-request-timeout": "40"}))
            for _ in range(100):
                fleet = (await client.get(f"{base}/v1/fleet")).json()["workers"]
                if any(w["permits_in_use"] for w in fleet):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the request never reached the worker")
            await asyncio.to_thread(start_worker, tmp_path, env, procs, "survivor")
            doomed.kill()  # kill -9, mid-load, unacked
            release.touch()
            return await pending

    response = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert response.json() == {"echo": {"n": 1}}
    assert response.headers["x-worker-id"] == "survivor"


# The broker-restart tests stop a RabbitMQ: a private node of this test process's own
# (tests/private_rabbit.py), never the shared one, whose other clients (the test process
# beside this one, among them) would lose their connections meanwhile.


def test_rabbitmq_restart_is_survived(tmp_path: Path, env: dict[str, str],
                                      procs: list[Proc], private_rabbit: RabbitNode) -> None:
    rabbitmqctl = private_rabbit.ctl
    base = start_gateway(tmp_path, env, procs, "gw", private_rabbit.url)
    start_worker(tmp_path, env, procs, "w", private_rabbit.url)
    ok = httpx.post(f"{base}/v1/models/iris/infer", json={"features": [5.1, 3.5, 1.4, 0.2]},
                    timeout=30)
    assert ok.status_code == 200
    rabbitmqctl("stop_app")
    try:
        # At once, not a hang: a gateway that waited for the broker would time out here.
        during = httpx.post(f"{base}/v1/models/iris/infer",
                            json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=5)
        assert during.status_code == 503, during.text
        assert during.headers["retry-after"]
        assert httpx.get(f"{base}/readyz").status_code == 503
    finally:
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup")
    # No modelfleet process was restarted: they reconnect and serve again.
    def iris_status() -> int:
        return httpx.post(f"{base}/v1/models/iris/infer",
                          json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=30).status_code

    eventually_blocking(lambda: iris_status() == 200, 60, what="iris served again",
                        every_s=0.5, state=iris_status)
    assert all(p.popen.poll() is None for p in procs)


def test_unreachable_broker_at_start_up_is_one_clear_line(tmp_path: Path) -> None:
    for command in ("gateway", "worker"):
        proc = Proc([command, "--broker", "amqp://guest:secret@127.0.0.1:1/"], {},
                    tmp_path / f"{command}.log", None)
        assert proc.popen.wait(60) == 3
        lines = [line for line in proc.log().splitlines() if "error" in line.lower()]
        assert lines and "127.0.0.1:1" in lines[-1] and "secret" not in proc.log()


def unsettled(node: RabbitNode, prefix: str) -> dict[str, tuple[int, int]]:
    """(ready, unacked) messages of this test's model queues, by queue."""
    listing = node.ctl("list_queues", "name", "messages_ready", "messages_unacknowledged")
    counts = {}
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0].startswith(prefix) and fields[1].isdigit():
            counts[fields[0]] = (int(fields[1]), int(fields[2]))
    return counts


def test_rabbitmq_restart_under_load_answers_everyone_and_leaves_nothing_unacked(
        tmp_path: Path, env: dict[str, str], procs: list[Proc],
        private_rabbit: RabbitNode) -> None:
    """stop_app for ~8 s while 10 clients send: every request gets 200, 503 or 504 by its
    deadline; the fleet serves again unaided; nothing is left unacked once idle."""
    rabbitmqctl = private_rabbit.ctl
    base = start_gateway(tmp_path, env, procs, "gw", private_rabbit.url)
    start_worker(tmp_path, env, procs, "w", private_rabbit.url)
    iris = {"features": [5.1, 3.5, 1.4, 0.2]}
    assert httpx.post(f"{base}/v1/models/iris/infer", json=iris, timeout=30).status_code == 200
    statuses: list[int] = []
    late: list[float] = []

    async def client(until: list[float]) -> None:
        async with httpx.AsyncClient(timeout=40) as http:
            while time.monotonic() < until[0]:
                started = time.monotonic()
                model, body = (("iris", iris) if len(statuses) % 2 else ("banner", "hi"))
                response = await (http.post(f"{base}/v1/models/iris/infer", json=body,
                                            headers={"x-request-timeout": "15"})
                                  if model == "iris" else
                                  http.post(f"{base}/v1/models/banner/infer", content=body,
                                            headers={"content-type": "text/plain",
                                                     "x-request-timeout": "15"}))
                statuses.append(response.status_code)
                if time.monotonic() - started > 15 + 5:
                    late.append(time.monotonic() - started)
                if response.status_code == 503:
                    await asyncio.sleep(0.2)
                if back and time.monotonic() >= back[0] + 8 \
                        and len(statuses) - back[1] >= 20 and statuses[-20:].count(200) == 20:
                    until[0] = 0.0  # serving again, 20 answers in a row: enough

    back: list[float] = []  # when the broker was back, and how many answers there were then

    async def scenario() -> None:
        until = [float("inf")]
        clients = asyncio.gather(*(client(until) for _ in range(10)))
        await asyncio.sleep(3)
        await asyncio.to_thread(rabbitmqctl, "stop_app")
        await asyncio.sleep(8)
        await asyncio.to_thread(rabbitmqctl, "start_app")
        await asyncio.to_thread(rabbitmqctl, "await_startup")
        # Traffic goes on from the moment the broker is back (its start took from 1 s to
        # 12 s here, by how busy the machine was), in which the fleet must find it again
        # unaided: at least 8 s, until 20 answers in a row are 200, at most 20 s.
        back[:] = [time.monotonic(), len(statuses)]
        until[0] = time.monotonic() + 20
        await clients

    try:
        asyncio.run(scenario())
    finally:
        rabbitmqctl("start_app")  # whatever happened, leave the broker up
    assert set(statuses) <= {200, 503, 504}, sorted(set(statuses))
    assert not late, f"answers later than their deadline: {late}"
    assert statuses[-20:].count(200) == 20, "not serving again after the restart"
    prefix = env["MODELFLEET_BROKER__QUEUE_PREFIX"]
    eventually_blocking(  # idle now: every delivery settles
        lambda: not any(unacked for _, unacked in unsettled(private_rabbit, prefix).values()),
        30, what="every delivery settled", every_s=0.5,
        state=lambda: unsettled(private_rabbit, prefix))
    assert all(p.popen.poll() is None for p in procs)
