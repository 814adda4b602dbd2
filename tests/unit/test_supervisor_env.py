"""What a runtime process is told: no signing secret, no broker credentials."""

from __future__ import annotations

import os

import pytest

from modelfleet.settings import BrokerSettings, RuntimeSettings, Settings, WorkerSettings
from modelfleet.worker.supervisor import (
    THREAD_VARIABLES,
    _is_secret,
    compute_thread_env,
    runtime_settings,
)


def test_runtimes_get_no_secrets() -> None:
    settings = Settings(secret="hmac-key", broker=BrokerSettings(
        url="amqp://user:password@broker:5672/"))
    told = runtime_settings(settings)
    assert told.secret == "" and "password" not in told.model_dump_json()
    assert told.runtime == settings.runtime and told.repo == settings.repo
    assert _is_secret("MODELFLEET_SECRET") and _is_secret("MODELFLEET_BROKER")
    assert _is_secret("MODELFLEET_BROKER__URL")
    assert not _is_secret("MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES")


def test_runtimes_share_the_cores_between_their_compute_thread_pools(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    two = Settings(worker=WorkerSettings(shared_runtimes=2))
    assert compute_thread_env({}, two) == {name: "4" for name in THREAD_VARIABLES}
    many = Settings(worker=WorkerSettings(shared_runtimes=16))
    assert set(compute_thread_env({}, many).values()) == {"1"}  # never zero
    chosen = Settings(runtime=RuntimeSettings(compute_threads=3))
    assert set(compute_thread_env({}, chosen).values()) == {"3"}
    # What the operator set wins, variable by variable.
    told = compute_thread_env({"OMP_NUM_THREADS": "6"}, two)
    assert "OMP_NUM_THREADS" not in told and told["OPENBLAS_NUM_THREADS"] == "4"
