"""The private RabbitMQ node: its failure paths (each a RabbitNodeError saying why), its ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.devtools.rabbit_node import DIST_PORT_RANGE, RabbitNode, RabbitNodeError, free_port
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



def test_the_distribution_port_leaves_rabbitmqctl_its_own() -> None:
    # rabbitmqctl listens on the node's distribution port + 10,000: above 55,535 it has none.
    low, high = DIST_PORT_RANGE
    assert high + 10_000 <= 65_536
    ports = {free_port(low, high) for _ in range(20)}
    assert all(low <= port < high for port in ports)


def test_no_free_port_in_a_range_is_a_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(RabbitNodeError, match="no free port"):
            free_port(port, port + 1)
