"""Where aio-pika, aiormq and socket errors become modelfleet's, once, at the boundary.

Nothing outside ``modelfleet.broker.rabbitmq.broker*`` sees a library exception:

- the connection is gone, a channel died with it, a timeout passed, RabbitMQ
  refused a message (``basic.nack``: it could not store it now):
  ``BrokerUnavailable`` (retry later; nothing is wrong with the request);
- RabbitMQ closed a channel over something we asked for (a queue declared with
  other arguments, an access refusal): ``BrokerError`` (an operator must act).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from aiormq.exceptions import (
    AMQPConnectionError,
    AMQPError,
    ChannelClosed,
    ChannelInvalidStateError,
    ConnectionClosed,
    DeliveryError,
)

from modelfleet.errors import BrokerError, BrokerUnavailable


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raise any library error inside the block as BrokerUnavailable/BrokerError.

    ``what`` names the operation ("publish to model.resnet") so that the one line
    a caller logs says what failed and why.
    """
    try:
        yield
    except asyncio.CancelledError:
        # aiormq cancels the futures of RPCs in flight when the connection drops;
        # that is an outage. A cancellation of *our* task must pass through untouched.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise BrokerUnavailable(f"{what}: the connection to RabbitMQ was lost") from None
    except TimeoutError as exc:
        raise BrokerUnavailable(f"{what}: RabbitMQ did not answer in time") from exc
    except (ChannelInvalidStateError, ConnectionClosed, AMQPConnectionError) as exc:
        raise BrokerUnavailable(f"{what}: the connection to RabbitMQ was lost ({exc!r})") from exc
    except DeliveryError as exc:
        # A Basic.Nack (a Basic.Return is handled by callers before it gets here).
        raise BrokerUnavailable(f"{what}: RabbitMQ refused the message ({exc!r})") from exc
    except ChannelClosed as exc:
        raise BrokerError(f"{what}: RabbitMQ refused it: {exc}") from exc
    except AMQPError as exc:
        raise BrokerError(f"{what}: {exc!r}") from exc
    except (ConnectionError, OSError) as exc:
        raise BrokerUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


@asynccontextmanager
async def rpc(what: str, timeout_s: float) -> AsyncIterator[None]:
    """``translated`` plus one deadline for the whole block (never wait on a dead peer)."""
    with translated(what):
        async with asyncio.timeout(timeout_s):
            yield
