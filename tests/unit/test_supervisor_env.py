"""What a runtime process is told: no signing secret, no broker credentials."""

from __future__ import annotations

import os

import pytest

from modelfleet.errors import ConfigError
from modelfleet.settings import BrokerSettings, RuntimeSettings, Settings, WorkerSettings
from modelfleet.worker.devices import runtime_device_env
from modelfleet.worker.supervised_runtime import (
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


def test_shared_runtime_i_of_a_gpu_worker_sees_device_i() -> None:
    assert [runtime_device_env(i, 2, {}) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "0"}]  # more runtimes than devices: they take turns
    assert runtime_device_env(5, 0, {"CUDA_VISIBLE_DEVICES": "3"}) == {}  # a CPU worker
    # The devices the node gave the worker, by their own numbers.
    given = {"CUDA_VISIBLE_DEVICES": "2, 3"}
    assert [runtime_device_env(i, 2, given)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == [
        "2", "3"]
    with pytest.raises(ConfigError, match=r"worker\.gpus is 2 but CUDA_VISIBLE_DEVICES=.5."):
        runtime_device_env(0, 2, {"CUDA_VISIBLE_DEVICES": "5"})
