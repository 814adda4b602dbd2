"""The model control API end to end: real processes, both brokers, several workers.

load answers when warm; unload refuses (on every gateway, one started later too) until
load restores; a pin survives memory pressure; rolling a new version in causes no cold
request, and a version that fails to load never takes the route.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
from tests.waiting import eventually_blocking

MiB = 1024 * 1024
FAST = {"MODELFLEET_WORKER__STATE_INTERVAL_S": "0.3",
        "MODELFLEET_CONTROL__ANNOUNCE_INTERVAL_S": "0.3",
        "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.3",
        "MODELFLEET_CONTROL__DRAIN_S": "2"}

HANDLER = '''\
import time

from modelfleet import Model


class Versioned(Model):
    """Answers with its version; loads in LOAD_S seconds; FAIL: its load raises."""

    def load(self, ctx):
        time.sleep({load_s})
        if {fail}:
            raise RuntimeError("version {version} of {name} is broken")
        self.version = ctx.version

    def memory_bytes(self):
        return {size}

    def predict(self, batch):
        return [{{"model": "{name}", "version": self.version}} for _ in batch]
'''


def add_version(root: Path, name: str, version: str, load_s: float = 1.0,
                fail: bool = False, size: int = MiB, max_workers: int = 2,
                pinned: bool = False) -> None:
    folder = root / name / version
    staging = root.parent / f".staging-{name}-{version}"
    staging.mkdir(parents=True)
    (staging / "model.toml").write_text(textwrap.dedent(f"""\
        name = "{name}"
        version = "{version}"
        entrypoint = "handler:Versioned"
        accepts = ["application/json"]
        device = "cpu"
        memory_estimate_mb = {max(1, size // MiB)}
        timeout_s = 30
        [fanout]
        max_workers = {max_workers}
        pinned = {"true" if pinned else "false"}
        """))
    (staging / "handler.py").write_text(HANDLER.format(load_s=load_s, fail=fail, size=size,
                                                       name=name, version=version))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(folder)  # whole at once: a refresh never sees half a package


def infer(base: str, model: str, timeout_s: float = 30) -> httpx.Response:
    return httpx.post(f"{base}/v1/models/{model}/infer", json={}, timeout=timeout_s)


def control(base: str, model: str, action: str, timeout_s: float = 120,
            **parameters: Any) -> httpx.Response:
    return httpx.post(f"{base}/v2/repository/models/{model}/{action}",
                      json={"parameters": parameters} if parameters else None,
                      timeout=timeout_s)


def workers_holding(base: str, model: str) -> list[str]:
    return [w["worker_id"] for w in httpx.get(f"{base}/v1/fleet").json()["workers"]
            if model in {*w["resident"]["device"], *w["resident"]["host"]}]


class Traffic:
    """Requests sent back to back from a thread, every answer kept."""

    def __init__(self, base: str, model: str) -> None:
        self.answers: list[tuple[int, str, str]] = []  # (status, X-Model-Cold, version)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base, model), daemon=True)

    def _run(self, base: str, model: str) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                r = client.post(f"{base}/v1/models/{model}/infer", json={})
                version = r.json().get("version", "") if r.status_code == 200 else r.text
                self.answers.append((r.status_code, r.headers.get("x-model-cold", ""),
                                     version))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def versions(self) -> list[str]:
        return [v for _, _, v in self.answers]


# -- embedded broker: modelfleet serve -------------------------------------------------------
@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    return root


@pytest.fixture
def served(tmp_path: Path, repo: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    extra: dict[str, str] = getattr(request, "param", {})
    proc, base = serve(tmp_path, repo=repo, env={**FAST, "MODELFLEET_REPO_REFRESH_S": "0.5",
                                                 **extra})
    try:
        yield base
    finally:
        proc.stop()


@pytest.fixture
def versioned(repo: Path) -> Path:
    add_version(repo, "m", "1")
    return repo


def test_load_answers_once_warm_and_the_next_request_is_warm(versioned: Path,
                                                             served: str) -> None:
    r = control(served, "m", "load")
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "1" and len(r.json()["warm_on"]) == 1
    first = infer(served, "m")
    assert first.status_code == 200 and first.headers["x-model-cold"] == "0"
    index = httpx.post(f"{served}/v2/repository/index", timeout=10).json()
    assert index[0]["name"] == "m" and index[0]["state"] == "READY"
    assert metric_sum(served, "modelfleet_control_commands_total", action="load",
                      outcome="ok") == 1


def test_load_errors_say_why(versioned: Path, repo: Path, served: str) -> None:
    add_version(repo, "bad", "1", fail=True)
    eventually_blocking(lambda: httpx.get(f"{served}/v1/models/bad").status_code == 200,
                        what="refresh")
    r = control(served, "bad", "load")
    assert r.status_code == 500 and "version 1 of bad is broken" in r.json()["error"]
    assert control(served, "nope", "load").status_code == 404
    assert control(served, "m", "load", workers=5).status_code == 503  # one worker here
    assert control(served, "m", "load", workers=0).status_code == 400
    assert control(served, "m", "load", version="7").status_code == 404
    # A config that says something else than model.toml: refused, each field named.
    config = control(served, "m", "load", config='{"max_batch_size": 64}')
    assert config.status_code == 400 and "model.toml" in config.json()["error"]
    assert "max_batch_size" in config.json()["error"]
    assert control(served, "m", "load", config="{not json").status_code == 400
    assert control(served, "m", "load", config='{"name": "other"}').status_code == 400
    for action in ("unload", "pin", "unpin"):
        missing = control(served, "nope", action)
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
    for path, body in (("models/m/load", b"{not json"), ("models/m/load", b"[1]"),
                       ("models/m/load", b'{"parameters": 3}'), ("index", b'{"ready": "yes"}')):
        bad = httpx.post(f"{served}/v2/repository/{path}", content=body, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"], (path, bad.text)
    assert infer(served, "m").status_code == 200  # none of it changed anything


def test_unload_refuses_until_load_restores(versioned: Path, served: str) -> None:
    assert infer(served, "m").status_code == 200
    eventually_blocking(lambda: workers_holding(served, "m"), what="m resident")
    r = control(served, "m", "unload")
    assert r.status_code == 200, r.text
    refused = infer(served, "m")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "model_unavailable"
    assert "unloaded" in refused.json()["error"]["message"]
    eventually_blocking(lambda: not workers_holding(served, "m"), what="m dropped")
    index = httpx.post(f"{served}/v2/repository/index", json={"ready": True}).json()
    assert index == []
    assert control(served, "m", "load").status_code == 200
    again = infer(served, "m")
    assert again.status_code == 200 and again.headers["x-model-cold"] == "0"


@pytest.mark.parametrize("served", [{"MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES": str(100 * MiB),
                                     "MODELFLEET_RUNTIME__HOST_BUDGET_BYTES": "0"}],
                         indirect=True)
def test_a_pin_survives_memory_pressure_and_unpin_lets_it_go(repo: Path, served: str) -> None:
    for name in ("p", "a", "b", "c"):
        add_version(repo, name, "1", load_s=0.2, size=40 * MiB)  # two fit the budget
    eventually_blocking(lambda: httpx.get(f"{served}/v1/models/c").status_code == 200,
                        what="refresh")
    r = control(served, "p", "pin")
    assert r.status_code == 200, r.text
    for _ in range(2):
        for name in ("a", "b", "c"):
            assert infer(served, name).status_code == 200
    pinned = infer(served, "p")
    assert pinned.status_code == 200 and pinned.headers["x-model-cold"] == "0"
    assert control(served, "p", "unpin").status_code == 200

    def pressed_out() -> bool:
        for name in ("a", "b", "c"):  # evictions age what is not used: p, once unpinned
            assert infer(served, name).status_code == 200
        return not workers_holding(served, "p")

    eventually_blocking(pressed_out, what="p evicted once unpinned")


def test_a_new_version_rolls_in_without_a_cold_request(versioned: Path, repo: Path,
                                                       served: str) -> None:
    assert infer(served, "m").json()["version"] == "1"
    with Traffic(served, "m") as traffic:
        eventually_blocking(lambda: len(traffic.answers) >= 5, what="traffic")
        add_version(repo, "m", "2", load_s=2.0)
        eventually_blocking(lambda: traffic.versions()[-5:] == ["2"] * 5, what="only version 2")
    assert all(status == 200 for status, _, _ in traffic.answers), traffic.answers
    assert [cold for _, cold, _ in traffic.answers] == ["0"] * len(traffic.answers)
    versions = traffic.versions()
    switch = versions.index("2")
    assert set(versions[:switch]) == {"1"} and set(versions[switch:]) == {"2"}
    assert metric_sum(served, "modelfleet_worker_version_changes_total", action="warm") == 1
    eventually_blocking(lambda: metric_sum(served, "modelfleet_worker_version_changes_total",
                                action="release") == 1, what="version 1 released")


def test_a_pinned_model_rolls_to_its_new_version_and_the_old_pin_goes(repo: Path,
                                                                      served: str) -> None:
    add_version(repo, "p", "1", pinned=True)

    def row() -> dict[str, Any]:
        return next((r for r in httpx.post(f"{served}/v2/repository/index",
                                           timeout=10).json() if r["name"] == "p"),
                    {"pinned_on": {}, "versions_on": {}})

    eventually_blocking(lambda: list(row()["pinned_on"].values()) == [["1"]],
                        what="p@1 pinned, unasked")
    with Traffic(served, "p") as traffic:
        eventually_blocking(lambda: len(traffic.answers) >= 5, what="traffic")
        add_version(repo, "p", "2", load_s=2.0, pinned=True)
        eventually_blocking(lambda: traffic.versions()[-5:] == ["2"] * 5, what="only version 2")
    assert [cold for _, cold, _ in traffic.answers] == ["0"] * len(traffic.answers)
    # One pin, on the version the route serves: not ['1', '2'] for good (the leak).
    eventually_blocking(lambda: list(row()["pinned_on"].values()) == [["2"]]
             and list(row()["versions_on"].values()) == [["2"]], what="p@1 released")


def test_a_load_naming_a_version_rolls_it_in_without_a_cold_request(repo: Path,
                                                                    served: str) -> None:
    add_version(repo, "v", "1")
    add_version(repo, "v", "2", load_s=2.0)
    eventually_blocking(lambda: httpx.get(f"{served}/v1/models/v").status_code == 200,
                        what="refresh")
    first = control(served, "v", "load", version="1")  # the route held on version 1
    assert first.status_code == 200 and first.json()["version"] == "1", first.text
    with Traffic(served, "v") as traffic:
        eventually_blocking(lambda: len(traffic.answers) >= 5, what="traffic")
        second = control(served, "v", "load", version="2")
        assert second.status_code == 200 and second.json()["version"] == "2", second.text
        eventually_blocking(lambda: traffic.versions()[-5:] == ["2"] * 5, what="only version 2")
    assert all(status == 200 for status, _, _ in traffic.answers), traffic.answers
    assert [cold for _, cold, _ in traffic.answers] == ["0"] * len(traffic.answers)
    index = httpx.post(f"{served}/v2/repository/index", timeout=10).json()
    assert [(r["name"], r["version"]) for r in index] == [("v", "2")]


def test_a_version_that_fails_to_load_never_takes_the_route(versioned: Path, repo: Path,
                                                            served: str) -> None:
    assert infer(served, "m").json()["version"] == "1"
    add_version(repo, "m", "2", load_s=0.2, fail=True)
    eventually_blocking(lambda: "2" in httpx.get(f"{served}/v1/models/m").json()["versions"],
             what="refresh")
    time.sleep(2)  # the workers try version 2 meanwhile, and fail
    for _ in range(5):
        r = infer(served, "m")
        assert r.status_code == 200 and r.json()["version"] == "1"
        assert r.headers["x-model-cold"] == "0"
    explicit = control(served, "m", "load", version="2")
    assert explicit.status_code == 500 and "is broken" in explicit.json()["error"]
    assert infer(served, "m").json()["version"] == "1"


def test_an_unmodified_tritonclient_script_lists_loads_infers_and_unloads(
        tmp_path: Path) -> None:
    proc, base = serve(tmp_path)  # examples/models, as `make serve` does
    try:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "tritonclient_control.py"),
                              base.removeprefix("http://")],
                             capture_output=True, text=True, timeout=180)
    finally:
        proc.stop()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("index: ") and "iris READY" in lines[0]
    assert lines[1] == "loaded: iris ready = True"
    assert lines[2].startswith("metadata: [('features', 'FP32', [-1, 4])]")
    assert lines[3] == "infer: ['setosa', 'virginica']"
    assert lines[4] == "unloaded: iris ready = False"
    assert lines[5].startswith("refused: model 'iris' was unloaded")
    assert lines[6] == "loaded again: iris ready = True"


# -- RabbitMQ: two gateways, two workers ------------------------------------------------------
@pytest.fixture
def fleet_env() -> dict[str, str]:
    require_rabbitmq()
    return {"MODELFLEET_BROKER__QUEUE_PREFIX": f"e2e{uuid.uuid4().hex[:8]}.",
            "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"e2e{uuid.uuid4().hex[:8]}.events",
            "MODELFLEET_REPO_REFRESH_S": "0.5", **FAST}


@pytest.mark.rabbitmq
def test_control_across_two_gateways_and_two_workers(tmp_path: Path, versioned: Path,
                                                     repo: Path, fleet_env: dict[str, str],
                                                     procs: list[Proc]) -> None:
    url = rabbitmq_url()
    for name in ("w1", "w2"):
        proc, _ = worker(tmp_path, url, fleet_env, name, repo=repo)
        procs.append(proc)
    bases = []
    for name in ("g1", "g2"):
        proc, base = gateway(tmp_path, url, fleet_env, name, repo=repo)
        procs.append(proc)
        bases.append(base)
    g1, g2 = bases
    eventually_blocking(lambda: len(httpx.get(f"{g2}/v1/fleet").json()["workers"]) == 2,
                        what="fleet")
    r = control(g1, "m", "load", workers=2)
    assert r.status_code == 200, r.text
    assert sorted(r.json()["warm_on"]) == ["w1", "w2"]
    for _ in range(4):
        answer = infer(g2, "m")
        assert answer.status_code == 200 and answer.headers["x-model-cold"] == "0"

    assert control(g2, "m", "unload").status_code == 200
    for base in (g1, g2):
        eventually_blocking(lambda b=base: infer(b, "m").status_code == 503, what="refusal")
    proc, late = gateway(tmp_path, url, fleet_env, "g3", repo=repo)
    procs.append(proc)
    eventually_blocking(lambda: infer(late, "m").status_code == 503, timeout_s=10,
             what="a gateway started after the unload to refuse too")
    assert control(g1, "m", "load", workers=2).status_code == 200
    for base in (g1, g2, late):
        eventually_blocking(lambda b=base: infer(b, "m").status_code == 200, what="served again")

    with Traffic(g1, "m") as traffic:
        eventually_blocking(lambda: len(traffic.answers) >= 5, what="traffic")
        add_version(repo, "m", "2", load_s=2.0)
        eventually_blocking(lambda: traffic.versions()[-5:] == ["2"] * 5, what="only version 2")
    assert all(status == 200 for status, _, _ in traffic.answers), traffic.answers[-5:]
    assert [cold for _, cold, _ in traffic.answers] == ["0"] * len(traffic.answers)
    eventually_blocking(lambda: sorted(workers_holding(g2, "m")) == ["w1", "w2"], what="still warm")


@pytest.mark.rabbitmq
def test_a_pin_reaches_every_worker_on_rabbitmq(tmp_path: Path, repo: Path,
                                                fleet_env: dict[str, str],
                                                procs: list[Proc]) -> None:
    add_version(repo, "p", "1", load_s=0.2, max_workers=1)
    url = rabbitmq_url()
    for name in ("w1", "w2"):
        proc, _ = worker(tmp_path, url, fleet_env, name, repo=repo)
        procs.append(proc)
    proc, base = gateway(tmp_path, url, fleet_env, "g1", repo=repo)
    procs.append(proc)
    eventually_blocking(lambda: len(httpx.get(f"{base}/v1/fleet").json()["workers"]) == 2,
                        what="fleet")
    r = control(base, "p", "pin")
    assert r.status_code == 200 and sorted(r.json()["workers"]) == ["w1", "w2"], r.text
    eventually_blocking(lambda: sorted(workers_holding(base, "p")) == ["w1", "w2"],
                        what="pinned twice")
    # Like a pin in model.toml, it lifts the fan-out cap (1 here): both workers pull it
    # (once its queue exists: the first request declares it).
    for _ in range(3):
        answer = infer(base, "p")
        assert answer.status_code == 200 and answer.headers["x-model-cold"] == "0"
    eventually_blocking(lambda: sorted(w["worker_id"] for w in httpx.get(f"{base}/v1/fleet").json()
                            ["workers"] if "p" in w["subscriptions"]) == ["w1", "w2"],
             what="both workers pulling p")
    index = httpx.post(f"{base}/v2/repository/index").json()
    assert index[0]["pinned"] is True
