"""A private RabbitMQ node for tests that need hundreds or thousands of queues.

The machine's shared RabbitMQ (127.0.0.1:5672) has about 1,000 file descriptors, and
RabbitMQ reserves three per quorum queue: a test that declared a thousand model
queues on it would lock every other client out. ``private_rabbit`` (a session fixture,
registered in tests/conftest.py) starts a node of its own instead
(``modelfleet.devtools.rabbit_node``), on free ports with ``ulimit -n 20000``, and
stops it after the session. Without rabbitmq-server such tests skip locally and fail
under CI=true, like every RabbitMQ test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelfleet.devtools.rabbit_node import RabbitNode, RabbitNodeError

SHARED_PORT = 5672


def require_rabbitmq_server() -> None:
    """Like every RabbitMQ test: skip locally without it, fail under CI=true."""
    if shutil.which("rabbitmq-server") is None and not Path(
            "/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        reason = "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} and CI=true")
        pytest.skip(reason)


def start_private_rabbit(base_dir: Path) -> RabbitNode:
    require_rabbitmq_server()
    node = RabbitNode(base_dir)
    try:
        node.start()
    except RabbitNodeError as exc:
        pytest.fail(f"could not start a private RabbitMQ node: {exc}")
    # What the scale tests rely on: not the shared node, and room for thousands of queues.
    assert node.port != SHARED_PORT, node.url
    return node


@pytest.fixture(scope="session")
def private_rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    node = start_private_rabbit(tmp_path_factory.mktemp("private-rabbit"))
    try:
        yield node
    finally:
        node.stop()
