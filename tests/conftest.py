from __future__ import annotations

import os
import socket

import pytest

from modelfleet import metrics

pytest_plugins = ["tests.hang_report"]

# One test process runs many workers' models through one metrics registry, and tests read
# series by model: here every model keeps its label (test_gateway_listing holds the bound
# that a real worker process keeps, metrics_models).
metrics.bound_models(1_000_000)


def rabbitmq_url() -> str:
    return os.environ.get("MODELFLEET_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")


def own_deployment(tag: str) -> dict[str, str]:
    """The names of a deployment of its own on the shared RabbitMQ, for the processes a
    test starts: its queues under a prefix, and its events (workers' states, demand,
    cancels) on a fanout exchange of their own. A test that shares the exchange counts
    another test's workers in its fleet (seen: 2 workers and 17 permits where the test
    started one worker with one). The dead-letter queue stays the default one: a queue
    per test would be one more quorum queue that never expires on the shared node."""
    return {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
            "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events"}


def rabbitmq_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


def require_rabbitmq() -> None:
    """RabbitMQ tests never skip in CI; locally they skip when no broker is reachable."""
    if rabbitmq_reachable():
        return
    if os.environ.get("CI") == "true":
        pytest.fail("RabbitMQ is not reachable on 127.0.0.1:5672 and CI=true: "
                    "run .ci/rabbitmq-up")
    pytest.skip("RabbitMQ not reachable on 127.0.0.1:5672 (start it with .ci/rabbitmq-up)")


def require_redis() -> None:
    """Redis tests never skip in CI; locally they skip when none answers on 6379."""
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return
    except OSError:
        if os.environ.get("CI") == "true":
            pytest.fail("Redis is not reachable on 127.0.0.1:6379 and CI=true: run .ci/redis-up")
        pytest.skip("Redis not reachable on 127.0.0.1:6379 (start it with .ci/redis-up)")


# In CI, property-based tests explore the same examples every run, so a landing is never
# decided by luck; locally they keep exploring new ones.
from hypothesis import settings as hypothesis_settings  # noqa: E402

hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI") == "true":
    hypothesis_settings.load_profile("ci")

# A private RabbitMQ node (its own ports and a raised descriptor limit) for scale tests.
from tests.private_rabbit import private_rabbit  # noqa: E402

__all__ = ["private_rabbit"]
