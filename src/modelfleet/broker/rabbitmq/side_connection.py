"""``SideConnection``: a connection kept apart from the work's, and whether it is up.

RabbitMQ answers some failures with a connection-level close (a channel number reused
while a 404's close was in flight; ``INTERNAL_ERROR`` on a ``basic.get``). What can
meet one (counting's passive declares, the keeper's declares and lease renewals) runs on
a connection of its own, so such a close costs only that work until aio-pika has
reopened it. This tracks that connection's state and logs each loss and return once
(aio-pika calls the close callbacks on every failed reconnect attempt too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aio_pika.abc import AbstractRobustConnection

log = logging.getLogger("modelfleet.broker.rabbitmq.broker")


class SideConnection:
    def __init__(self, connection: AbstractRobustConnection, name: str, while_down: str,
                 url: str, closing: Callable[[], bool]) -> None:
        """``name`` as the log says it ("counting", "keeper's"); ``while_down``: what
        fails until it is back; ``closing``: whether the broker is being closed (a close
        then is no loss)."""
        self.connection = connection
        self.up = True
        self._name = name
        self._while_down = while_down
        self._url = url
        self._closing = closing
        connection.close_callbacks.add(self._lost)
        connection.reconnect_callbacks.add(self._back)

    def _lost(self, _sender: object, exc: BaseException | None = None) -> None:
        if self._closing() or not self.up:
            return
        self.up = False
        log.warning("lost the %s connection to RabbitMQ at %s (%r); %s, nothing else is "
                    "touched", self._name, self._url, exc, self._while_down)

    def _back(self, _sender: object) -> None:
        self.up = True
        log.info("the %s connection to RabbitMQ at %s is back", self._name, self._url)
