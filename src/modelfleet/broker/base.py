"""The ``Broker`` protocol: the only link between gateways and workers.

Two implementations pass the same contract tests (tests/contract/):

- ``memory.MemoryBroker``: an embedded, in-process broker (the default for
  ``modelfleet serve`` and for fast tests). Real queues, prefetch windows,
  delivery counts, a delivery limit with dead-lettering, idle expiry.
- ``amqp.AmqpBroker``: RabbitMQ through aio-pika, for the distributed deployment.

Vocabulary:

- A *model queue* holds Tasks for one model id. Gateways publish into it
  (declaring it on first use); workers ``subscribe`` to the queues they choose.
- The *cold lane* (``cold_lane(priority)``) is one more queue per plan priority, shared
  by every model: a gateway
  puts there the first tasks of a model that no worker holds or pulls, and every
  worker takes from it while it has a permit free, so that a cold request waits for a
  delivery, not for a worker to notice its queue.
- An *inbox* is one gateway's reply queue; its address rides in every Task.
- *Events* are small broadcast messages (worker state, model demand) that every
  ``events()`` iterator sees.
- The *dead-letter queue* receives tasks that exceeded the delivery limit or that
  a worker dead-lettered explicitly, with the reason kept.

Every method raises ``BrokerUnavailable`` (never a library's own error) when the
broker cannot be reached; callers never see aio-pika or socket exceptions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from modelfleet.messages import EncodedReply, Reply, Task

DEAD_LETTER_QUEUE = "modelfleet.dead-letters"
# The cold lane: shared queues for tasks of models no worker holds or pulls, which any
# worker with a free permit takes directly; one per plan priority, so that a burst of
# one plan's cold requests does not queue another's behind it. Subscribe to one as to a
# model queue (no model id can be such a name: an id starts with a letter or a digit).
COLD_LANE = "_cold-lane"


def cold_lane(priority: int) -> str:
    """The cold lane of one plan priority (``scheduling.plan_priority``)."""
    return f"{COLD_LANE}.{priority}"


@dataclass(frozen=True)
class QueueStats:
    """Exact counts for one model queue at the moment it was asked."""

    model_id: str
    backlog: int  # messages ready for delivery (not counting unacked ones)
    consumers: int


@runtime_checkable
class Delivery(Protocol):
    """One task handed to a consumer. Settle it exactly once."""

    @property
    def task(self) -> Task: ...

    @property
    def body(self) -> bytes:
        """The task as it was encoded (``encode_task``), to be passed on without re-encoding.

        Its delivery count is not in it (``task.delivery_count`` is).
        """
        ...

    @property
    def death_reason(self) -> str:
        """Why a dead letter died ('' for a live task)."""
        ...

    async def ack(self) -> None: ...

    async def reject(self, requeue: bool) -> None:
        """Give the task back (requeue=True counts toward the delivery limit) or drop it."""
        ...

    async def release(self) -> None:
        """Give back a task this consumer never started, uncounted where the broker allows.

        (The embedded broker and RabbitMQ 4.3+ do not count it; RabbitMQ 3.x counts
        every return.)
        """
        ...

    async def dead_letter(self, reason: str) -> None:
        """Move the task to the dead-letter queue now, with ``reason`` kept, and settle it."""
        ...


class Subscription(Protocol):
    """A consumer on one queue; iterate it for deliveries."""

    @property
    def model_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[Delivery]: ...

    async def set_prefetch(self, prefetch: int) -> None:
        """Change how many unacked deliveries this consumer may hold."""
        ...

    async def cancel(self) -> None:
        """Stop receiving. Deliveries already handed out stay settleable."""
        ...


class Inbox(Protocol):
    """A gateway's own reply queue."""

    @property
    def address(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[Reply]:
        """Replies addressed to this inbox, decoded: the one place a reply is."""
        ...

    async def close(self) -> None: ...


class Broker(Protocol):
    @property
    def connected(self) -> bool: ...

    async def connect(self) -> None:
        """Connect (or start). Raises BrokerUnavailable if the first connect fails."""
        ...

    async def close(self) -> None: ...

    async def publish_task(self, task: Task, queue: str | None = None) -> None:
        """Durably enqueue ``task`` on its model's queue (or on ``queue``: a cold lane),
        declaring the queue if needed."""
        ...

    async def subscribe(self, model_id: str, prefetch: int) -> Subscription: ...

    async def open_inbox(self) -> Inbox: ...

    async def publish_reply(self, address: str, reply: EncodedReply) -> bool:
        """Deliver ``reply`` to the inbox at ``address``; returns once it is safe to ack.

        The reply's bytes are carried as they are (a broker that crosses a network may
        compress them on the way, and gives them back as they were).

        False means no such inbox exists (its gateway is gone): nobody is waiting.
        """
        ...

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        """Exact backlog and consumer counts; queues that do not exist are left out."""
        ...

    def live_queues(self) -> int:
        """Model queues alive on the broker as far as this process knows, without asking it
        (the embedded broker: exact; RabbitMQ: those this process declared or consumes
        whose expiry has not run out). Also exported as ``modelfleet_broker_live_queues``."""
        ...

    async def publish_event(self, event: dict[str, Any]) -> None: ...

    def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event published from now on, by anyone, until the broker closes."""
        ...

    async def subscribe_dead_letters(self, prefetch: int) -> Subscription: ...

    async def republish(self, task: Task) -> None:
        """Put a (dead-lettered) task back on its model queue with a fresh delivery count."""
        ...
