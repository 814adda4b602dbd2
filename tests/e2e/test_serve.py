"""``modelfleet serve`` as a real subprocess on a free port, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from modelfleet.oip import OIP_CONTENT_TYPE
from tests.procs import ROOT, Proc, metric_sum, serve
from tests.waiting import eventually_blocking

DIGITS = ROOT / "tests" / "fixtures" / "digits"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, image_host: str) -> Iterator[str]:
    proc, base = serve(tmp_path_factory.mktemp("serve"), env={
        # Small limits so that each error path is cheap to reach.
        "MODELFLEET_GATEWAY__MAX_BODY_BYTES": str(2 * 1024 * 1024),
        "MODELFLEET_GATEWAY__INLINE_THRESHOLD_BYTES": "2048",
        # Payload URLs to the image host on this machine's loopback are allowed here.
        "MODELFLEET_RUNTIME__URL_FETCH_ALLOW": json.dumps([image_host.removeprefix("http://")]),
    })
    yield base
    proc.stop()


def error_of(response: httpx.Response) -> dict[str, str]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def test_digits_are_recognised(server: str) -> None:
    labels = json.loads((DIGITS / "labels.json").read_text())
    for name, info in labels.items():
        ctype = "image/png" if name.endswith(".png") else "image/jpeg"
        response = httpx.post(f"{server}/v1/models/digits/infer",
                              content=(DIGITS / name).read_bytes(),
                              headers={"content-type": ctype}, timeout=30)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["digit"] == info["digit"], name
        assert len(answer["probabilities"]) == 10
        assert abs(sum(answer["probabilities"]) - 1) < 1e-3


def test_large_payload_travels_by_signed_url(server: str) -> None:
    """Above the inline threshold the runtime fetches the bytes from the gateway."""
    image = (ROOT / "examples" / "seven.png").read_bytes()
    padded = image + b"\0" * 4096  # PNG readers ignore trailing bytes; now above 2 KiB
    before = metric_sum(server, "modelfleet_gateway_payload_fetches_total", outcome="ok")
    response = httpx.post(f"{server}/v1/models/digits/infer", content=padded,
                          headers={"content-type": "image/png"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["digit"] == 7
    fetched = metric_sum(server, "modelfleet_gateway_payload_fetches_total", outcome="ok")
    assert fetched == before + 1
    # Freed as soon as the reply came.
    assert metric_sum(server, "modelfleet_gateway_payload_store_bytes") == 0


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A caller's own image server, on loopback."""
    seven = (ROOT / "examples" / "seven.png").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/seven.png" else 404)
            self.send_header("content-type", "image/png")
            self.end_headers()
            if self.path == "/seven.png":
                self.wfile.write(seven)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_payload_by_url(server: str, image_host: str) -> None:
    ok = httpx.post(f"{server}/v1/models/digits/infer",
                    json={"url": f"{image_host}/seven.png"}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["digit"] == 7
    missing = httpx.post(f"{server}/v1/models/digits/infer",
                         json={"url": f"{image_host}/nothing.png"}, timeout=30)
    assert missing.status_code == 502
    assert error_of(missing)["code"] == "payload_unavailable"
    private = httpx.post(f"{server}/v1/models/digits/infer",
                         json={"url": "http://169.254.169.254/latest/meta-data"}, timeout=30)
    assert private.status_code == 400
    assert error_of(private)["code"] == "payload_fetch_forbidden"


def test_payload_urls_must_be_signed(server: str) -> None:
    response = httpx.get(f"{server}/v1/payloads/abc?expires=99999999999999&sig=00")
    assert response.status_code == 403
    assert error_of(response)["code"] == "forbidden"


def test_iris_and_banner(server: str) -> None:
    iris = httpx.post(f"{server}/v1/models/iris/infer", json={"features": [6.7, 3.0, 5.2, 2.3]},
                      timeout=30)
    assert iris.status_code == 200 and iris.json()["class"] == "virginica"
    banner = httpx.post(f"{server}/v1/models/banner/infer", content=b"ship it",
                        headers={"content-type": "text/plain"}, timeout=30)
    assert banner.status_code == 200
    assert banner.headers["content-type"].startswith("text/plain")
    assert "< ship it >" in banner.text


def test_unknown_model_is_404(server: str) -> None:
    response = httpx.post(f"{server}/v1/models/nope/infer", content=b"{}",
                          headers={"content-type": "application/json"})
    assert response.status_code == 404
    assert "nope" in error_of(response)["message"]
    assert httpx.get(f"{server}/v1/models/nope").status_code == 404


def test_oversized_payload_is_413_before_it_is_read(server: str) -> None:
    """64 MiB announced, none of it sent: the answer comes without waiting for the body."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: image/png\r\nContent-Length: 67108864\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b'"code":"payload_too_large"' in answer


def test_oversized_chunked_payload_is_413(server: str) -> None:
    def body() -> Iterator[bytes]:
        for _ in range(8):
            yield b"\0" * (1024 * 1024)

    response = httpx.post(f"{server}/v1/models/digits/infer", content=body(),
                          headers={"content-type": "image/png"}, timeout=30)
    assert response.status_code == 413


def test_wrong_content_type_is_415(server: str) -> None:
    response = httpx.post(f"{server}/v1/models/digits/infer", content=b"hello",
                          headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert "image/png" in error_of(response)["message"]


def test_rejected_input_is_422_with_the_handlers_message(server: str) -> None:
    response = httpx.post(f"{server}/v1/models/iris/infer", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 422
    assert "JSON" in error_of(response)["message"]
    corrupt = httpx.post(f"{server}/v1/models/digits/infer", content=b"\x89PNG\r\n\x1a\n junk",
                         headers={"content-type": "image/png"}, timeout=30)
    assert corrupt.status_code == 422


def test_deadline_is_504(server: str) -> None:
    response = httpx.post(f"{server}/v1/models/slowload/infer", json={"x": 1},
                          headers={"x-request-timeout": "0.5"}, timeout=30)
    assert response.status_code == 504
    assert error_of(response)["code"] == "deadline_exceeded"
    bad = httpx.post(f"{server}/v1/models/slowload/infer", json={"x": 1},
                     headers={"x-request-timeout": "soon"})
    assert bad.status_code == 400


def test_model_that_fails_to_load_is_500_and_retried(server: str) -> None:
    before = metric_sum(server, "modelfleet_model_load_failures_total")
    for _ in range(2):
        response = httpx.post(f"{server}/v1/models/broken/infer", json={}, timeout=30)
        assert response.status_code == 500
        error = error_of(response)
        assert error["code"] == "model_load_failed"
        assert "broken" in error["message"]
        assert "format" in error["message"]  # the cause, from the handler's exception
    # Load failures are counted when the worker next reads its runtime's stats.
    eventually_blocking(
        lambda: metric_sum(server, "modelfleet_model_load_failures_total") >= before + 2, 5,
        what="both load failures counted",
        state=lambda: metric_sum(server, "modelfleet_model_load_failures_total") - before)


def test_catalog(server: str) -> None:
    httpx.post(f"{server}/v1/models/iris/infer", json={"features": [5.1, 3.5, 1.4, 0.2]},
               timeout=30)
    models = {m["name"]: m for m in httpx.get(f"{server}/v1/models").json()["models"]}
    assert {"digits", "iris", "banner", "enrich"} <= set(models)
    # PNG or JPEG on /v1, and v2 tensors: the manifest declares a tensor signature too
    assert models["digits"]["accepts"] == ["image/png", "image/jpeg", OIP_CONTENT_TYPE]
    assert models["digits"]["versions"] == ["1"]
    assert models["digits"]["size_estimate_bytes"] > 0
    assert models["iris"]["device"] == "cpu"
    eventually_blocking(  # warmth comes from the worker's next state event
        lambda: httpx.get(f"{server}/v1/models/iris").json()["warm"] is True, 5,
        what="iris listed warm")


def test_probes_and_metrics(server: str) -> None:
    assert httpx.get(f"{server}/livez").status_code == 200
    assert httpx.get(f"{server}/readyz").json() == {"status": "ready"}
    text = httpx.get(f"{server}/metrics").text
    assert "modelfleet_gateway_requests_total" in text
    assert "modelfleet_worker_permits_cap 16.0" in text
    fleet = httpx.get(f"{server}/v1/fleet").json()["workers"]
    assert len(fleet) == 1 and fleet[0]["permits_cap"] == 16


def test_bytes_loaded_are_counted_by_source(server: str) -> None:
    """/metrics says how many bytes the loads read, by the loads counter's sources: a
    model loaded from storage counts at least its package's bytes (on CPU a load
    measures at least that much)."""
    package = sum(f.stat().st_size for f in (ROOT / "examples" / "models" / "iris").rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts)
    response = httpx.post(f"{server}/v1/models/iris/infer",
                          json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=60)
    assert response.status_code == 200, response.text
    eventually_blocking(lambda: metric_sum(server, "modelfleet_model_loads_total") > 0, 30,
                        what="a load on /metrics", every_s=0.2)  # counted at a re-score
    loads = {source: metric_sum(server, "modelfleet_model_loads_total", source=source)
             for source in ("repository", "disk", "host")}
    loaded = {source: metric_sum(server, "modelfleet_model_load_bytes_total", source=source)
              for source in loads}
    for source, count in loads.items():
        assert (loaded[source] > 0) == (count > 0), (loads, loaded)
    assert loaded["repository"] + loaded["disk"] >= package, (loaded, package)
    text = httpx.get(f"{server}/metrics").text
    assert "# TYPE modelfleet_model_load_bytes_total counter" in text


async def _burst(base: str) -> list[tuple[str, httpx.Response]]:
    seven = (ROOT / "examples" / "seven.png").read_bytes()
    calls = []
    # A deadline of 30 s, not the models' own (banner's is 5 s): the burst's first
    # requests wait for cold loads, and with both cores busy scikit-learn's import alone
    # took 5.6 s, during which banner's requests on the same runtime outlived 5 s.
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100),
                                 headers={"x-request-timeout": "30"}) as client:
        for i in range(100):
            kind = ("digits", "iris", "banner")[i % 3]
            if kind == "digits":
                call = client.post(f"{base}/v1/models/digits/infer", content=seven,
                                   headers={"content-type": "image/png"})
            elif kind == "iris":
                call = client.post(f"{base}/v1/models/iris/infer",
                                   json={"features": [5.1, 3.5, 1.4, 0.2]})
            else:
                call = client.post(f"{base}/v1/models/banner/infer", content=f"hi {i}".encode(),
                                   headers={"content-type": "text/plain"})
            calls.append((kind, call))
        responses = await asyncio.gather(*(c for _, c in calls))
    return [(kind, r) for (kind, _), r in zip(calls, responses, strict=True)]


def test_100_concurrent_requests_across_3_models(server: str) -> None:
    results = asyncio.run(_burst(server))
    assert len(results) == 100
    for i, (kind, response) in enumerate(results):
        assert response.status_code == 200, (kind, response.text)
        if kind == "digits":
            assert response.json()["digit"] == 7
        elif kind == "iris":
            assert response.json()["class"] == "setosa"
        else:
            assert f"< hi {i} >" in response.text


def test_io_bound_preprocess_does_not_hold_the_process(tmp_path: Path) -> None:
    """20 requests whose preprocess awaits a 200 ms lookup overlap on one runtime."""
    proc, base = serve(tmp_path, name="io")
    try:
        httpx.post(f"{base}/v1/models/enrich/infer", json={"entity": "user-1"}, timeout=30)

        async def many() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(
                    client.post(f"{base}/v1/models/enrich/infer", json={"entity": f"user-{i}"})
                    for i in range(20)))

        responses = asyncio.run(many())
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        most = max(r.json().get("lookups_in_flight_max", 0) for r in responses)
        assert most > 1, "lookups ran one at a time: preprocess held the process"
    finally:
        proc.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_leaves_no_process(tmp_path: Path, sig: int) -> None:
    proc, base = serve(tmp_path, name=f"stop-{sig}")
    httpx.post(f"{base}/v1/models/iris/infer", json={"features": [5.1, 3.5, 1.4, 0.2]},
               timeout=30)
    children = proc.descendants()
    assert children, "serve should have spawned at least one runtime process"
    assert proc.stop(sig, timeout_s=10) == 0, proc.log()
    _gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"left behind: {alive}"


def test_invalid_manifest_stops_start_up_naming_file_and_field(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package = repo / "bad" / "1"
    package.mkdir(parents=True)
    (package / "model.toml").write_text('name = "bad"\nentrypoint = "handler:M"\n'
                                        'accepts = ["video/mp4"]\n')
    proc = Proc(["serve", "--repo", str(repo), "--port", "0"], {}, tmp_path / "bad.log", None)
    assert proc.popen.wait(30) == 2
    log = proc.log()
    assert str(package / "model.toml") in log and "accepts" in log


def test_capacity_limits_are_503_and_507(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, name="tight", env={
        "MODELFLEET_GATEWAY__INLINE_THRESHOLD_BYTES": "1024",
        "MODELFLEET_GATEWAY__PAYLOAD_STORE_BYTES": "3000",
        "MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES": str(512 * 1024),
    })
    try:
        full = httpx.post(f"{base}/v1/models/banner/infer", content=b"x" * 4000,
                          headers={"content-type": "text/plain"}, timeout=30)
        assert full.status_code == 503
        assert full.headers["retry-after"] == "1"
        assert error_of(full)["code"] == "no_capacity"
        # iris's manifest estimates 1 MiB; the whole device budget is 512 KiB.
        too_big = httpx.post(f"{base}/v1/models/iris/infer",
                             json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=30)
        assert too_big.status_code == 507
        message = error_of(too_big)["message"]
        assert "iris" in message and "524288" in message.replace(",", "")
        again = httpx.post(f"{base}/v1/models/iris/infer",
                           json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=30)
        assert again.status_code == 507  # fails at once again, no retry loop
        assert httpx.get(f"{base}/livez").status_code == 200
    finally:
        proc.stop()


def test_large_results_come_back_whole(server: str) -> None:
    """A result of several KiB comes back whole (the embedded broker carries it as is)."""
    text = " ".join(f"w{i}" for i in range(700))  # the banner is ~4 KiB
    response = httpx.post(f"{server}/v1/models/banner/infer", content=text.encode(),
                          headers={"content-type": "text/plain"}, timeout=30)
    assert response.status_code == 200, response.text
    assert len(response.content) > 1024
    assert "w0 " in response.text and "w699" in response.text


def test_worker_is_not_ready_for_cold_work_while_its_loader_is_full_but_live(
        tmp_path: Path) -> None:
    """accepting_cold_work: some runtime has a free load slot. One slot, one slow load."""
    proc, base = serve(tmp_path, name="loading",
                       env={"MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.3",
                            "MODELFLEET_RUNTIME__MAX_CONCURRENT_LOADS": "1",
                            "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.2",
                            "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.3"})
    try:
        async def scenario() -> tuple[list[bool], httpx.Response]:
            seen: list[bool] = []
            async with httpx.AsyncClient(timeout=60) as client:
                slow = asyncio.ensure_future(client.post(
                    f"{base}/v1/models/slowload/infer", json={"v": 1}))
                while not slow.done():
                    workers = (await client.get(f"{base}/v1/fleet")).json()["workers"]
                    if workers and workers[0]["loading"]:
                        seen.append(workers[0]["accepting_cold_work"])
                        assert (await client.get(f"{base}/livez")).status_code == 200
                    await asyncio.sleep(0.1)
                return seen, await slow

        seen, slow = asyncio.run(scenario())
        assert slow.status_code == 200
        assert seen and not any(seen), "a worker whose loader is full must refuse cold work"
    finally:
        proc.stop()


def test_shutdown_drains_in_flight_requests(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, name="drain")

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            pending = asyncio.ensure_future(client.post(
                f"{base}/v1/models/slowload/infer", json={"v": 1}))  # ~3 s: a load
            for _ in range(100):
                workers = (await client.get(f"{base}/v1/fleet")).json()["workers"]
                if workers and workers[0]["permits_in_use"]:
                    break
                await asyncio.sleep(0.1)
            proc.popen.send_signal(signal.SIGTERM)  # mid-request
            return await pending

    response = asyncio.run(scenario())
    assert response.status_code == 200, response.text  # finished, not cut off
    assert response.json() == {"echo": {"v": 1}}
    assert proc.popen.wait(15) == 0
    with pytest.raises(httpx.ConnectError):  # and no longer accepting
        httpx.get(f"{base}/livez", timeout=2)


def test_port_in_use_fails_start_up_clearly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = Proc(["serve", "--port", str(port)], {}, tmp_path / "taken.log", None)
        assert proc.popen.wait(30) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.log()
    assert not proc.descendants()


def test_malformed_payload_urls_do_not_wedge_a_model(server: str) -> None:
    for url in ("http://x:99999/", "http://[::1/", "http://"):
        bad = httpx.post(f"{server}/v1/models/banner/infer", json={"url": url}, timeout=30)
        assert bad.status_code == 400, bad.text
    # More than a prefetch window's worth, and the model still answers.
    for _ in range(20):
        httpx.post(f"{server}/v1/models/banner/infer", json={"url": "http://x:99999/"},
                   timeout=30)
    ok = httpx.post(f"{server}/v1/models/banner/infer", content=b"still here",
                    headers={"content-type": "text/plain"}, timeout=30)
    assert ok.status_code == 200


def test_a_pool_of_shared_runtimes(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, name="pool", env={"MODELFLEET_WORKER__SHARED_RUNTIMES": "2",
                                                   "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.3"})
    try:
        results = asyncio.run(_burst(base))
        assert all(r.status_code == 200 for _, r in results)
        assert len(proc.runtimes()) == 2
        names = {r["name"] for r in httpx.get(f"{base}/v1/fleet").json()["workers"][0]["runtimes"]}
        assert names == {"runtime-0", "runtime-1", "quarantine"}  # quarantine: it stands
    finally:
        proc.stop()


def test_models_added_to_the_repository_are_served_without_a_restart(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "models" / "banner", repo / "banner")
    proc, base = serve(tmp_path, name="refresh", repo=repo,
                       env={"MODELFLEET_REPO_REFRESH_S": "0.3"})
    try:
        assert httpx.post(f"{base}/v1/models/iris/infer", json={"features": [1, 2, 3, 4]},
                          timeout=30).status_code == 404
        shutil.copytree(ROOT / "examples" / "models" / "iris", repo / "iris")
        bad = repo / "typo" / "1"
        bad.mkdir(parents=True)
        (bad / "model.toml").write_text('name = "typo"\nentrypoint = "h:M"\nacepts = []\n')
        def listed() -> list[str]:
            return [m["name"] for m in httpx.get(f"{base}/v1/models").json()["models"]]

        def with_iris() -> list[str] | None:
            names = listed()
            return names if "iris" in names else None

        names = eventually_blocking(with_iris, 30, what="iris listed", every_s=0.2,
                                    state=listed)
        assert names == ["banner", "iris"]  # the invalid one is left out, the rest serve
        iris = httpx.post(f"{base}/v1/models/iris/infer",
                          json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=30)
        assert iris.status_code == 200 and iris.json()["class"] == "setosa"
        assert "acepts" in proc.log()  # the bad manifest was reported, naming the field
        shutil.rmtree(repo / "banner")
        def banner_status() -> int:
            return httpx.post(f"{base}/v1/models/banner/infer", content=b"x",
                              headers={"content-type": "text/plain"}, timeout=30).status_code

        eventually_blocking(lambda: banner_status() == 404, 30, every_s=0.2,
                            what="banner answered 404 once removed", state=banner_status)
    finally:
        proc.stop()
