"""Fixtures for the broker contract: the same tests against every Broker implementation.

``make_broker(**settings)`` builds a connected broker of the parametrised kind with
names of its own (queue prefix, dead-letter queue, events exchange), so tests never
see each other's queues, nor those of anyone else sharing the RabbitMQ. Tests use
only the model ids in ``MODEL_IDS``, which teardown deletes.

RabbitMQ tests skip with a reason when none answers, except under ``CI=true``,
where they fail: a CI run that silently skipped them would prove nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from modelfleet.broker import Broker
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.settings import BrokerSettings
from tests.conftest import rabbitmq_url, require_rabbitmq
from tests.contract.brokers import delete_amqp_names

BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture(params=["memory", pytest.param("amqp", marks=pytest.mark.rabbitmq)])
def broker_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
async def make_broker(broker_kind: str, prefix: str) -> AsyncIterator[BrokerFactory]:
    if broker_kind == "amqp":
        require_rabbitmq()
    created: list[Broker] = []

    async def make(**overrides: Any) -> Broker:
        values: dict[str, Any] = {"queue_prefix": prefix, "queue_idle_expiry_s": 600,
                                  "reconnect_max_backoff_s": 0.5}
        values.update(overrides)
        broker: Broker
        if broker_kind == "memory":
            broker = MemoryBroker(BrokerSettings(url="memory", **values))
        else:
            broker = AmqpBroker(BrokerSettings(url=rabbitmq_url(), **values),
                                dead_letter_queue=prefix + "dead-letters",
                                events_exchange=prefix + "events",
                                connection_name=f"modelfleet-test {prefix}")
        await broker.connect()
        created.append(broker)
        return broker

    yield make
    for broker in created:
        await broker.close()
    if broker_kind == "amqp":
        await delete_amqp_names(prefix)


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> Broker:
    return await make_broker()


