"""The private RabbitMQ node's failure paths: each a RabbitNodeError saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.devtools.rabbit_node import RabbitNode, RabbitNodeError
from tests.private_rabbit import require_rabbitmq_server


def test_a_missing_server_is_a_clear_error(tmp_path: Path) -> None:
    node = RabbitNode(tmp_path)
    node._server = str(tmp_path / "no-such-rabbitmq-server")  # internals: a machine without it
    with pytest.raises(RabbitNodeError, match="not found on PATH"):
        node.start()


@pytest.mark.rabbitmq
def test_a_node_that_dies_while_booting_says_so_and_leaves_nothing_running(
        tmp_path: Path) -> None:
    require_rabbitmq_server()
    node = RabbitNode(tmp_path, env_config="echo broken env config >&2; exit 3\n")
    with pytest.raises(RabbitNodeError, match=r"exited with 3: .*broken env config"):
        node.start(timeout_s=60)
    node.stop()  # idempotent after a failed start

