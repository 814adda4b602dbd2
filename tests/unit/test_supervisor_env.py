"""What a runtime process is told: no signing secret, no broker credentials."""

from __future__ import annotations

from modelfleet.settings import BrokerSettings, Settings
from modelfleet.worker.supervisor import _is_secret, runtime_settings


def test_runtimes_get_no_secrets() -> None:
    settings = Settings(secret="hmac-key", broker=BrokerSettings(
        url="amqp://user:password@broker:5672/"))
    told = runtime_settings(settings)
    assert told.secret == "" and "password" not in told.model_dump_json()
    assert told.runtime == settings.runtime and told.repo == settings.repo
    assert _is_secret("MODELFLEET_SECRET") and _is_secret("MODELFLEET_BROKER")
    assert _is_secret("MODELFLEET_BROKER__URL")
    assert not _is_secret("MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES")
