"""Control orders outlive every process: ``serve`` stopped (or killed) and started again
with the same database still refuses a model an operator unloaded, until it is loaded
again, and still keeps a pinned model preloaded. On RabbitMQ, a gateway and a worker
both restarted at once: the same.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import rabbitmq_url, require_rabbitmq
from tests.e2e.test_control import FAST, add_version, control, infer
from tests.procs import Proc, gateway, serve, worker
from tests.waiting import eventually_blocking


def index(base: str) -> dict[str, dict[str, object]]:
    rows = httpx.post(f"{base}/v2/repository/index", timeout=10).json()
    return {row["name"]: row for row in rows}


def pinned_on(base: str, model: str) -> dict[str, list[str]]:
    return index(base)[model]["pinned_on"]  # type: ignore[return-value]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    add_version(root, "m", "1")
    add_version(root, "p", "1")
    return root


def test_serve_keeps_unload_and_pin_across_restarts(tmp_path: Path, repo: Path) -> None:
    env = {**FAST, "MODELFLEET_DLQ_DB": str(tmp_path / "deployment.sqlite3")}

    def start(name: str) -> tuple[Proc, str]:
        return serve(tmp_path, env=env, name=name, repo=repo)

    proc, base = start("serve-1")
    try:
        assert infer(base, "m").status_code == 200
        assert control(base, "m", "unload").status_code == 200
        assert control(base, "p", "pin").status_code == 200
        assert infer(base, "m").status_code == 503
    finally:
        proc.stop()

    proc, base = start("serve-2")  # the same database: the orders are read back
    try:
        refused = infer(base, "m")  # the very first request obeys the unload
        assert refused.status_code == 503, refused.text
        assert "unloaded" in refused.json()["error"]["message"]
        rows = index(base)
        assert rows["m"]["state"] == "UNAVAILABLE" and rows["p"]["pinned"] is True
        eventually_blocking(lambda: pinned_on(base, "p"),
                            what="p preloaded and pinned after restart")
        assert "control: 2 model(s) have orders kept" in proc.log()
        assert control(base, "m", "load").status_code == 200
        assert infer(base, "m").status_code == 200
    finally:
        proc.kill()  # not even a clean shutdown: each order was kept when it was given

    proc, base = start("serve-3")
    try:
        assert infer(base, "m").status_code == 200  # the load superseded the unload
        eventually_blocking(lambda: pinned_on(base, "p"), what="p still pinned")
        assert control(base, "p", "unpin").status_code == 200
    finally:
        proc.stop()

    proc, base = start("serve-4")
    try:
        assert index(base)["p"]["pinned"] is False
        assert infer(base, "m").status_code == 200
    finally:
        proc.stop()


def test_serve_refuses_to_start_when_the_database_cannot_be_opened(tmp_path: Path,
                                                                   repo: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = Proc(["serve", "--repo", str(repo), "--port", "0"],
                {"MODELFLEET_DLQ_DB": str(tmp_path / "file" / "d.sqlite3")},
                tmp_path / "bad.log", None)
    try:
        assert proc.popen.wait(60) != 0
        assert "cannot open the control orders' database" in proc.log()
    finally:
        proc.kill()


@pytest.mark.rabbitmq
def test_gateway_and_worker_restarted_together_keep_the_orders(tmp_path: Path,
                                                              repo: Path) -> None:
    require_rabbitmq()
    tag = f"co{uuid.uuid4().hex[:8]}"
    env = {**FAST, "MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
           "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
           "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters",
           "MODELFLEET_TENANCY__DB": str(tmp_path / "db.sqlite3")}
    url = rabbitmq_url()
    w, _ = worker(tmp_path, url, env, "w1", repo=repo)
    gw, base = gateway(tmp_path, url, env, "gw-1", repo=repo)
    try:
        eventually_blocking(lambda: infer(base, "m").status_code == 200, what="m served")
        assert control(base, "m", "unload").status_code == 200
        assert control(base, "p", "pin").status_code == 200
    finally:
        gw.kill()
        w.kill()
    w, _ = worker(tmp_path, url, env, "w1b", repo=repo)
    gw, base = gateway(tmp_path, url, env, "gw-2", repo=repo)
    try:
        assert infer(base, "m").status_code == 503
        # the worker started with no orders; the gateway told it the kept ones
        eventually_blocking(lambda: pinned_on(base, "p") == {"w1b": ["1"]}, what="p pinned on w1b")
    finally:
        gw.stop()
        w.stop()
