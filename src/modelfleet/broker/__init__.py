"""Brokers behind one protocol; ``open_broker`` picks one from a URL."""

from __future__ import annotations

from modelfleet.broker.base import (
    COLD_LANE,
    DEAD_LETTER_QUEUE,
    Broker,
    Delivery,
    Inbox,
    QueueStats,
    Subscription,
    cold_lane,
)
from modelfleet.settings import BrokerSettings

__all__ = [
    "COLD_LANE",
    "DEAD_LETTER_QUEUE",
    "Broker",
    "Delivery",
    "Inbox",
    "QueueStats",
    "Subscription",
    "cold_lane",
    "create_broker",
]


def create_broker(settings: BrokerSettings) -> Broker:
    """``memory`` gives the embedded broker; ``amqp://...`` gives RabbitMQ."""
    if settings.url == "memory":
        from modelfleet.broker.embedded import MemoryBroker

        return MemoryBroker(settings)
    from modelfleet.broker.rabbitmq.broker import AmqpBroker

    return AmqpBroker(settings, dead_letter_queue=settings.dead_letter_queue,
                      events_exchange=settings.events_exchange)
