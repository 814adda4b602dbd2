"""Faults at the gateway's edge, against real processes: slow and broken callers,
too many connections, callers that hang up, smuggling attempts, shutdown with
requests waiting. One bad caller costs one request (or one connection), never the
gateway; every answer that can still be given is JSON.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import re
import select
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import rabbitmq_url, require_rabbitmq
from tests.procs import ROOT, Proc, gateway, metric_sum, serve, worker
from tests.waiting import eventually, eventually_blocking

SEVEN = (ROOT / "examples" / "seven.png").read_bytes()


def address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def read_until_closed(conn: socket.socket, timeout_s: float = 30) -> bytes:
    """Everything the server sends until it closes the connection; fails if it holds it."""
    conn.settimeout(timeout_s)
    answer = b""
    try:
        while chunk := conn.recv(65536):
            answer += chunk
    except TimeoutError:
        raise AssertionError(f"the gateway held the connection open for {timeout_s}s; "
                             f"it had sent {answer!r}") from None
    except ConnectionResetError:
        pass
    return answer


def json_error(answer: bytes) -> tuple[int, dict[str, str], dict[str, str]]:
    """(status, lower-cased headers, the error object) of one raw HTTP answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert headers.get("content-type", "").startswith("application/json"), answer
    error = json.loads(body)["error"]
    assert set(error) == {"code", "message"}, error
    return status, headers, error


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A caller's own image server on loopback; it answers any path with the seven."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(SEVEN)))
            self.end_headers()
            self.wfile.write(SEVEN)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, image_host: str) -> Iterator[tuple[Proc, str]]:
    """A serve with short read timeouts; slowload never finishes loading (requests wait)."""
    proc, base = serve(tmp_path_factory.mktemp("edge"), name="edge", env={
        "MODELFLEET_GATEWAY__HEADER_READ_TIMEOUT_S": "1",
        "MODELFLEET_GATEWAY__BODY_READ_TIMEOUT_S": "2",
        "MODELFLEET_EXAMPLE_SLOWLOAD_S": "600",
        "MODELFLEET_RUNTIME__URL_FETCH_ALLOW": json.dumps([image_host.removeprefix("http://")]),
    })
    yield proc, base
    proc.stop()


# -- read timeouts ------------------------------------------------------------------------

def test_headers_that_never_end_get_408_and_the_connection_is_closed(
        edge: tuple[Proc, str]) -> None:
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n")  # no blank line
        answer = read_until_closed(conn)
    status, _, error = json_error(answer)
    assert (status, error["code"]) == (408, "request_timeout")
    assert metric_sum(base, "modelfleet_gateway_read_timeouts_total", phase="header") >= 1


def test_a_kept_alive_connection_idle_past_the_header_timeout_takes_the_next_request(
        edge: tuple[Proc, str]) -> None:
    """The header read timeout (1 s here) times a request's head from its first byte; an
    idle kept-alive connection is kept for gateway.keep_alive_timeout_s (75 s), longer
    than clients keep theirs: a client reusing it must not race the server closing it."""
    _, base = edge
    host, port = address(base)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/livez")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(1.6)
        conn.request("GET", "/livez")
        answer = conn.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
        assert conn.sock is sock  # the same connection answered
    finally:
        conn.close()


def test_a_body_shorter_than_its_content_length_gets_408(edge: tuple[Proc, str]) -> None:
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 100\r\n\r\nonly ten b")
        answer = read_until_closed(conn)
    status, _, error = json_error(answer)
    assert (status, error["code"]) == (408, "request_timeout")
    assert "body did not arrive within 2 s" in error["message"]
    assert metric_sum(base, "modelfleet_gateway_requests_total", model="banner",
                      status="408") >= 1


def test_a_body_trickled_byte_by_byte_is_cut_off(edge: tuple[Proc, str]) -> None:
    """The body timeout covers the whole body: a byte every 0.2 s does not keep it open."""
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        answer, closed = b"", False
        give_up = time.monotonic() + 30
        while not closed and time.monotonic() < give_up:
            try:
                conn.sendall(b"x")
                readable, _, _ = select.select([conn], [], [], 0.2)
                if readable:
                    chunk = conn.recv(65536)
                    answer += chunk
                    closed = not chunk
            except (BrokenPipeError, ConnectionResetError):
                closed = True
    assert closed, f"a trickled body held the connection for 30 s; got {answer!r}"
    if answer:  # the 408 can be lost to a reset while the caller is still sending
        assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_body_nobody_reads_does_not_hold_the_connection(edge: tuple[Proc, str]) -> None:
    """An answer that needs no body (unknown model: 404) comes at once; a body still
    trickling in after it is cut off too, a little after the body timeout."""
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/nope/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        answer, closed = b"", False
        give_up = time.monotonic() + 60
        while not closed and time.monotonic() < give_up:
            try:
                conn.sendall(b"x")
                readable, _, _ = select.select([conn], [], [], 0.2)
                if readable:
                    chunk = conn.recv(65536)
                    answer += chunk
                    closed = not chunk
            except (BrokenPipeError, ConnectionResetError):
                closed = True
    assert answer.startswith(b"HTTP/1.1 404"), answer
    assert closed, "a body nobody reads held the connection for 60 s"


def test_an_unparseable_request_gets_a_json_400(edge: tuple[Proc, str]) -> None:
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        answer = read_until_closed(conn)
    status, _, error = json_error(answer)
    assert (status, error["code"]) == (400, "bad_request")


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 100_000 + b"\r\n",  # one 100 KB header
    b"".join(b"X-H%d: v\r\n" % i for i in range(2000)),  # 2,000 small ones
])
def test_a_header_block_over_the_limit_is_431_however_it_arrives(edge: tuple[Proc, str],
                                                                 head: bytes) -> None:
    """In one read (the whole head complete at once) as in many: the same limit."""
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 2\r\n" + head +
                     b"\r\nhi")
        answer = read_until_closed(conn)
    status, headers, error = json_error(answer)
    assert (status, error["code"]) == (431, "request_header_fields_too_large")
    assert headers.get("connection") == "close"
    ok = httpx.post(f"{base}/v1/models/banner/infer", content=b"hi", timeout=30,
                    headers={"content-type": "text/plain", **{f"x-h{i}": "v" for i in range(20)}})
    assert ok.status_code == 200  # a normal head is untouched


def test_a_compressed_v1_body_reaches_the_model_inflated(edge: tuple[Proc, str]) -> None:
    import gzip
    import zlib

    _, base = edge
    for encoding, packed in (("gzip", gzip.compress(b"hello")),
                             ("deflate", zlib.compress(b"hello"))):
        answer = httpx.post(f"{base}/v1/models/banner/infer", content=packed, timeout=30,
                            headers={"content-type": "text/plain",
                                     "content-encoding": encoding})
        plain = httpx.post(f"{base}/v1/models/banner/infer", content=b"hello", timeout=30,
                           headers={"content-type": "text/plain"})
        assert answer.status_code == 200 and answer.content == plain.content, encoding
        assert b"hello" in answer.content
    broken = httpx.post(f"{base}/v1/models/banner/infer", content=b"not gzip", timeout=30,
                        headers={"content-type": "text/plain", "content-encoding": "gzip"})
    assert broken.status_code == 400 and "gzip" in broken.json()["error"]["message"]
    bomb = gzip.compress(b"\0" * (30 * 1024 * 1024))  # past the 20 MiB body limit inflated
    refused = httpx.post(f"{base}/v1/models/banner/infer", content=bomb, timeout=30,
                         headers={"content-type": "text/plain", "content-encoding": "gzip"})
    assert refused.status_code == 413


def test_timeout_header_accepts_plain_decimal_seconds_only(edge: tuple[Proc, str]) -> None:
    _, base = edge
    for value in ("1_0", "1e1", "+5", "0x10", "infinity", "nan", ".", "-0", "0", "1.2.3"):
        response = httpx.post(f"{base}/v1/models/banner/infer", content=b"hi",
                              headers={"content-type": "text/plain",
                                       "x-request-timeout": value}, timeout=30)
        assert response.status_code == 400, (value, response.text)
        assert response.json()["error"]["code"] == "bad_request"
    for value in ("10", "2.5", "0.75", ".5", "7."):
        response = httpx.post(f"{base}/v1/models/banner/infer", content=b"hi",
                              headers={"content-type": "text/plain",
                                       "x-request-timeout": value}, timeout=30)
        assert response.status_code == 200, (value, response.text)


def test_content_length_with_transfer_encoding_is_refused(edge: tuple[Proc, str]) -> None:
    """Both framings at once is how requests are smuggled past a proxy: 400, closed."""
    _, base = edge
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n0\r\n\r\n")
        answer = read_until_closed(conn)
    status, headers, error = json_error(answer)
    assert (status, error["code"]) == (400, "bad_request")
    assert "Transfer-Encoding" in error["message"]
    assert headers.get("connection") == "close"


# -- chunked bodies -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def patient_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A serve whose body read timeout (30 s) is far longer than any answer below takes."""
    proc, base = serve(tmp_path_factory.mktemp("patient"), name="patient", env={
        "MODELFLEET_GATEWAY__BODY_READ_TIMEOUT_S": "30"})
    yield base
    proc.stop()


def chunked_answer(base: str, path: str, body: bytes) -> tuple[float, int, object]:
    """Send a chunked request's head and the start of its ``body``, then nothing more:
    (seconds until the gateway answered and closed, status, the body's "error")."""
    with socket.create_connection(address(base), timeout=10) as conn:
        started = time.monotonic()
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode() + body)
        answer = read_until_closed(conn, timeout_s=25)
        took = time.monotonic() - started
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer
    return took, int(head.split()[1]), json.loads(payload)["error"]


@pytest.mark.parametrize("body", [
    b"FFFFFFFFFFFFFFFFFFFF\r\nabc",  # 2**80 - 1 bytes: h11 takes it and would wait for them
    b"zz\r\nabc",  # not hex at all
])
@pytest.mark.parametrize("path", ["/v1/models/banner/infer", "/v2/models/banner/infer"])
def test_a_malformed_chunk_size_is_400_at_once_in_the_paths_dialect(
        patient_edge: str, path: str, body: bytes) -> None:
    """Answered when the size line is read, not at the 30 s body timeout."""
    base = patient_edge
    refused = metric_sum(base, "modelfleet_gateway_requests_total", model="banner",
                         status="400")
    took, status, error = chunked_answer(base, path, body)
    assert status == 400
    if path.startswith("/v2"):
        assert isinstance(error, str) and "malformed HTTP request" in error
    else:
        assert isinstance(error, dict) and error["code"] == "bad_request", error
        assert "malformed HTTP request" in error["message"]
    assert took < 10, f"answered after {took:.1f} s, as if it waited for the body"
    # Counted as what it was, not as a caller that hung up.
    eventually_blocking(lambda: metric_sum(base, "modelfleet_gateway_requests_total",
                                           model="banner", status="400") >= refused + 1)


@pytest.mark.parametrize("path", ["/v1/models/banner/infer", "/v2/models/banner/infer"])
def test_a_chunk_past_the_body_limit_is_413_at_once(patient_edge: str, path: str) -> None:
    took, status, error = chunked_answer(patient_edge, path,
                                         b"%x\r\nabc" % (20 * 1024 * 1024 + 1))
    assert status == 413, error
    message = error if path.startswith("/v2") else error["message"]  # type: ignore[index]
    assert "the limit is 20971520" in str(message), error
    assert took < 10, f"answered after {took:.1f} s, as if it waited for the body"
    ok = httpx.post(f"{patient_edge}{path.replace('/v2/', '/v1/')}", timeout=30,
                    content=iter([b"hello ", b"chunks"]),  # chunked, within the limit
                    headers={"content-type": "text/plain"})
    assert ok.status_code == 200 and b"hello chunks" in ok.content, ok.text


# -- callers that hang up -----------------------------------------------------------------

def test_a_caller_hanging_up_mid_upload_is_a_disconnect_not_a_500(
        edge: tuple[Proc, str]) -> None:
    proc, base = edge
    disconnects = metric_sum(base, "modelfleet_gateway_client_disconnects_total")
    errors = metric_sum(base, "modelfleet_gateway_requests_total", status="500")
    log_start = len(proc.log())
    for _ in range(3):
        with socket.create_connection(address(base), timeout=10) as conn:
            conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
                         + b"x" * 1000)
    eventually_blocking(lambda: metric_sum(base, "modelfleet_gateway_client_disconnects_total")
             >= disconnects + 3)
    assert metric_sum(base, "modelfleet_gateway_requests_total", status="500") == errors
    assert metric_sum(base, "modelfleet_gateway_requests_total", model="banner",
                      status="499") >= 3
    log = proc.log()[log_start:]
    assert "Traceback" not in log and " ERROR " not in log, log
    lines = [line for line in log.splitlines() if "hung up" in line]
    assert len(lines) >= 3 and all(" INFO " in line for line in lines), log


def test_a_caller_hanging_up_while_waiting_frees_the_gateway_and_is_counted(
        edge: tuple[Proc, str]) -> None:
    _, base = edge
    disconnects = metric_sum(base, "modelfleet_gateway_client_disconnects_total")
    parked = metric_sum(base, "modelfleet_gateway_parked_requests")
    with socket.create_connection(address(base), timeout=10) as conn:
        conn.sendall(b"POST /v1/models/slowload/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        eventually_blocking(lambda: metric_sum(base, "modelfleet_gateway_parked_requests") > parked)
    eventually_blocking(lambda: metric_sum(base, "modelfleet_gateway_client_disconnects_total")
             >= disconnects + 1)
    eventually_blocking(lambda: metric_sum(base, "modelfleet_gateway_parked_requests") <= parked)


# -- payload URLs -------------------------------------------------------------------------

def test_an_allowed_host_is_allowed_on_its_listed_port_only(edge: tuple[Proc, str],
                                                            image_host: str) -> None:
    _, base = edge
    ok = httpx.post(f"{base}/v1/models/digits/infer",
                    json={"url": f"{image_host}/seven.png"}, timeout=30)
    assert ok.status_code == 200, ok.text
    # The same loopback host, another port: the gateway's own metrics.
    own = httpx.post(f"{base}/v1/models/digits/infer",
                     json={"url": f"{base}/metrics"},
                     timeout=30)
    assert own.status_code == 400, own.text
    error = own.json()["error"]
    assert error["code"] == "payload_fetch_forbidden"
    assert not re.search(r"\d{4,} bytes", error["message"]), error


# -- too many connections -----------------------------------------------------------------

def test_connections_beyond_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    """200 connections that trickle headers against a cap of 40: the 160 over the cap get
    a JSON 503 and are closed without waiting for any timeout; the 40 are held (up to the
    header timeout), and a caller over the cap is told to retry, not queued."""
    proc, base = serve(tmp_path, name="capped", env={
        "MODELFLEET_GATEWAY__MAX_CONNECTIONS": "40",
        "MODELFLEET_GATEWAY__HEADER_READ_TIMEOUT_S": "60",
    })
    held: list[socket.socket] = []
    try:
        for _ in range(200):
            conn = socket.create_connection(address(base), timeout=10)
            conn.sendall(b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n")
            held.append(conn)
        refused = []
        give_up = time.monotonic() + 60
        while len(refused) < 160 and time.monotonic() < give_up:
            readable, _, _ = select.select([c for c in held if c not in refused], [], [], 1)
            for conn in readable:
                answer = read_until_closed(conn, 30)
                status, headers, error = json_error(answer)
                assert (status, error["code"]) == (503, "too_many_connections"), answer
                assert headers.get("retry-after") == "1"
                refused.append(conn)
        assert len(refused) == 160, f"{len(refused)} of 160 over the cap were refused"
        # A whole request over the cap is answered too, not held.
        over = httpx.post(f"{base}/v1/models/banner/infer", content=b"hi",
                          headers={"content-type": "text/plain"}, timeout=30)
        assert over.status_code == 503 and over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "too_many_connections"
        for conn in held:
            conn.close()
        held.clear()

        def served() -> bool:
            return httpx.post(f"{base}/v1/models/banner/infer", content=b"hi",
                              headers={"content-type": "text/plain"},
                              timeout=30).status_code == 200

        eventually_blocking(served)  # the held ones are gone: room again
        assert metric_sum(base, "modelfleet_gateway_connections_refused_total") >= 161
    finally:
        for conn in held:
            conn.close()
        proc.stop()


def test_over_the_cap_a_new_connection_takes_the_place_of_an_idle_kept_alive_one(
        tmp_path: Path) -> None:
    """Callers that keep connections alive do not lock new callers out: at the cap, the
    connection idle longest is closed for a new one; the busy ones are left alone."""
    proc, base = serve(tmp_path, name="idlecap", env={"MODELFLEET_GATEWAY__MAX_CONNECTIONS": "2"})
    host, port = address(base)
    kept = [http.client.HTTPConnection(host, port, timeout=10) for _ in range(2)]
    try:
        for conn in kept:  # both answered, both kept alive and idle
            conn.request("GET", "/livez")
            assert conn.getresponse().read()
        fresh = httpx.get(f"{base}/livez", timeout=10)
        assert fresh.status_code == 200, fresh.text
        assert metric_sum(base, "modelfleet_gateway_idle_connections_closed_total") >= 1
        assert metric_sum(base, "modelfleet_gateway_connections_refused_total") == 0
        # The oldest idle one was closed (the server said so: end of stream).
        oldest = kept[0].sock
        assert oldest is not None
        oldest.settimeout(10)
        assert oldest.recv(1) == b""
    finally:
        for conn in kept:
            conn.close()
        proc.stop()


# -- shutdown -----------------------------------------------------------------------------

def _names(tag: str) -> dict[str, str]:
    return {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
            "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
            "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters"}


@pytest.mark.parametrize("deployment",
                         ["serve", pytest.param("gateway", marks=pytest.mark.rabbitmq)])
def test_shutdown_answers_waiting_requests_in_json_after_readiness_flips(
        tmp_path: Path, deployment: str) -> None:
    """SIGTERM with requests waiting on a load that outlasts the drain: readiness says 503
    first, new work is refused with 503 shutting_down, and each waiting caller gets a JSON
    503 shutting_down with Retry-After at the drain limit (never uvicorn's plain-text 500)."""
    env = {"MODELFLEET_EXAMPLE_SLOWLOAD_S": "600", "MODELFLEET_GATEWAY__DRAIN_TIMEOUT_S": "3"}
    others: list[Proc] = []
    if deployment == "serve":
        proc, base = serve(tmp_path, env=env, name="drain")
    else:
        require_rabbitmq()
        env.update(_names(f"drain{uuid.uuid4().hex[:8]}"))
        others.append(worker(tmp_path, rabbitmq_url(), env, "w-drain")[0])
        proc, base = gateway(tmp_path, rabbitmq_url(), env, "gw-drain")

    async def scenario() -> tuple[list[httpx.Response], list[int | None],
                                  httpx.Response | None]:
        async with httpx.AsyncClient(timeout=60) as client:
            waiting = [asyncio.ensure_future(client.post(
                f"{base}/v1/models/slowload/infer", json={"v": i},
                headers={"x-request-timeout": "90"})) for i in range(4)]
            for _ in range(300):
                text = (await client.get(f"{base}/metrics")).text
                if "modelfleet_gateway_parked_requests 4.0" in text:
                    break
                await asyncio.sleep(0.1)
            proc.popen.send_signal(signal.SIGTERM)
            readiness: list[int | None] = []
            refused = None
            while not all(w.done() for w in waiting):
                try:
                    async with httpx.AsyncClient(timeout=5) as fresh:  # a new connection
                        readiness.append((await fresh.get(f"{base}/readyz")).status_code)
                        if readiness[-1] == 503 and refused is None:
                            refused = await fresh.post(f"{base}/v1/models/banner/infer",
                                                       content=b"hi",
                                                       headers={"content-type": "text/plain"})
                except httpx.TransportError:
                    readiness.append(None)
                await asyncio.sleep(0.05)
            return await asyncio.gather(*waiting), readiness, refused

    try:
        answers, readiness, refused = asyncio.run(scenario())
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.headers["content-type"].startswith("application/json"), answer.text
            assert answer.json()["error"]["code"] == "shutting_down"
            assert answer.headers["retry-after"]
        assert 503 in readiness and refused is not None, f"readiness said {readiness}"
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert proc.popen.wait(60) == 0, proc.log()
        assert "Exception in ASGI application" not in proc.log()
    finally:
        proc.stop()
        for other in others:
            other.stop()


# -- secrets ------------------------------------------------------------------------------

SIGNATURE = re.compile(r"sig=[0-9a-f]{8}")


def test_no_secret_is_logged_at_debug_by_serve(tmp_path: Path, image_host: str) -> None:
    """A large payload travels by signed URL; a caller's URL carries its own token. At
    DEBUG, neither signature nor token nor the signing key reaches the log."""
    proc, base = serve(tmp_path, name="secrets", env={
        "MODELFLEET_LOG_LEVEL": "debug",
        "MODELFLEET_SECRET": "hmac-key-d3adb33f",
        "MODELFLEET_GATEWAY__INLINE_THRESHOLD_BYTES": "1024",
        "MODELFLEET_RUNTIME__URL_FETCH_ALLOW": json.dumps([image_host.removeprefix("http://")]),
    })
    try:
        large = httpx.post(f"{base}/v1/models/digits/infer", content=SEVEN + b"\0" * 4096,
                           headers={"content-type": "image/png"}, timeout=60)
        assert large.status_code == 200, large.text
        assert metric_sum(base, "modelfleet_gateway_payload_fetches_total", outcome="ok") == 1
        by_url = httpx.post(f"{base}/v1/models/digits/infer",
                            json={"url": f"{image_host}/seven.png?token=caller-t0ken-77"},
                            timeout=60)
        assert by_url.status_code == 200, by_url.text
    finally:
        proc.stop()
    log = proc.log()
    assert " DEBUG " in log  # the level took effect
    for secret in ("hmac-key-d3adb33f", "caller-t0ken-77"):
        assert secret not in log, _around(log, secret)
    assert not SIGNATURE.search(log), _around(log, SIGNATURE.search(log).group())  # type: ignore[union-attr]


@pytest.mark.rabbitmq
def test_no_secret_is_logged_at_debug_by_gateway_and_worker_on_rabbitmq(
        tmp_path: Path) -> None:
    """The broker password (written %-encoded, so any copy of the raw URL stands out),
    signed payload URLs and the signing key stay out of both processes' DEBUG logs."""
    require_rabbitmq()
    url = rabbitmq_url().replace("guest:guest@", "guest:%67uest@")
    assert "%67uest" in url, "this test needs the guest user's URL"
    env = {"MODELFLEET_LOG_LEVEL": "debug", "MODELFLEET_SECRET": "hmac-key-d3adb33f",
           "MODELFLEET_GATEWAY__INLINE_THRESHOLD_BYTES": "1024",
           **_names(f"secret{uuid.uuid4().hex[:8]}")}
    work, _ = worker(tmp_path, url, env, "w-secrets")
    try:
        gw, base = gateway(tmp_path, url, env, "gw-secrets")
        try:
            large = httpx.post(f"{base}/v1/models/digits/infer", content=SEVEN + b"\0" * 4096,
                               headers={"content-type": "image/png"}, timeout=60)
            assert large.status_code == 200, large.text
        finally:
            gw.stop()
    finally:
        work.stop()
    for proc in (gw, work):
        log = proc.log()
        assert " DEBUG " in log
        for secret in ("%67uest", "guest:guest", ":guest@", "hmac-key-d3adb33f"):
            assert secret not in log, _around(log, secret)
        match = SIGNATURE.search(log)
        assert match is None, _around(log, match.group() if match else "")


def _around(log: str, needle: str) -> str:
    at = log.find(needle)
    return log[max(0, at - 300):at + 300]


# -- cancel signal ------------------------------------------------------------------------

@pytest.mark.rabbitmq
def test_a_caller_hanging_up_publishes_a_cancel_event(tmp_path: Path) -> None:
    """What the worker can act on: ``{"kind": "cancel", "request_id", "model_id"}``."""
    require_rabbitmq()
    from modelfleet.broker.rabbitmq.broker import AmqpBroker
    from modelfleet.settings import BrokerSettings

    tag = f"cancel{uuid.uuid4().hex[:8]}"
    names = _names(tag)
    proc, base = serve(tmp_path, name="cancel", broker=rabbitmq_url(),
                       env={"MODELFLEET_EXAMPLE_SLOWLOAD_S": "600", **names})

    async def scenario() -> dict[str, Any]:
        listener = AmqpBroker(BrokerSettings(url=rabbitmq_url(), queue_prefix=f"{tag}."),
                              events_exchange=f"{tag}.events",
                              dead_letter_queue=f"{tag}.dead-letters")
        await listener.connect()
        try:
            events = listener.events()
            # Bound once it hears anything (the worker announces its state every second).
            async with asyncio.timeout(30):
                await anext(events)
            _, writer = await asyncio.open_connection(*address(base))
            writer.write(b"POST /v1/models/slowload/infer HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            await eventually(
                lambda: metric_sum(base, "modelfleet_gateway_parked_requests") >= 1, 30,
                what="the request parked", every_s=0.1)
            writer.close()
            async with asyncio.timeout(30):
                event = await anext(events)
                while event.get("kind") != "cancel":
                    event = await anext(events)
            return event
        finally:
            await listener.close()

    try:
        event = asyncio.run(scenario())
        assert event["model_id"] == "slowload"
        assert re.fullmatch(r"[0-9a-f]{32}", event["request_id"])
        assert event["reason"] == "client_disconnected"
    finally:
        proc.stop()
