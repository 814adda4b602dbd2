"""Per-model environments and memory limits, through ``modelfleet serve``."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.procs import metric_sum, serve
from tests.waiting import eventually_blocking


def test_conflicting_pins_serve_side_by_side(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, env={"MODELFLEET_RUNTIME__VENV_DIR": str(tmp_path / "venvs")})
    try:
        old = httpx.post(f"{base}/v1/models/pinned-old/infer", json={}, timeout=120)
        new = httpx.post(f"{base}/v1/models/pinned-new/infer", json={}, timeout=120)
        assert old.status_code == 200, old.text
        assert new.status_code == 200, new.text
        assert old.json() == {"package": "six", "version": "1.15.0"}
        assert new.json() == {"package": "six", "version": "1.16.0"}
        # Built once per requirements hash: asking again builds nothing new.
        assert len([p for p in (tmp_path / "venvs").iterdir() if p.is_dir()]) == 2
        again = httpx.post(f"{base}/v1/models/pinned-old/infer", json={}, timeout=30)
        assert again.json()["version"] == "1.15.0"
        assert len([p for p in (tmp_path / "venvs").iterdir() if p.is_dir()]) == 2
        names = {r["name"] for r in
                 httpx.get(f"{base}/v1/fleet").json()["workers"][0]["runtimes"]}
        assert {"runtime-0", "model-pinned-old", "model-pinned-new"} <= names
    finally:
        proc.stop()


def test_memory_limit_kills_only_that_models_runtime(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, env={"MODELFLEET_WORKER__RESTART_BACKOFF_MAX_S": "0.5",
                                      "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5"})
    try:
        limit = httpx.post(f"{base}/v1/models/memhog/infer", json={}, timeout=60)
        assert limit.json() == {"memory_limit_bytes": 200 * 1024 * 1024}
        fits = httpx.post(f"{base}/v1/models/memhog/infer", json={"mb": 50}, timeout=60)
        assert fits.json() == {"allocated_mb": 50}
        hog = httpx.post(f"{base}/v1/models/memhog/infer", json={"mb": 300}, timeout=90)
        assert hog.status_code == 500
        assert hog.json()["error"]["code"] == "runtime_crashed"
        assert metric_sum(base, "modelfleet_runtime_restarts_total", reason="memory") >= 1
        # The shared runtime never noticed.
        iris = httpx.post(f"{base}/v1/models/iris/infer",
                          json={"features": [5.1, 3.5, 1.4, 0.2]}, timeout=30)
        assert iris.status_code == 200
        runtimes = {r["name"]: r for r in
                    httpx.get(f"{base}/v1/fleet").json()["workers"][0]["runtimes"]}
        assert runtimes["runtime-0"]["restarts"] == 0
        # And memhog itself recovers for sane inputs.
        assert httpx.post(f"{base}/v1/models/memhog/infer", json={"mb": 10},
                          timeout=60).json() == {"allocated_mb": 10}
    finally:
        proc.stop()


def test_unresolvable_requirement_is_a_clear_500(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package = repo / "impossible" / "1"
    package.mkdir(parents=True)
    (package / "model.toml").write_text(
        'name = "impossible"\nentrypoint = "handler:M"\naccepts = ["application/json"]\n'
        '[isolation]\nrequirements = ["definitely-not-a-package-xyz==1.0"]\n')
    (package / "handler.py").write_text(
        "from modelfleet import Model\n\nclass M(Model):\n"
        "    def predict(self, batch):\n        return batch\n")
    proc, base = serve(tmp_path, repo=repo,
                       env={"MODELFLEET_RUNTIME__VENV_DIR": str(tmp_path / "venvs")})
    try:
        response = httpx.post(f"{base}/v1/models/impossible/infer", json={}, timeout=120)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "model_load_failed"
        assert "definitely-not-a-package-xyz" in error["message"]
    finally:
        proc.stop()


def test_an_idle_isolated_runtime_is_stopped_and_comes_back(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, env={"MODELFLEET_WORKER__ISOLATED_IDLE_STOP_S": "1",
                                      "MODELFLEET_WORKER__DEMAND_WINDOW_S": "0.5",
                                      "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.3"})
    try:
        first = httpx.post(f"{base}/v1/models/memhog/infer", json={}, timeout=60)
        assert first.status_code == 200
        assert len(proc.runtimes()) == 2  # the shared one and memhog's own

        def memhog_runtime_gone() -> bool:
            names = {r["name"] for r in
                     httpx.get(f"{base}/v1/fleet").json()["workers"][0]["runtimes"]}
            return "model-memhog" not in names and len(proc.runtimes()) == 1

        eventually_blocking(memhog_runtime_gone, 30, what="the idle runtime stopped",
                            every_s=0.2)
        again = httpx.post(f"{base}/v1/models/memhog/infer", json={}, timeout=60)
        assert again.status_code == 200 and again.json() == first.json()
    finally:
        proc.stop()
